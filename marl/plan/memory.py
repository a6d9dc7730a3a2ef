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
                         (+ 8 per value with the entropy bonus, train.grpo.entropy_coef > 0)
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

On a GPU, beside those tensors (each an estimate from the sources named, never measured on a GPU):

    NCCL buffers       per communicator: channels x ring peers x (NCCL_BUFFSIZE 4 MiB for the Simple protocol +
                       4.7 MiB LL128 + 0.5 MiB LL) = 32 x 2 x 9.2 MiB = 0.57 GiB; a rank of N > 1 holds its FSDP
                       group's, and one more when its weights go to vLLM over nccl (rank 0's; counted on every rank)
    head gradient      the output head's gradient, unsharded (V x H in the compute dtype), from the first logits
                       chunk's backward until the root group's reduce-scatter at the backward's end (torch 2.13,
                       FSDPParamGroup.post_backward: the root reduces once all its parameters have gradients)
    root reduce        at that reduce-scatter, with the activations gone: the root's gathered parameters and
                       gradients (compute dtype) and their reduce_dtype copy (fp32), a moment of its own
    allocator residue  between steps, after the rank empties its cache (gc, torch.cuda.empty_cache(), synchronize,
                       at the end of every command, before vLLM wakes): its expandable segments unmap every 20 MiB
                       page that holds no live block, so what stays beyond the live tensors is the partly used
                       pages at the ends of runs of live tensors; allowed as one page per decoder layer (the AdamW
                       moments of a layer are allocated together, at the first step, amid its transients). Without
                       the empty_cache a rank would keep about its step's peak reserved.

A checkpoint (`dcp.async_save`, servers/trainers/fsdp_state.py) stages each rank's shards in host memory (torch
2.13's default stager: a plain CPU copy, `StagingOptions(False, False, False, False)`): 12P/N per rank, 12P x
(ranks on the box)/N per box; rank 0 meanwhile gathers the export (the full model in the compute dtype) into its
host memory, one tensor at a time through every rank's GPU (each holds one full tensor, at most V x H, then).

