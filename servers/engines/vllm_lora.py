"""LoRA adapters on vLLM: the launch flags, and the adapters one vLLM engine serves.

vLLM serves many adapters of one base in one batch (`--enable-lora`); a request picks one by its `model` name. With
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` the server loads one at runtime (`POST /v1/load_lora_adapter`) and, with
`load_inplace`, replaces one under the same name without a restart. Two facts of vLLM 0.32 shape this module:

- vLLM keys its prefix cache on an adapter's name *and path* (`_gen_lora_extra_hash_keys`), so every load here
  comes from a new directory: blocks computed with an adapter's old weights are never reused for its new ones, and
  the other adapters' and the base's cached prefixes survive (no `reset_prefix_cache`).
- vLLM reads the adapter from that path whenever it is not in its cache (`--max-cpu-loras`), so each adapter's latest
  copy stays on disk while it is served; a restarted vLLM loads them all again.
- The CPU build's LoRA ops apply the last slot's adapter to the rows of the bare base in a batch that has adapters
  (their index -1 wraps around; vLLM PRs 48421 and 49656, open in 0.32). There, the base is served as an adapter
  of no weights (`BASE_STAND_IN`, one slot more), so no row ever carries that index.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from marl.protocol import LoraSpec

__all__ = ["LoraSlots", "VLLMAdapters", "link_or_copy", "lora_slots", "write_peft_adapter", "zero_adapter"]

#: The ranks vLLM accepts for `--max-lora-rank` (`MaxLoRARanks`, vllm/config/lora.py, 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: The environment variable that opens vLLM's runtime LoRA routes.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
#: The adapter of no weights that serves the bare base where vLLM's LoRA ops mishandle base rows (the CPU build).
BASE_STAND_IN = "marl-base"


@dataclass(frozen=True)
class LoraSlots:
    """What vLLM reserves for adapters: `max_loras` of them in one batch, of rank up to `max_rank`."""

    max_loras: int
    max_rank: int

    def args(self, *, base_stand_in: bool = False) -> list[str]:
        slots = self.max_loras + int(base_stand_in)
        return ["--enable-lora", "--max-loras", str(slots), "--max-lora-rank", str(self.max_rank)]


def lora_slots(specs: Iterable[LoraSpec]) -> LoraSlots | None:
    """The slots for these adapters (one per adapter; the rank rounded up to one vLLM takes); None: no adapters."""
    specs = list(specs)
    if not specs:
        return None
    rank = max(spec.rank for spec in specs)
    return LoraSlots(max_loras=len(specs), max_rank=next(r for r in VLLM_LORA_RANKS if r >= rank))


def write_peft_adapter(directory: Path, tensors: Mapping[str, Any], spec: LoraSpec, base_model: str) -> Path:
    """`tensors` (PEFT's names) and `spec` as a PEFT adapter directory, the format vLLM's LoRA loading reads."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
              "target_modules": list(spec.target_modules), "bias": "none", "use_rslora": False, "use_dora": False}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()},
              str(directory / "adapter_model.safetensors"))
    return directory


def zero_adapter(config: Any) -> dict[str, Any]:
    """An adapter that changes nothing: one rank-1 update of layer 0's q_proj, all zeros (vLLM refuses an adapter
    of no tensors). `config`: the base's transformers config (a Llama-style decoder)."""
    import torch

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    return {f"{prefix}.lora_A.weight": torch.zeros(1, config.hidden_size),
            f"{prefix}.lora_B.weight": torch.zeros(config.num_attention_heads * head_dim, 1)}


class VLLMAdapters:
    """The adapters one vLLM engine serves, each from its latest copy under `root` (see the module docstring).

    Callers serialize loads (the engine's lock); a policy's load runs when none of its generations does.
    """

    def __init__(self, root: Path, *, base_stand_in: Mapping[str, Any] | None = None) -> None:
        """`base_stand_in`: the base's stand-in adapter (`zero_adapter`), where it needs one."""
        self.root = root
        shutil.rmtree(root, ignore_errors=True)  # copies left by an engine whose process was killed outright
        self._copies: dict[str, Path] = {}
        self._loads = 0
        if base_stand_in is not None:
            spec = LoraSpec(rank=1, alpha=1, target_modules=("q_proj",))
            self._copies[BASE_STAND_IN] = write_peft_adapter(root / BASE_STAND_IN, base_stand_in, spec, "base")
        self.base_model_name = None if base_stand_in is None else BASE_STAND_IN  # what a base request names

    def model_of(self, adapter: str | None) -> str | None:
        """The `model` a request for `adapter` names (None: vLLM's base model)."""
        return self.base_model_name if adapter is None else adapter

    def __contains__(self, name: str) -> bool:
        return name in self._copies

    def load(self, urls: Iterable[str], name: str, directory: Path) -> None:
        """Serve the adapter in `directory` as `name` (new, or replacing the one of that name) on the vLLMs at `urls`
        (an engine's replicas)."""
        if name == BASE_STAND_IN:
            raise ValueError(f"{BASE_STAND_IN!r} is the name of marl's stand-in for the base model")
        self._loads += 1
        copy = self.root / f"{name}-{self._loads}"
        shutil.copytree(directory, copy, copy_function=link_or_copy)
        try:
            for url in urls:
                _load(url, name, copy)
        except BaseException:
            shutil.rmtree(copy, ignore_errors=True)
            raise
        previous, self._copies[name] = self._copies.get(name), copy
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)

    def unload(self, urls: Iterable[str], name: str) -> None:
        """Stop serving `name` on the vLLMs at `urls` (KeyError if it is not served)."""
        if name == BASE_STAND_IN:
            raise KeyError(name)
        copy = self._copies.pop(name)
        for url in urls:
            _post(url, "/v1/unload_lora_adapter", {"lora_name": name})
        shutil.rmtree(copy, ignore_errors=True)

    def load_all(self, url: str) -> None:
        """Load every served adapter (the base's stand-in first) into a vLLM that just (re)started."""
        for name, copy in self._copies.items():
            _load(url, name, copy)


def link_or_copy(source: str, destination: str) -> None:
    """A `copytree` copy function: a hard link where the filesystem allows one, else a copy. Safe for the files
    vLLM is handed (exported weights and adapters): they are written once and never changed."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def _load(url: str, name: str, path: Path) -> None:
    """vLLM serves the adapter at `path` as `name`, a new one or in place of the one of that name."""
    _post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "load_inplace": True})


def _post(url: str, route: str, body: dict[str, Any]) -> None:
    response = httpx.post(f"{url}{route}", json=body, timeout=httpx.Timeout(600.0, connect=10.0))
    if response.status_code != 200:
        raise RuntimeError(f"vLLM {route} answered {response.status_code}: {response.text[:1000]}")
