"""Many LoRA adapters over one base model, in one forward pass: each row of the batch uses its own adapter.

A LoRA adapter changes a linear layer y = W x + b into y = W x + b + s B A x, with A: r x in, B: out x r and the
scaling s = alpha / r (PEFT's `LoraLayer`, dropout off at inference). With n adapters loaded, each adapted layer
keeps them stacked, the scaling folded into B and ranks below the largest one zero-padded (exact: the padding adds
zero products):

    A: [n, r_max, in]    B: [n, out, r_max]    (B[k] = s_k B_k)

A forward over rows with adapters k_1..k_rows (0: the bare base) computes W x + b for every row, then, for each
adapter k present in the batch, only over the rows that use it:

    y[rows_k] += (x[rows_k] A[k]^T) B[k]^T

Rows are selected, never masked: a row reads no other adapter's weights, so nothing in another adapter (a NaN, an
inf, a 1e30 that overflows) reaches it (multiplying by a 0/1 mask would: 0 x NaN = NaN). A base row gets no delta
at all, so its output is bit-identical to the unadapted model's, and an adapted row's output does not depend on
which adapters the other rows use. It costs a gather, two small matmuls and a scatter per adapter present per
layer (one pair of matmuls when every row uses one adapter); a forward whose rows are all base skips the adapters
altogether. vLLM's punica kernels (the vLLM engine) also index each row's adapter rather than mask.

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
    """One adapted Linear's stacked adapters (A: [n, r_max, in], B: [n, out, r_max]; slot k - 1 is adapter k)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        weight = linear.weight
        self.a = weight.new_zeros((0, 0, linear.in_features))
        self.b = weight.new_zeros((0, linear.out_features, 0))

    def resize(self, n: int, rank: int) -> None:
        """Room for `n` adapters of rank `rank` (zero-padded; kept adapters keep their values)."""
        if (self.a.shape[0], self.a.shape[1]) == (n, rank):
            return
        a, b = self.a.new_zeros((n, rank, self.a.shape[2])), self.b.new_zeros((n, self.b.shape[1], rank))
        keep_n, keep_r = min(n, self.a.shape[0]), min(rank, self.a.shape[1])
        a[:keep_n, :keep_r] = self.a[:keep_n, :keep_r]
        b[:keep_n, :, :keep_r] = self.b[:keep_n, :, :keep_r]
        self.a, self.b = a, b

    def put(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Write one adapter (None: it does not adapt this layer; its slot becomes zero)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if a is not None and b is not None:
            self.a[slot, : a.shape[0]] = a
            self.b[slot, :, : b.shape[1]] = b


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
        #: For the forward running now: its row count and (slot, its rows; None: every row) of each adapter present;
        #: None: every row is base.
        self._groups: tuple[int, list[tuple[int, torch.Tensor | None]]] | None = None

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
        """Check `tensors` (PEFT's names) against the model and `spec`; ValueError naming the first bad key (a wrong
        shape, a dtype that is not floating point, a NaN or inf: such an adapter is never served)."""
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
            if not tensor.is_floating_point():
                raise ValueError(f"adapter {name!r}: {key!r} holds {tensor.dtype} values, not floating point")
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
            for part, values in (("A", a), ("B", b)):  # in the model's dtype: a 1e30 is inf in float16
                if not bool(torch.isfinite(values).all()):
                    raise ValueError(f"adapter {name!r}: base_model.model.{module}.lora_{part}.weight holds"
                                     f" non-finite values (NaN or inf) in {weight.dtype} (scaled by alpha / r)")
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
        self._groups = (len(indices), self._row_groups(indices)) if any(indices) else None
        try:
            yield
        finally:
            self._groups = None

    def _row_groups(self, indices: list[int]) -> list[tuple[int, torch.Tensor | None]]:
        """(slot, the rows that use it: None for all) of each adapter the rows use; base rows are in none."""
        device = next(iter(self._slots.values())).a.device
        groups = []
        for index in sorted(set(indices) - {0}):
            rows = [i for i, k in enumerate(indices) if k == index]
            groups.append((index - 1, None if len(rows) == len(indices) else torch.tensor(rows, device=device)))
        return groups

    def _adapt(self, slots: _Slots, base_forward: Any, x: torch.Tensor) -> torch.Tensor:
        """The forward of an adapted Linear: W x + b, plus each row's own B A x, over its rows only (see the module
        docstring)."""
        y = base_forward(x)
        if self._groups is None:
            return y
        count, groups = self._groups
        if x.dim() != 3 or x.shape[0] != count:
            raise RuntimeError(f"LoRA rows: an input of shape {tuple(x.shape)}, adapters set for {count} rows")
        for slot, rows in groups:
            a_t, b_t = slots.a[slot].t(), slots.b[slot].t()  # [in, r_max], [r_max, out]
            if rows is None:  # one adapter for the whole batch: no gather, no scatter
                flat = y.reshape(-1, y.shape[-1])
                y = torch.addmm(flat, torch.matmul(x, a_t).view(-1, a_t.shape[1]), b_t).view_as(y)
            else:
                y = y.index_add(0, rows, torch.matmul(torch.matmul(x.index_select(0, rows), a_t), b_t))
        return y
