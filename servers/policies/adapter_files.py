"""A PEFT adapter directory that a request names (`POST /control/frozen`), read and checked before any engine sees it.

The path and the files come from a client, so every way they can be wrong is an `AdapterProblem` (a ValueError)
that names the file and what is wrong with it, and the route answers 400: a directory that is not there or whose
name is too long, an `adapter_config.json` that is not a JSON object or lacks `r` / `lora_alpha` / a list of
`target_modules`, an `adapter_model.safetensors` that is empty, truncated, not safetensors or whose header claims
more than the file holds, and tensors that are not floating point or hold a NaN or an inf (such an adapter is never
served: servers.engines.multi_lora).

Files are opened non-blocking and must be regular files: a FIFO (or a device) would otherwise block the read until a
writer came. The caller reads in a worker thread within `READ_TIMEOUT_S` (`read_adapter_within`), so a file that
still blocks (a stuck network mount) fails its own load only.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from marl.protocol import LoraSpec
from servers.errors import excerpt

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: How long reading one adapter's two files may take before its load is refused.
READ_TIMEOUT_S = 30.0
#: An adapter_config.json is a few hundred bytes.
MAX_CONFIG_BYTES = 2**20


class AdapterProblem(ValueError):
    """An adapter directory that cannot be served; the message names the file."""


async def read_adapter_within(directory: Path, timeout_s: float | None = None) -> tuple[dict[str, Any], LoraSpec]:
    """`read_adapter` in a worker thread, refused (AdapterProblem) if it takes more than `timeout_s` (default
    `READ_TIMEOUT_S`). A read that still blocks keeps its thread, not the event loop or another load."""
    timeout_s = READ_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        return await asyncio.wait_for(asyncio.to_thread(read_adapter, directory), timeout_s)
    except TimeoutError:
        raise AdapterProblem(f"{_shown(directory)}: reading its files took more than {timeout_s:g}s") from None


def read_adapter(directory: Path) -> tuple[dict[str, Any], LoraSpec]:
    """The adapter's tensors (PEFT's names, on the CPU) and its `LoraSpec`; AdapterProblem for anything wrong."""
    spec = _spec(directory / ADAPTER_CONFIG)
    return _tensors(directory / ADAPTER_WEIGHTS), spec


def _spec(path: Path) -> LoraSpec:
    try:
        config = json.loads(_read(path, MAX_CONFIG_BYTES))
    except (ValueError, RecursionError) as exc:
        raise AdapterProblem(f"{_shown(path)}: not JSON ({excerpt(str(exc), 120)})") from None
    if not isinstance(config, dict):
        raise AdapterProblem(f"{_shown(path)}: a JSON object is expected, not {type(config).__name__}")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in config:
            raise AdapterProblem(f"{_shown(path)}: no {key!r}")
    targets = config["target_modules"]
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterProblem(f"{_shown(path)}: target_modules is {excerpt(targets)}, not a list of layer names")
    try:
        return LoraSpec(rank=config["r"], alpha=config["lora_alpha"], dropout=config.get("lora_dropout", 0.0) or 0.0,
                        target_modules=tuple(sorted(targets)))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = {"rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout"}.get(str(first["loc"][0]),
                                                                                  str(first["loc"][0]))
        raise AdapterProblem(f"{_shown(path)}: {where} {excerpt(first.get('input'))}: {first['msg']}") from None


def _tensors(path: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load

    data = _read(path)
    if len(data) < 8:
        raise AdapterProblem(f"{_shown(path)}: {len(data)} bytes, too short for a safetensors file")
    header = int.from_bytes(data[:8], "little")
    if header > len(data) - 8:
        raise AdapterProblem(f"{_shown(path)}: its header claims {header} bytes, the file holds {len(data) - 8}"
                             " after the length")
    try:
        tensors = load(data)
    except Exception as exc:  # noqa: BLE001 - safetensors' own error type (a Rust one) for any malformed file
        raise AdapterProblem(f"{_shown(path)}: not a safetensors file ({excerpt(str(exc), 120)})") from None
    if not tensors:
        raise AdapterProblem(f"{_shown(path)}: holds no tensors")
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise AdapterProblem(f"{_shown(path)}: {excerpt(key)} holds {tensor.dtype} values, not floating point")
        if not bool(torch.isfinite(tensor).all()):
            raise AdapterProblem(f"{_shown(path)}: {excerpt(key)} holds non-finite values (NaN or inf)")
    return tensors


def _read(path: Path, limit: int | None = None) -> bytes:
    """The whole regular file at `path`; O_NONBLOCK: a FIFO opens at once (and is refused) instead of waiting."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise AdapterProblem(f"{_shown(path)}: no such file (give a policy checkpoint's adapter/ directory, on this"
                             " server's filesystem)") from None
    except OSError as exc:
        raise AdapterProblem(f"{_shown(path)}: cannot be opened ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # a directory, a FIFO, a device
            raise AdapterProblem(f"{_shown(path)}: not a regular file")
        if limit is not None and info.st_size > limit:
            raise AdapterProblem(f"{_shown(path)}: {info.st_size} bytes, more than the {limit} it may hold")
        with os.fdopen(fd, "rb", closefd=False) as file:
            return file.read()
    except OSError as exc:
        raise AdapterProblem(f"{_shown(path)}: cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)


def _shown(path: Path) -> str:
    """The path for a message, cut to its last 200 characters (a path may be as long as the body allows)."""
    text = str(path)
    return text if len(text) <= 200 else "..." + text[-197:]
