"""The forced-call constraint inside vLLM (servers/engines/vllm_lead*.py), without vLLM: Model Runner V2's processor
(vLLM 0.33's default on CUDA, which the CPU build never runs) against a stand-in of V2's interface shaped exactly as
0.33's (checked against the committed manifest read from its wheel), `vllm_lead.LeadConstraint` built as each loader
builds it, the masking both share, and both on a lead widened by a token that crosses its end (issue 54). The V1
processor runs for real in tests/servers/test_vllm_engine.py."""

from __future__ import annotations

import abc
import importlib
import json
import sys
import types
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from tiny_model import build_tokenizer
from tool_model import CROSSING_MERGE, TIME_TOOL, TOOL_NAME

from servers.backends import SamplingParams
from servers.calls.chat_format import ChatFormatter
from servers.calls.tool_choice import ToolChoice
from servers.engines.lead_tokens import hold_to_lead
from servers.engines.vllm_http import completion_body

ENGINES = Path(__file__).resolve().parents[2] / "servers" / "engines"
MANIFEST = Path(__file__).parent / "vllm_contract" / "vllm-0.33.0.json"


# ---- stand-ins of vLLM 0.33's interfaces (vllm/v1/worker/gpu/sample/logits_processor/interface.py and
# ---- vllm/v1/sample/logits_processor/interface.py), signatures as there


class V2LogitsProcessor(abc.ABC):
    def __init__(self, vllm_config: Any, req_states: Any):  # noqa: B027 - as vLLM's
        pass

    @classmethod  # noqa: B027 - as vLLM's
    def validate_params(cls, sampling_params: Any) -> None:
        pass

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        return True

    def apply_staged_writes(self) -> None:  # noqa: B027 - as vLLM's
        pass

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class LogitsProcRequestState:
    device: Any = None
    max_num_reqs: int = 4
    vocab_size: int = 10
    all_token_ids: Any = None
    prompt_len: Any = None
    prefill_len: Any = None
    total_len: Any = None


@dataclass(frozen=True)
class LogitsContext:
    expanded_idx_mapping: torch.Tensor
    idx_mapping: torch.Tensor
    idx_mapping_np: np.ndarray
    expanded_local_pos: torch.Tensor
    input_ids: torch.Tensor
    pos: torch.Tensor
    seq_lens_upper_bound_np: np.ndarray


class V1LogitsProcessor(abc.ABC):
    @classmethod  # noqa: B027 - as vLLM's
    def validate_params(cls, sampling_params: Any):
        pass

    @abc.abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None: ...

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def is_argmax_invariant(self) -> bool: ...

    @abc.abstractmethod
    def update_state(self, batch_update: Any) -> None: ...


