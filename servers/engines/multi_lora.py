"""Many LoRA adapters over one base model, in one forward pass: each row of the batch uses its own adapter.

A LoRA adapter changes a linear layer y = W x + b into y = W x + b + s B A x, with A: r x in, B: out x r and the
scaling s = alpha / r (PEFT's `LoraLayer`, dropout off at inference). With n adapters loaded, each adapted layer
keeps them stacked, the scaling folded into B and ranks below the largest one zero-padded (exact: the padding adds
zero products):

    A: [n, r_max, in]    B: [out, n, r_max]    (B[:, k] = s_k B_k)

A forward over rows with adapters k_1..k_rows (0: the bare base) computes, for row i,

    h_i = A_flat x_i              A_flat = A.view(n * r_max, in): every adapter's down-projection at once
    h_i = h_i * onehot(k_i)       zero except the r_max entries of adapter k_i (all zero for a base row)
    y_i = W x_i + b + B_flat h_i  B_flat = B.view(out, n * r_max)

Computing every adapter's A x and masking it costs n * r_max extra columns per row, but it is two plain matmuls
that read each adapter once per forward, whatever the rows: for a few adapters of small rank at decode time
(weight-bound) that is less memory traffic than gathering a copy of A and B per row for batched matmuls, and far
fewer kernels than one matmul per adapter present. A base row's delta is an exact zero, so its output is
bit-identical to the unadapted model's; a forward whose rows are all base skips the adapters altogether.

Each adapted `nn.Linear` keeps its place and parameters, and only its `forward` is wrapped (base forward, then the
delta): the model's parameter names (what `load_weights` and a trainer's state dict use) stay as they are, and so
does the Linear's own forward (servers.engines.cpu_matmul's variant included). A wrapped forward is cheaper than a
forward hook, which takes every call through nn.Module's slow path.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from marl.protocol import LoraSpec

__all__ = ["MultiLora", "PreparedAdapter"]

# PEFT's names (`get_peft_model_state_dict`): base_model.model.<module path>.lora_A.weight / .lora_B.weight
_PEFT_NAME = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight")


class _Slots:
    """One adapted Linear's stacked adapters (A: [n, r_max, in], B: [out, n, r_max]; slot k - 1 is adapter k)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        weight = linear.weight
        self.a = weight.new_zeros((0, 0, linear.in_features))
        self.b = weight.new_zeros((linear.out_features, 0, 0))
        self.a_t, self.b_t = self.a.view(-1, self.a.shape[-1]).t(), self.b.view(self.b.shape[0], -1).t()

    def resize(self, n: int, rank: int) -> None:
        """Room for `n` adapters of rank `rank` (zero-padded; kept adapters keep their values)."""
        if (self.a.shape[0], self.a.shape[1]) == (n, rank):
            return
        a, b = self.a.new_zeros((n, rank, self.a.shape[2])), self.b.new_zeros((self.b.shape[0], n, rank))
        keep_n, keep_r = min(n, self.a.shape[0]), min(rank, self.a.shape[1])
        a[:keep_n, :keep_r] = self.a[:keep_n, :keep_r]
        b[:, :keep_n, :keep_r] = self.b[:, :keep_n, :keep_r]
        self.a, self.b = a, b
        self.a_t = a.view(-1, a.shape[-1]).t()  # [in, n * r_max]
        self.b_t = b.view(b.shape[0], -1).t()  # [n * r_max, out]

    def put(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Write one adapter (None: it does not adapt this layer; its slot becomes zero)."""
        self.a[slot].zero_()
        self.b[:, slot].zero_()
        if a is not None and b is not None:
            self.a[slot, : a.shape[0]] = a
            self.b[:, slot, : b.shape[1]] = b


class PreparedAdapter:
    """An adapter checked against the model and converted to its dtype and device, ready for `MultiLora.install`."""

    def __init__(self, name: str, rank: int, layers: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.name = name
        self.rank = rank
        self.layers = layers  # module path -> (A [rank, in], scaled B [out, rank])


class MultiLora:
    """LoRA adapters by name over one model; `rows` says which adapter each row of the next forwards uses.

    Not thread-safe: the engine installs adapters and runs forwards on its worker thread only (`prepare`, which
    only reads the model, may run anywhere).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self._slots: dict[str, _Slots] = {}  # module path -> its adapters, hooked once first adapted
        self._names: dict[str, int] = {}  # adapter name -> index (1..n; 0 is the base)
        self._free: list[int] = []  # indices of removed adapters, reused by the next new ones
        self._count = 0  # n: slots in the stacks (adapters loaded + free slots)
        self._rank = 0  # r_max
        self._mask: torch.Tensor | None = None  # [rows, n * r_max] for the forward running now; None: all base

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._names)

    def __contains__(self, name: str | None) -> bool:
        return name is None or name in self._names

    def index_of(self, name: str | None) -> int:
        """The index of adapter `name` (0 for None: the base model)."""
        if name is None:
            return 0
        try:
            return self._names[name]
        except KeyError:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(self._names)})") from None

    def load(self, name: str, tensors: Mapping[str, Any], spec: LoraSpec) -> None:
        """Serve adapter `name` (new, or replacing the one of that name in place); ValueError for bad tensors."""
        self.install(self.prepare(name, tensors, spec))

    def prepare(self, name: str, tensors: Mapping[str, Any], spec: LoraSpec) -> PreparedAdapter:
        """Check `tensors` (PEFT's names) against the model and `spec`; ValueError naming the first bad key."""
        targets = set(spec.target_modules)
        missing = targets - {path.rsplit(".", 1)[-1] for path in self._linears}
        if missing:
            raise ValueError(f"adapter {name!r}: the model has no linear layer named {sorted(missing)}")
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            match = _PEFT_NAME.fullmatch(key)
            linear = self._linears.get(match["module"]) if match else None
            if match is None or linear is None or match["module"].rsplit(".", 1)[-1] not in targets:
                raise ValueError(f"adapter {name!r}: {key!r} names no adapted linear layer of this model")
            part = match["part"]
            expected = (spec.rank, linear.in_features) if part == "A" else (linear.out_features, spec.rank)
            tensor = torch.as_tensor(tensor)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"adapter {name!r}: {key!r} has shape {tuple(tensor.shape)}, expected {expected}")
            parts.setdefault(match["module"], {})[part] = tensor
        if not parts:
            raise ValueError(f"adapter {name!r} has no tensors")
        layers = {}
        for module, ab in parts.items():
            if len(ab) != 2:
                raise ValueError(f"adapter {name!r}: {module!r} has lora_{next(iter(ab))} but not its pair")
            weight = self._linears[module].weight
            a = ab["A"].to(device=weight.device, dtype=weight.dtype)
            b = (ab["B"].double() * spec.scaling).to(device=weight.device, dtype=weight.dtype)
            layers[module] = (a, b)
        return PreparedAdapter(name, spec.rank, layers)

    def install(self, adapter: PreparedAdapter) -> None:
        """Serve a prepared adapter (between forwards); adapters of other names are untouched."""
        index = self._names.get(adapter.name)
        if index is None:
            index = self._free.pop(0) if self._free else self._count + 1
        self._names[adapter.name] = index
        self._count = max(self._count, index)
        self._rank = max(self._rank, adapter.rank)
        for module in adapter.layers.keys() - self._slots.keys():
            linear = self._linears[module]
            self._slots[module] = _Slots(linear)
            # The Linear's forward as it is now (an instance attribute where cpu_matmul replaced it).
            linear.forward = functools.partial(self._adapt, self._slots[module], linear.forward)
        for module, slots in self._slots.items():
            slots.resize(self._count, self._rank)
            slots.put(index - 1, *adapter.layers.get(module, (None, None)))

    def remove(self, name: str) -> None:
        """Stop serving adapter `name` (between forwards): its slot is zeroed and taken by the next new adapter.
        KeyError if it is not loaded."""
        index = self._names.pop(name)
        for slots in self._slots.values():
            slots.put(index - 1, None, None)
        self._free = sorted([*self._free, index])

    @contextlib.contextmanager
    def rows(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Within the block, row i of every forward uses adapter `adapters[i]` (None: the base model)."""
        indices = [self.index_of(name) for name in adapters]
        self._mask = self._row_mask(indices) if any(indices) else None
        try:
            yield
        finally:
            self._mask = None

    def _row_mask(self, indices: list[int]) -> torch.Tensor:
        """[rows, n * r_max]: ones over the r_max entries of each row's adapter (none for a base row)."""
        some = next(iter(self._slots.values())).a
        slot = torch.tensor(indices, device=some.device) - 1  # -1: the base, matches no slot
        mine = slot[:, None] == torch.arange(self._count, device=some.device)[None]
        return mine.to(some.dtype).repeat_interleave(self._rank, dim=1)[:, None, :]  # [rows, 1 (tokens), n * r]

    def _adapt(self, slots: _Slots, base_forward: Any, x: torch.Tensor) -> torch.Tensor:
        """The forward of an adapted Linear: W x + b, plus each row's own B A x (see the module docstring)."""
        y = base_forward(x)
        mask = self._mask
        if mask is None:
            return y
        if x.dim() != 3 or x.shape[0] != mask.shape[0]:
            raise RuntimeError(f"LoRA rows: an input of shape {tuple(x.shape)}, adapters set for {mask.shape[0]} rows")
        h = torch.matmul(x, slots.a_t).mul_(mask)
        return torch.addmm(y.reshape(-1, y.shape[-1]), h.view(-1, h.shape[-1]), slots.b_t).view_as(y)