The vLLM engine on one of its `tp` GPUs, weights in `b` bytes (docs/backends.md):

    weights P·b/tp, activations of its profiling forward (max_num_batched_tokens through a layer, and the sampler's
    fp32 logits for max_num_seqs sequences), CUDA graphs (an allowance), the CUDA context (an allowance), and the
    KV cache: what gpu_memory_utilization leaves of the GPU after the rest, or kv_cache_gb. With tp > 1 one NCCL
    communicator among the rest (vLLM's profiling counts it in its budget); with weights over nccl one more, made
    after the start and so beyond gpu_memory_utilization. Asleep, its CUDA context, graphs and NCCL buffers stay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .architecture import Architecture

__all__ = ["ALLOCATOR_PAGE_BYTES", "CUDA_CONTEXT_BYTES", "CUDA_GRAPHS_BYTES", "GB", "GIB", "HOST_PROCESS_BYTES",
           "NCCL_COMMUNICATOR_BYTES", "Parts", "engine_vllm", "trainer_rank"]

MIB = 2**20
GIB = 2**30
#: What devices are sold and configured in (placement.gpu_memory_gb), and what plans print.
GB = 1e9
#: Per CUDA process: the context and cuBLAS workspaces (NCCL's buffers are their own term). An allowance.
CUDA_CONTEXT_BYTES = int(0.75 * GIB)
#: NCCL's buffers per connection: NCCL_BUFFSIZE (default 4 MiB, the Simple protocol's), LL128's 120 x 640 x 8 steps
#: x 8 bytes and LL's 8 x 512 x 8 steps x 16 bytes (NCCL's docs and device.h). An estimate, not a measurement.
NCCL_BUFFSIZE = 4 * MIB
NCCL_CONNECTION_BYTES = NCCL_BUFFSIZE + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
#: One communicator: up to 32 channels on an NVLink box, each a ring with a previous and a next peer (0.57 GiB).
NCCL_CHANNELS = 32
NCCL_COMMUNICATOR_BYTES = NCCL_CHANNELS * 2 * NCCL_CONNECTION_BYTES
#: The large pool's page of an expandable segment (the ranks' allocator, servers/trainers/fsdp_worker.py): the
#: granularity at which empty_cache can hand memory back.
ALLOCATOR_PAGE_BYTES = 20 * MIB
#: Host memory of one process that uses CUDA (the interpreter, torch's and CUDA's libraries, the context's host
#: side): the server, each trainer rank, each vLLM process. An allowance, not a measurement.
HOST_PROCESS_BYTES = 2 * GIB
#: vLLM's captured CUDA graphs (it logs "Graph capturing finished ..., took 0.3-1.5 GiB"). An allowance.
CUDA_GRAPHS_BYTES = 1 * GIB
#: Tokens whose logits `token_logprobs_and_entropy` projects at once (servers/trainers/policy_model.py).
LOGITS_CHUNK_TOKENS = 1024
#: Bytes per (kept token, vocabulary entry) the entropy bonus adds to a logits chunk's backward (the probabilities
#: kept for it, and their gradient): 8.0 measured on SmolLM2-135M, 512 kept tokens of 1,024 (bench/plan_accuracy.py's
#: grpo+entropy case: 192 MB more than the grpo case).
ENTROPY_BONUS_BYTES = 8
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


def logits_bytes(arch: Architecture, tokens: int, compute_bytes: int, entropy_bonus: bool = False) -> float:
    per_value = compute_bytes + 12 + (ENTROPY_BONUS_BYTES if entropy_bonus else 0)
    return min(tokens, LOGITS_CHUNK_TOKENS) * arch.vocab_size * per_value


@dataclass(frozen=True)
class TrainerSetting:
    ranks: int = 1
    compute_bytes: int = 4  # 2 under bf16 mixed precision
    micro_batch_tokens: int = 4096
    trained_tokens: int | None = None  # of a micro-batch, projected onto the vocabulary (None: all of them)
    checkpointing: bool = False
    kl_reference: bool = False
    entropy_bonus: bool = False  # train.grpo.entropy_coef > 0: the entropy's backward over the vocabulary
    sharded: bool = False  # FSDP2 (gathers parameters) rather than one process holding them whole
    on_gpu: bool = False
    #: LoRA policies: each one's adapter parameters (empty: the model's own weights are trained)
    adapters: tuple[int, ...] = ()
    #: NCCL communicators the rank holds buffers of (its group's; rank 0's weight push over nccl)
    nccl_communicators: int = 0


def nccl_buffers(communicators: int) -> float:
    """NCCL's buffers of `communicators` communicators (NCCL_COMMUNICATOR_BYTES each: see the constants)."""
    return communicators * NCCL_COMMUNICATOR_BYTES


def allocator_residue(arch: Architecture) -> float:
    """What a rank's caching allocator keeps beyond its live tensors once it emptied its cache: one partly used
    20 MiB page per decoder layer (module docstring, "allocator residue")."""
    return arch.num_layers * ALLOCATOR_PAGE_BYTES


def head_gradient(arch: Architecture, compute_bytes: int) -> float:
    """The output head's unsharded gradient, held through the backward until the root's reduce-scatter."""
    return arch.vocab_size * arch.hidden_size * compute_bytes


def root_reduce(arch: Architecture, compute_bytes: int) -> float:
    """At the root group's reduce-scatter: its gathered parameters and gradients, and their fp32 reduce copy."""
    return arch.embedding_params() * (2 * compute_bytes + 4)


def trainer_rank(arch: Architecture, s: TrainerSetting) -> tuple[Parts, Parts]:
    """(what one rank keeps between steps, its peak during a step) in bytes."""
    if s.adapters:
        return _lora_trainer(arch, s)
    p, n = arch.parameter_count(), s.ranks
    state = Parts().add("parameters (fp32 shard)" if s.sharded else "parameters (fp32)", 4 * p / n)
    state.add("AdamW moments (fp32)", 8 * p / n)
    if s.kl_reference:
        state.add("KL reference", (s.compute_bytes if s.sharded else 4) * p / n)
    if s.on_gpu:
        state.add("CUDA context", CUDA_CONTEXT_BYTES).add("NCCL buffers", nccl_buffers(s.nccl_communicators))
    passes = Parts().add("activations", activations(arch, s.micro_batch_tokens, s.compute_bytes, s.checkpointing))
    trained = s.micro_batch_tokens if s.trained_tokens is None else s.trained_tokens
    passes.add("logits (one chunk)", logits_bytes(arch, trained, s.compute_bytes, s.entropy_bonus))
    moments = [Parts().add("AdamW temporaries", 4 * p / n)]
    if s.sharded:
        gathered = (arch.embedding_params() + 2 * arch.layer_params()) * s.compute_bytes
        passes.add("gathered parameters", gathered + arch.layer_params() * (s.compute_bytes + 4))
        passes.add("head gradient (unsharded)", head_gradient(arch, s.compute_bytes))
        moments.append(Parts().add("root reduce-scatter", root_reduce(arch, s.compute_bytes)))
    peak = Parts().extend(state).add("gradients (fp32 shard)" if s.sharded else "gradients (fp32)", 4 * p / n)
    peak.extend(max([passes, *moments], key=lambda parts: parts.total))
    resident = Parts().extend(state).add("allocator residue", allocator_residue(arch) if s.on_gpu else 0)
    return resident, peak


def _lora_trainer(arch: Architecture, s: TrainerSetting) -> tuple[Parts, Parts]:
    """The trainer of LoRA policies: a frozen fp32 base (no gradients, no AdamW; its KL reference is the adapter
    turned off), every policy's adapter and AdamW moments; one policy steps at a time. Sharded: 1/n of each."""
    n = s.ranks if s.sharded else 1
    adapters, largest = sum(s.adapters) / n, max(s.adapters) / n
    shard = " shard" if s.sharded else ""
    resident = Parts().add(f"parameters (fp32{shard}, frozen)", 4 * arch.parameter_count() / n)
    resident.add(f"{len(s.adapters)} adapters + AdamW moments (fp32{shard})", 12 * adapters)
    if s.on_gpu:
        resident.add("CUDA context", CUDA_CONTEXT_BYTES).add("NCCL buffers", nccl_buffers(s.nccl_communicators))
    passes = Parts().add("activations", activations(arch, s.micro_batch_tokens, s.compute_bytes, s.checkpointing))
    trained = s.micro_batch_tokens if s.trained_tokens is None else s.trained_tokens
    passes.add("logits (one chunk)", logits_bytes(arch, trained, s.compute_bytes, s.entropy_bonus))
    if s.sharded:  # the root and two layers gathered at a time, as the full sharded trainer; the base has no gradient
        passes.add("gathered parameters", (arch.embedding_params() + 2 * arch.layer_params()) * s.compute_bytes)
    peak = Parts().extend(resident).add(f"gradients (one adapter, fp32{shard})", 4 * largest)
    peak.extend(passes if passes.total >= 4 * largest else Parts().add("AdamW temporaries", 4 * largest))
    return resident.add("allocator residue", allocator_residue(arch) if s.on_gpu else 0), peak


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
    #: weights arrive over NCCL (vllm.weight_sync nccl): a communicator made after the start, outside its budget
    weight_transfer_nccl: bool = False


def engine_vllm(arch: Architecture, s: VLLMSetting) -> tuple[Parts, float]:
    """(one of its GPUs' memory with the KV cache last, the KV cache's bytes); the KV cache is negative when the
    rest does not fit in utilization x the GPU."""
    tp, b = s.tensor_parallel, s.weight_bytes
    rest = Parts().add("weights", arch.parameter_count() * b / tp)
    per_token = arch.active_intermediate() * 3 / tp + (arch.q_width + 2 * arch.kv_width) / tp + 4 * arch.hidden_size
    rest.add("activations (profiling forward)", s.max_num_batched_tokens * per_token * b
             + s.max_num_seqs * arch.vocab_size * 4 * 2)  # fmt: skip
    rest.add("CUDA graphs", CUDA_GRAPHS_BYTES if s.cuda_graphs else 0).add("CUDA context", CUDA_CONTEXT_BYTES)
    rest.add("NCCL buffers (tensor parallel)", nccl_buffers(1) if tp > 1 else 0)  # profiled: inside its budget
    kv = s.kv_cache_bytes if s.kv_cache_bytes is not None else s.utilization * s.gpu_bytes - rest.total
    parts = Parts().extend(rest).add("KV cache", max(kv, 0.0))
    return parts.add("NCCL buffers (weight transfer)", nccl_buffers(1) if s.weight_transfer_nccl else 0), kv


def engine_vllm_asleep(awake: Parts) -> float:
    """What a sleeping vLLM (level 1: weights offloaded to host memory, KV cache dropped) still holds on its GPU."""
    return sum(nbytes for what, nbytes in awake.items if what.startswith(("CUDA", "NCCL")))


def largest_tensor(arch: Architecture) -> int:
    """Elements of the model's largest weight: the embeddings (or head), else an MLP or attention matrix."""
    mlp = arch.moe_intermediate_size if arch.num_experts else arch.intermediate_size
    return arch.hidden_size * max(arch.vocab_size, mlp, arch.q_width)


def checkpoint_host(arch: Architecture, *, ranks_here: int, ranks: int, export_bytes: int) -> Parts:
    """Host memory of one box while a sharded checkpoint is written: `dcp.async_save` stages the shards of its
    `ranks_here` ranks (fp32 parameters and AdamW's two moments: 12P/N each), and rank 0 gathers the export (the
    full model in `export_bytes` a value) into its own memory (module docstring)."""
    p = arch.parameter_count()
    parts = Parts().add(f"async_save staging ({ranks_here} ranks' shards)", 12 * p * ranks_here / ranks)
    return parts.add("rank 0's export gather", p * export_bytes)


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
