"""The memory arithmetic of one server's processes: the inference engine, a trainer rank, the disk per step.

Every function returns `Parts`: named byte counts, so a plan can show where the memory goes. The figures are the
tensors a process holds (what CUDA's caching allocator counts as allocated) plus, on a GPU, a fixed allowance per
process for the CUDA context; they are validated on this CPU against measured peaks (tests/servers/
test_plan_measured.py, bench/plan_accuracy.py) and have never been compared with a GPU's.

Trainer rank r of N (FSDP2, or the one-process GRPO trainer with N = 1), P parameters, master weights in fp32:

    between steps      parameters 4P/N + AdamW's two moments 8P/N
    during a step      + gradients 4P/N (fp32 shards; reduce-scattered every micro-batch, never held unsharded)
                       + activations of one micro-batch of T tokens, L layers, widths H, I (MLP), KV (keys/values):
                           per token and layer  c·(4I + 9H + 2KV) + 4·2H      (c = bytes of the compute dtype;
                           the 4I: gate, up, their activation and product; the 4·2H: the two RMSNorms' fp32 copies)
                         without checkpointing: all L layers; with it: the L layer inputs (c·H each) + one layer
                       + logits of one chunk of kept tokens: min(T, 1024) x V x (c + 12) (head output, its fp32
                         copy, log-softmax, and their gradients in the backward's recomputation)
                       + FSDP's gathered parameters: the root (embeddings, head) and two layers in the compute dtype
                       or, at the optimizer step, AdamW's temporary (the square root of its second moment, one
                         parameter-sized fp32 copy), whichever is larger

The coefficients were measured on this CPU with `PeakTensorMemory` (tests/servers/tensor_memory.py) for Llama-shaped
layers with transformers' SDPA attention (which never builds a [T, T] matrix here): 4I + 11.4H + 2.0KV fp32 values
per token and layer, within 2% across four shapes (SmolLM2's, and 8 heads with 8, 2 and 1 KV heads): the slope
in the micro-batch's length, since that mode counts an in-place operation on an existing tensor (an optimizer's)
as a new one. Whole peaks are compared with processes' resident memory instead (bench/plan_accuracy.py).

The one-process trainer of k LoRA policies (adapters of A_j parameters): the frozen fp32 base 4P, each adapter and
its AdamW moments 12·A_j, during a step one adapter's gradients 4·max A_j and the same activations and logits (the
backward still runs through every layer to reach the adapters below); no KL reference (the adapter turned off).
Sharded over n ranks (`trainer: fsdp`, servers/trainers/fsdp_lora.py): each rank keeps 1/n of the base, of the adapters
and of their AdamW moments, and gathers parameters as the full sharded trainer does, without a base gradient.

The vLLM engine on one of its `tp` GPUs, weights in `b` bytes (docs/backends.md):

    weights P·b/tp, activations of its profiling forward (max_num_batched_tokens through a layer, and the sampler's
    fp32 logits for max_num_seqs sequences), CUDA graphs (an allowance), the CUDA context (an allowance), and the
    KV cache: what gpu_memory_utilization leaves of the GPU after the rest, or kv_cache_gb.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .architecture import Architecture

__all__ = ["CUDA_CONTEXT_BYTES", "CUDA_GRAPHS_BYTES", "GB", "GIB", "Parts", "engine_vllm", "trainer_rank"]

GIB = 2**30
#: What devices are sold and configured in (placement.gpu_memory_gb), and what plans print.
GB = 1e9
#: Per CUDA process: the context, cuBLAS workspaces, NCCL buffers. An allowance, not a measurement.
CUDA_CONTEXT_BYTES = int(0.75 * GIB)
#: vLLM's captured CUDA graphs (it logs "Graph capturing finished ..., took 0.3-1.5 GiB"). An allowance.
CUDA_GRAPHS_BYTES = 1 * GIB
#: Tokens whose logits `token_logprobs_and_entropy` projects at once (servers/trainers/policy_model.py).
LOGITS_CHUNK_TOKENS = 1024
#: vLLM's defaults for its OpenAI server on an 80 GB H100 (vllm/engine/arg_utils.py).
VLLM_MAX_NUM_SEQS = 1024
VLLM_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass
class Parts:
    """Named byte counts, in the order they were added."""

    items: list[tuple[str, float]] = field(default_factory=list)

    def add(self, what: str, nbytes: float) -> Parts:
        if nbytes:
            self.items.append((what, float(nbytes)))
        return self

    def extend(self, other: Parts, prefix: str = "") -> Parts:
        for what, nbytes in other.items:
            self.add(prefix + what, nbytes)
        return self

    @property
    def total(self) -> float:
        return sum(nbytes for _, nbytes in self.items)


def activation_bytes_per_token_layer(arch: Architecture, compute_bytes: int) -> float:
    """What autograd keeps of one token in one decoder layer for the backward (see the module docstring)."""
    h, kv = arch.hidden_size, arch.kv_width
    return compute_bytes * (4 * arch.active_intermediate() + 9 * h + 2 * kv) + 4 * 2 * h


def activations(arch: Architecture, tokens: int, compute_bytes: int, checkpointing: bool) -> float:
    per_layer = tokens * activation_bytes_per_token_layer(arch, compute_bytes)
    if checkpointing:  # each layer keeps only its input; the backward recomputes one layer at a time
        return arch.num_layers * tokens * compute_bytes * arch.hidden_size + per_layer
    return arch.num_layers * per_layer


def logits_bytes(arch: Architecture, tokens: int, compute_bytes: int) -> float:
    return min(tokens, LOGITS_CHUNK_TOKENS) * arch.vocab_size * (compute_bytes + 12)


@dataclass(frozen=True)
class TrainerSetting:
    ranks: int = 1
    compute_bytes: int = 4  # 2 under bf16 mixed precision
    micro_batch_tokens: int = 4096
    trained_tokens: int | None = None  # of a micro-batch, projected onto the vocabulary (None: all of them)
    checkpointing: bool = False
    kl_reference: bool = False
    sharded: bool = False  # FSDP2 (gathers parameters) rather than one process holding them whole
    on_gpu: bool = False
    #: LoRA policies: each one's adapter parameters (empty: the model's own weights are trained)
    adapters: tuple[int, ...] = ()


def trainer_rank(arch: Architecture, s: TrainerSetting) -> tuple[Parts, Parts]:
    """(what one rank keeps between steps, its peak during a step) in bytes."""
    if s.adapters:
        return _lora_trainer(arch, s)
    p, n = arch.parameter_count(), s.ranks
    resident = Parts().add("parameters (fp32 shard)" if s.sharded else "parameters (fp32)", 4 * p / n)
    resident.add("AdamW moments (fp32)", 8 * p / n)
    if s.kl_reference:
        resident.add("KL reference", (s.compute_bytes if s.sharded else 4) * p / n)
    if s.on_gpu:
        resident.add("CUDA context", CUDA_CONTEXT_BYTES)
    passes = Parts().add("activations", activations(arch, s.micro_batch_tokens, s.compute_bytes, s.checkpointing))
    trained = s.micro_batch_tokens if s.trained_tokens is None else s.trained_tokens
    passes.add("logits (one chunk)", logits_bytes(arch, trained, s.compute_bytes))
    if s.sharded:
        gathered = (arch.embedding_params() + 2 * arch.layer_params()) * s.compute_bytes
        passes.add("gathered parameters", gathered + arch.layer_params() * (s.compute_bytes + 4))
    optimizer_step = Parts().add("AdamW temporaries", 4 * p / n)
    peak = Parts().extend(resident).add("gradients (fp32 shard)" if s.sharded else "gradients (fp32)", 4 * p / n)
    peak.extend(passes if passes.total >= optimizer_step.total else optimizer_step)
    return resident, peak


def _lora_trainer(arch: Architecture, s: TrainerSetting) -> tuple[Parts, Parts]:
    """The trainer of LoRA policies: a frozen fp32 base (no gradients, no AdamW; its KL reference is the adapter
    turned off), every policy's adapter and AdamW moments; one policy steps at a time. Sharded: 1/n of each."""
    n = s.ranks if s.sharded else 1
    adapters, largest = sum(s.adapters) / n, max(s.adapters) / n
    shard = " shard" if s.sharded else ""
    resident = Parts().add(f"parameters (fp32{shard}, frozen)", 4 * arch.parameter_count() / n)
    resident.add(f"{len(s.adapters)} adapters + AdamW moments (fp32{shard})", 12 * adapters)
    resident.add("CUDA context", CUDA_CONTEXT_BYTES if s.on_gpu else 0)
    passes = Parts().add("activations", activations(arch, s.micro_batch_tokens, s.compute_bytes, s.checkpointing))
    trained = s.micro_batch_tokens if s.trained_tokens is None else s.trained_tokens
    passes.add("logits (one chunk)", logits_bytes(arch, trained, s.compute_bytes))
    if s.sharded:  # the root and two layers gathered at a time, as the full sharded trainer; the base has no gradient
        passes.add("gathered parameters", (arch.embedding_params() + 2 * arch.layer_params()) * s.compute_bytes)
    peak = Parts().extend(resident).add(f"gradients (one adapter, fp32{shard})", 4 * largest)
    return resident, peak.extend(passes if passes.total >= 4 * largest else Parts().add("AdamW temporaries",
                                                                                         4 * largest))


