"""What two gloo ranks of test_fsdp_scale.py run: each check is a function `check(rank, rendezvous, world_size, ...)`
spawned in fresh processes by `spawn_ranks`, writing what the test asserts on to a file. Kept apart from the test
module so that a rank imports only what it needs (every rank pays for its imports, on shared cores)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from marl.protocol import FSDPConfig, GRPOConfig
from servers.episodes.samples import Sample
from servers.trainers.fsdp_model import build_sharded_model
from servers.trainers.fsdp_state import full_weights
from servers.trainers.fsdp_worker import RankSpec, ShardedPolicy
from servers.trainers.grpo import micro_batch_loss
from servers.trainers.micro_batches import collate
from tests.servers.tensor_memory import PeakTensorMemory

CPU = torch.device("cpu")


def spawn_ranks(check, *args, world_size: int = 2) -> None:
    """Run `check(rank, rendezvous, world_size, *args)` in `world_size` fresh processes; a rank's exception is raised
    here with its traceback."""
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(_then_exit, args=(check, str(Path(scratch) / "rendezvous"), world_size, *args), nprocs=world_size)


def _then_exit(rank: int, check, *args) -> None:
    """`check`, then leave at once: its results are saved by then, and the interpreter's teardown of gloo's threads
    still aborted a rank now and then after the barrier below (SIGABRT, "terminate called without an active
    exception": once in a CI run of test_weight_replicas). A check that raises goes to mp.spawn as before."""
    check(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def gloo_group(rank: int, rendezvous: str, world_size: int):
    """A gloo group for the body. On a clean exit every rank meets at a barrier before the group is destroyed: a rank
    that tore its pairs down while its peer was still finishing a collective aborted at exit, "terminate called without
    an active exception" (1 run in 25 here; none in 50 with the barrier)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def gather_sharded(rank: int, rendezvous: str, world_size: int, model_dirs: list[str], out: str) -> None:
    """Build each model sharded (meta device, rank 0's broadcast), gather it back: rank 0 saves, per model, the full
    weights, every buffer, the tied aliases and whether the head is still the embeddings' tensor."""
    results = []
    with gloo_group(rank, rendezvous, world_size):
        mesh = init_device_mesh("cpu", (world_size,))
        for model_dir in model_dirs:
            model, aliases = build_sharded_model(Path(model_dir), mesh, CPU, dtype=torch.float32,
                                                 compute=torch.float32)  # fmt: skip
            weights = full_weights(model, aliases, torch.float32)
            buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
            tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
            results.append((weights, buffers, aliases, tied))
    if rank == 0:
        torch.save(results, out)


def micro_batch_gradients(rank: int, rendezvous: str, world_size: int, model_dir: str, out: str) -> None:
    """One pass of 1, 2 and 4 micro-batches, reduce-scattered after each (`ShardedPolicy._accumulate`) and with the
    sync off until the last: each rank saves its shard of the gradient and the pass's peak tensor memory, and the
    size of a full and of a sharded gradient."""
    results = {}
    with gloo_group(rank, rendezvous, world_size):
        config = FSDPConfig(ranks=world_size, learning_rate=1e-3)
        spec = RankSpec(model_dir=model_dir, config=config, world_size=world_size, device_type="cpu")
        policy = ShardedPolicy(rank, spec, None)
        for count in (1, 2, 4):
            plan = [[(plain_sample(rank, i), 1.0 - i)] for i in range(count)]
            for sync_every in (True, False):
                with PeakTensorMemory() as memory:
                    if sync_every:
                        policy._accumulate(plan, 4 * world_size, config, done=0, total=count)
                    else:
                        accumulate_with_sync_off(policy, plan, 4 * world_size, config)
                grads = {n: p.grad.to_local().clone() for n, p in policy.policy.named_parameters()}
                policy.optimizer.zero_grad(set_to_none=True)
                results[count, sync_every] = (grads, memory.peak)
        params = list(policy.policy.parameters())
        results["bytes"] = (sum(4 * p.numel() for p in params), sum(4 * p.to_local().numel() for p in params))
    torch.save(results, f"{out}.{rank}")


def accumulate_with_sync_off(policy: ShardedPolicy, plan, num_samples: int, config: GRPOConfig) -> None:
    """The former way: gradients kept unsharded and unreduced on every rank until the last micro-batch's backward."""
    for index, items in enumerate(plan):
        policy.policy.set_requires_gradient_sync(index == len(plan) - 1)
        mb = collate(items, CPU, policy.vocab_size)
        micro_batch_loss(policy.policy, None, mb, config, num_samples)[0].backward()
    policy.policy.set_requires_gradient_sync(True)


def plain_sample(rank: int, index: int) -> Sample:
    """24 tokens, the last 12 trained, different on every rank and micro-batch."""
    ids = [(37 * (t + 11 * index + 101 * rank)) % 400 for t in range(24)]
    mask = [0] * 12 + [1] * 12
    return Sample(episode_id=f"e{rank}.{index}", agent="a", token_ids=ids, loss_mask=mask,
                  logprobs=[-1.0 * m for m in mask], reward=1.0, policy_version=0, num_calls=1)  # fmt: skip
