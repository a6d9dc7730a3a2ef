"""Run by vLLM's own python (`make vllm-contract`, PYTHONPATH = servers/engines): vLLM's real loaders load marl's
logits processor as vLLM would at start (both the V1 loader and Model Runner V2's, which the CPU build has too
though it runs V1) and each builds the implementation of its interface; the V2 one masks a batch through vLLM's
own `LogitsContext`. Prints one line per check; exits 1 on the first that fails."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import torch
from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState
from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_by_fqcns

LEAD = "vllm_lead:LeadConstraint"


def main() -> int:
    (v1,) = _load_logitsprocs_by_fqcns([LEAD])
    (v2,) = _load_v2_logitsprocs_by_fqcns([LEAD])
    print(f"the V1 loader takes {LEAD}: {type(v1(None, torch.device('cpu'), False)).__name__}")
    buffers = SimpleNamespace(all_token_ids=SimpleNamespace(gpu=torch.tensor([[1, 5, 0, 0]], dtype=torch.int32)),
                              prompt_len=SimpleNamespace(np=np.array([1], dtype=np.int32)),
                              total_len=SimpleNamespace(gpu=torch.tensor([2], dtype=torch.int32)))
    state = LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=1, vocab_size=10, prefill_len=None,
                                   **vars(buffers))
    processor = v2(None, state)
    processor.add_request(0, SimpleNamespace(extra_args={"marl_lead": ["5 6", "5 7"]}))
    one = torch.tensor([0])
    ctx = LogitsContext(expanded_idx_mapping=one, idx_mapping=one, idx_mapping_np=np.array([0]),
                        expanded_local_pos=one, input_ids=torch.tensor([5]), pos=torch.tensor([1]),
                        seq_lens_upper_bound_np=np.array([2]))
    allowed = torch.isfinite(processor.apply(torch.zeros(1, 10), ctx)[0]).nonzero().flatten().tolist()
    print(f"the V2 loader takes {LEAD}: {type(processor).__name__}, which allows {allowed} after 5")
    return 0 if allowed == [6, 7] else 1


if __name__ == "__main__":
    sys.exit(main())