@dataclass(frozen=True)
class VLLMSetting:
    gpu_bytes: float
    utilization: float
    kv_cache_bytes: float | None = None
    tensor_parallel: int = 1
    weight_bytes: int = 2  # bf16
    max_num_seqs: int = VLLM_MAX_NUM_SEQS
    max_num_batched_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS
    cuda_graphs: bool = True


def engine_vllm(arch: Architecture, s: VLLMSetting) -> tuple[Parts, float]:
    """(one of its GPUs' memory with the KV cache last, the KV cache's bytes); the KV cache is negative when the
    rest does not fit in utilization x the GPU."""
    tp, b = s.tensor_parallel, s.weight_bytes
    rest = Parts().add("weights", arch.parameter_count() * b / tp)
    per_token = arch.active_intermediate() * 3 / tp + (arch.q_width + 2 * arch.kv_width) / tp + 4 * arch.hidden_size
    rest.add("activations (profiling forward)", s.max_num_batched_tokens * per_token * b
             + s.max_num_seqs * arch.vocab_size * 4 * 2)  # fmt: skip
    rest.add("CUDA graphs", CUDA_GRAPHS_BYTES if s.cuda_graphs else 0).add("CUDA context", CUDA_CONTEXT_BYTES)
    kv = s.kv_cache_bytes if s.kv_cache_bytes is not None else s.utilization * s.gpu_bytes - rest.total
    return Parts().extend(rest).add("KV cache", max(kv, 0.0)), kv