@pytest.fixture
def lead_modules(monkeypatch):
    """marl's in-vLLM modules imported fresh against the stand-ins (vLLM's process has servers/engines on its path)."""
    def module(name: str, **names: Any) -> None:
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**names, __path__=[]))

    module("vllm", SamplingParams=object)
    module("vllm.v1.worker.gpu.sample.logits_processor", LogitsProcessor=V2LogitsProcessor,
           LogitsContext=LogitsContext, LogitsProcRequestState=LogitsProcRequestState)
    module("vllm.v1.sample.logits_processor", LogitsProcessor=V1LogitsProcessor, BatchUpdate=object)
    module("vllm.v1.sample.logits_processor.builtin", process_dict_updates=lambda *args: None)
    monkeypatch.syspath_prepend(str(ENGINES))
    for name in ("vllm_lead", "vllm_lead_v1", "vllm_lead_v2", "lead_tokens"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module("vllm_lead")


def test_the_stand_in_is_shaped_as_vllm_033s_interface():
    facts = json.loads(MANIFEST.read_text())["classes"]
    for stand_in, key in ((V2LogitsProcessor, "logits_v2"), (V1LogitsProcessor, "logits_v1")):
        ours = {name: [p for p in _params(getattr(stand_in, name)) if p not in ("self", "cls")]
                for name in facts[key]["methods"]}
        assert ours == facts[key]["methods"] and sorted(stand_in.__abstractmethods__) == sorted(facts[key]["abstract"])
    assert [f.name for f in fields(LogitsContext)] == facts["logits_context"]["fields"]
    assert [f.name for f in fields(LogitsProcRequestState)] == facts["request_state"]["fields"]


def _params(function: Any) -> list[str]:
    import inspect

    return list(inspect.signature(function).parameters)


def test_each_loader_gets_the_implementation_of_its_interface(lead_modules):
    lead = lead_modules.LeadConstraint
    assert issubclass(lead, V2LogitsProcessor) and issubclass(lead, V1LogitsProcessor)  # both loaders accept it
    v2 = lead(None, LogitsProcRequestState())
    v1 = lead(None, torch.device("cpu"), False)
    assert type(v2).__name__ == "LeadConstraintV2" and isinstance(v2, V2LogitsProcessor)
    assert type(v1).__name__ == "LeadConstraintV1" and isinstance(v1, V1LogitsProcessor)
    lead.validate_params(SimpleNamespace(extra_args={"marl_lead": ["1 2"]}))
    with pytest.raises(ValueError):
        lead.validate_params(SimpleNamespace(extra_args={"marl_lead": "1 2"}))


class Runner:
    """The model runner's per-slot buffers as V2 shares them: committed tokens (device), prompt lengths (host and
    device), total lengths (device)."""

    def __init__(self, slots: int = 4, width: int = 16) -> None:
        self.all_token_ids = SimpleNamespace(gpu=torch.zeros(slots, width, dtype=torch.int32))
        self.prompt_len = SimpleNamespace(np=np.zeros(slots, dtype=np.int32))
        self.total_len = SimpleNamespace(gpu=torch.zeros(slots, dtype=torch.int32))

    def request(self, slot: int, prompt: list[int], output: list[int]) -> None:
        tokens = prompt + output
        self.all_token_ids.gpu[slot, :len(tokens)] = torch.tensor(tokens)
        self.prompt_len.np[slot] = len(prompt)
        self.total_len.gpu[slot] = len(tokens)

    def state(self) -> LogitsProcRequestState:
        return LogitsProcRequestState(all_token_ids=self.all_token_ids, prompt_len=self.prompt_len,
                                      total_len=self.total_len)


def context(slots: list[int], local: list[int] | None = None, inputs: list[int] | None = None) -> LogitsContext:
    rows = torch.tensor(slots)
    return LogitsContext(expanded_idx_mapping=rows, idx_mapping=rows, idx_mapping_np=np.array(sorted(set(slots))),
                         expanded_local_pos=torch.tensor(local or [0] * len(slots)),
                         input_ids=torch.tensor(inputs or [0] * len(slots)), pos=rows, seq_lens_upper_bound_np=None)


def params(*lead: str) -> SimpleNamespace:
    return SimpleNamespace(extra_args={"marl_lead": list(lead)} if lead else None)


def test_v2_holds_each_slot_to_its_lead_from_the_runners_committed_tokens(lead_modules):
    runner = Runner()
    processor = lead_modules.LeadConstraint(None, runner.state())
    assert processor.add_request(2, params("5 6 7", "5 8")) and not processor.add_request(0, params())
    runner.request(2, prompt=[1, 1, 1], output=[5])  # slot 2 spelled 5: next 6 or 8
    runner.request(0, prompt=[1], output=[3])
    logits = torch.zeros(2, 10)
    raw = logits.clone()
    out = processor.apply(logits, context([0, 2]))  # row 0 is slot 0 (free), row 1 slot 2
    assert torch.equal(out[0], raw[0])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [6, 8]
    runner.request(2, prompt=[1, 1, 1], output=[5, 8, 4, 4])  # spelled "5 8" and went on: free for good
    processor.apply(torch.zeros(2, 10), context([0, 2]))
    assert 2 not in processor.leads


def test_v2_reads_the_draft_tokens_of_a_speculative_row(lead_modules):
    runner = Runner()
    processor = lead_modules.LeadConstraint(None, runner.state())
    processor.add_request(1, params("5 6 7"))
    runner.request(1, prompt=[1], output=[])
    # three rows of slot 1: before any draft, after draft 5, after drafts 5 and 6 (input_ids[0] is the last committed)
    out = processor.apply(torch.zeros(3, 10), context([1, 1, 1], local=[0, 1, 2], inputs=[1, 5, 6]))
    assert [torch.isfinite(row).nonzero().flatten().tolist() for row in out] == [[5], [6], [7]]


def test_a_recycled_slot_without_a_lead_is_free(lead_modules):
    runner = Runner()
    processor = lead_modules.LeadConstraint(None, runner.state())
    processor.add_request(3, params("9"))
    processor.add_request(3, params())  # the slot went to another request
    runner.request(3, prompt=[1], output=[])
    logits = torch.zeros(1, 10)
    assert torch.equal(processor.apply(logits, context([3])), torch.zeros(1, 10)) and not processor.leads


def test_the_shared_masking_frees_a_row_once_it_outgrew_every_sequence():
    logits = torch.zeros(1, 10)
    assert hold_to_lead(logits, 0, ((2, 3), (4,)), [2]) and torch.isfinite(logits[0]).nonzero().tolist() == [[3]]
    untouched = torch.zeros(1, 10)
    assert hold_to_lead(untouched, 0, ((2, 3),), [2, 3])  # spelled, not yet longer: still tracked, unmasked
    assert torch.equal(untouched, torch.zeros(1, 10))
    assert not hold_to_lead(untouched, 0, ((2, 3),), [2, 3, 9])


def test_both_processors_let_through_a_token_that_crosses_the_leads_end(lead_modules, monkeypatch):
    """The lead the server sends for a forced call (widened by `": {"`, which finishes `get_weather", "arguments":`
    and goes on), read from `vllm_xargs` as vLLM hands it over: V1 and V2 allow that token where the lead's own last
    one is due, and hold nothing once it is written."""
    tokenizer = build_tokenizer(extra_merges=(CROSSING_MERGE,))
    formatter = ChatFormatter(tokenizer, frozenset({tokenizer.eos_token_id}))
    names = (TOOL_NAME, TIME_TOOL["function"]["name"])
    texts = formatter.tool_call_format.name_leads(ToolChoice("required", names=names))
    weather = tuple(formatter.control_tokens.encode(texts[0], ()))
    crossing = tokenizer.convert_tokens_to_ids("".join(CROSSING_MERGE))
    body = completion_body([1], SamplingParams(max_tokens=8, lead=formatter.text_lead(texts)), max_tokens=8,
                           stop_token_ids=[0])
    request = SimpleNamespace(extra_args=body["vllm_xargs"])
    width = len(tokenizer)
    due, written = list(weather[:-1]), [*weather[:-1], crossing]

    runner = Runner(width=32)
    v2 = lead_modules.LeadConstraint(None, runner.state())
    v2.add_request(0, request)
    runner.request(0, prompt=[1], output=due)
    assert torch.isfinite(v2.apply(torch.zeros(1, width), context([0]))).nonzero()[:, 1].tolist() == sorted(
        {weather[-1], crossing})
    runner.request(0, prompt=[1], output=written)
    assert torch.isfinite(v2.apply(torch.zeros(1, width), context([0]))).all()

    v1_module = sys.modules["vllm_lead_v1"]
    monkeypatch.setattr(v1_module, "process_dict_updates", _process_dict_updates)
    v1 = lead_modules.LeadConstraint(None, torch.device("cpu"), False)
    output = list(due)  # the live list vLLM appends each token to
    v1.update_state(SimpleNamespace(added=[(0, request, [1], output)]))
    assert torch.isfinite(v1.apply(torch.zeros(1, width))).nonzero()[:, 1].tolist() == sorted({weather[-1], crossing})
    output.append(crossing)
    assert torch.isfinite(v1.apply(torch.zeros(1, width))).all()


def _process_dict_updates(rows: dict, batch_update: Any, new_state: Any) -> None:
    """vLLM 0.32's `process_dict_updates` (vllm/v1/sample/logits_processor/builtin.py), for added requests only."""
    for index, sampling_params, prompt, output in batch_update.added:
        if (state := new_state(sampling_params, prompt, output)) is not None:
            rows[index] = state