def engine_vllm_asleep(awake: Parts) -> float:
    """What a sleeping vLLM (level 1: weights offloaded to host memory, KV cache dropped) still holds on its GPU."""
    keep = ("CUDA graphs", "CUDA context")
    return sum(nbytes for what, nbytes in awake.items if what in keep)


def engine_torch(arch: Architecture, *, weight_bytes: int, sequences: int, tokens_per_sequence: int,
                 prefix_cache_bytes: float, on_gpu: bool, prompt_tokens: int | None = None) -> Parts:  # fmt: skip
    """marl's torch engine: the weights, the running batch's KV cache (its buffers grow by doubling, so they hold one
    to two times what the batch does: 1.5 counted), the prefix cache's budget, and the transient of prefilling one
    prompt of `prompt_tokens` (default: all of a sequence) through one layer: the MLP's and the attention's inputs
    and outputs and, on the CPU, where SDPA takes its math path for a padded batch, the [heads, prompt, prompt] fp32
    scores. Calls that arrive together are prefilled together (up to 16k tokens), which this does not count."""
    parts = Parts().add("weights", arch.parameter_count() * weight_bytes)
    kv = sequences * tokens_per_sequence * arch.kv_bytes_per_token(weight_bytes)
    parts.add("KV cache (running batch)", 1.5 * kv).add("prefix cache", prefix_cache_bytes)
    prompt = tokens_per_sequence if prompt_tokens is None else prompt_tokens
    width = 3 * arch.active_intermediate() + 4 * arch.hidden_size + arch.q_width + 2 * arch.kv_width
    scores = 0 if on_gpu else arch.num_heads * prompt * prompt * 4
    parts.add("prefill activations", prompt * width * weight_bytes + scores)
    parts.add("sampling logits", sequences * arch.vocab_size * 4 * 2)
    return parts.add("CUDA context", CUDA_CONTEXT_BYTES if on_gpu else 0)


def disk_per_checkpoint(arch: Architecture, *, sharded: bool, export_bytes: int, adapters: tuple[int, ...] = ()
                        ) -> Parts:  # fmt: skip
    """A training checkpoint: fp32 parameters and AdamW moments (every rank's shards, or one file), and the model
    export a static server or `marl eval` serves (in the trainer's compute dtype); of LoRA policies, each policy's
    adapter and its AdamW moments only."""
    if adapters:
        return Parts().add(f"{len(adapters)} adapters + AdamW (fp32)", 12 * sum(adapters))
    p = arch.parameter_count()
    if sharded:
        return Parts().add("sharded parameters + AdamW (fp32)", 12 * p).add("model export", export_bytes * p)
    return Parts().add("model (fp32)", 4 * p).add("AdamW moments (fp32)", 8 * p)
