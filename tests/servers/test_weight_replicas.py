"""Weights pushed into several vLLM replicas (data parallel) through vLLM's weight-transfer engine, on the CPU.

Which trainer rank posts which replica's bodies (`replica_posts`) for data parallel 1, 2 and 8 and tensor parallel
2; two real gloo FSDP ranks, each sharing its own gathered copy through a stand-in `share`, posting to two recording
replicas (and to one of two GPUs, and to one that refuses); the engine's side (`TransferSync`) calling every
replica around a push; and the buckets allocated with expandable segments off (recorded, since a CPU has no CUDA
allocator). None of it has run on a GPU.
"""

from __future__ import annotations

import base64
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_model import build_tiny_model

from servers.engines import weight_transfer
from servers.engines.vllm_process import VLLMLaunch, VLLMSettings
from servers.engines.vllm_push import TransferSync
from servers.engines.weight_transfer import (
    Replica,
    ReplicaPost,
    TransferTarget,
    WeightPusher,
    WeightTransferError,
    allocator_conf,
    conf_options,
    replica_posts,
    unique_tensors,
    with_expandable_segments,
)
from tests.servers.fsdp_rank_checks import spawn_ranks
from tests.servers.transfer_rank_checks import digest, push_to_replicas

TRANSFER_ROUTES = ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update"]


def target(backend: str, gpus_per_replica: list[tuple[int, ...]], trainer_gpus=(0,), **kwargs) -> TransferTarget:
    replicas = [Replica(f"http://127.0.0.1:{9000 + r}", f"s{r}", gpus) for r, gpus in enumerate(gpus_per_replica)]
    return TransferTarget(backend=backend, replicas=replicas, trainer_gpus=trainer_gpus, **kwargs)


# ------------------------------------------------------------------------------------------------------------------
# who posts what to which replica (pure)
# ------------------------------------------------------------------------------------------------------------------


def test_one_replica_on_the_trainers_gpu_is_posted_by_rank_0():
    assert replica_posts(target("ipc", [(0,)]), 1) == (ReplicaPost(0, "http://127.0.0.1:9000", 0, (0,)),)
    assert replica_posts(target("ipc", [(0,)], trainer_gpus=range(8)), 8) == (
        ReplicaPost(0, "http://127.0.0.1:9000", 0, (0,)),)


def test_data_parallel_2_each_replica_posted_by_the_rank_on_its_gpu():
    posts = replica_posts(target("ipc", [(2,), (3,)], trainer_gpus=(2, 3)), 2)
    assert [(p.replica, p.url, p.poster, p.ranks) for p in posts] == [
        (0, "http://127.0.0.1:9000", 0, (0,)), (1, "http://127.0.0.1:9001", 1, (1,))]


def test_data_parallel_8_on_8_trainer_gpus_numbered_by_the_trainers_order():
    trainer = (7, 6, 5, 4, 3, 2, 1, 0)  # rank i runs on trainer_gpus[i]
    posts = replica_posts(target("ipc", [(g,) for g in range(8)], trainer_gpus=trainer), 8)
    assert [(p.poster, p.ranks) for p in posts] == [(7 - g, (7 - g,)) for g in range(8)]
    assert len({p.url for p in posts}) == 8


def test_tensor_parallel_2_a_body_holds_both_workers_ranks_and_the_first_posts():
    posts = replica_posts(target("ipc", [(0, 1), (2, 3)], trainer_gpus=range(4)), 4)
    assert [(p.poster, p.ranks) for p in posts] == [(0, (0, 1)), (2, (2, 3))]
    # TP 2 x DP 4 on 8 GPUs, one node of a 2-node trainer (16 ranks: ranks 8-15 on the other node post nothing)
    posts = replica_posts(target("ipc", [(0, 1), (2, 3), (4, 5), (6, 7)], trainer_gpus=range(8)), 16)
    assert [(p.poster, p.ranks) for p in posts] == [(0, (0, 1)), (2, (2, 3)), (4, (4, 5)), (6, (6, 7))]


def test_nccl_rank_0_posts_to_every_replica_which_join_one_group_one_after_another():
    t = target("nccl", [(4, 5), (6, 7)], trainer_gpus=range(4))
    assert [(p.replica, p.poster, p.ranks) for p in replica_posts(t, 4)] == [(0, 0, ()), (1, 0, ())]
    assert t.world_size == 5 and [t.rank_offset(r) for r in range(2)] == [1, 3]


@pytest.mark.parametrize(("gpus", "trainer", "world"), [
    ([(0,), (1,)], (0,), 1),  # the one-process trainer cannot feed a second GPU
    ([(0, 1)], (0, 1), 1),  # nor a worker on a GPU whose rank does not exist
    ([(3,)], (0, 1, 2), 3),  # no rank on GPU 3
])
def test_a_worker_without_a_rank_on_its_gpu_is_refused_before_anything_moves(gpus, trainer, world):
    with pytest.raises(WeightTransferError, match="host no trainer rank"):
        replica_posts(target("ipc", gpus, trainer_gpus=trainer), world)


# ------------------------------------------------------------------------------------------------------------------
# expandable segments off while the shared buckets are allocated
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("conf", ["expandable_segments:True", None])
def test_the_buckets_are_allocated_and_shared_with_expandable_segments_off(recording, monkeypatch, conf):
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CUDA path, recorded
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: events.append("ipc_collect"))
    monkeypatch.setattr(weight_transfer, "set_allocator_settings", events.append)
    if conf is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)

    def share(tensor: torch.Tensor) -> dict[str, tuple]:
        events.append("share")
        return {"GPU-0": (tensor.numel(),)}

    vllm = recording()
    tensors = [(f"model.layers.{i}.w", torch.ones(4)) for i in range(3)]
    WeightPusher(share=share).push(TransferTarget("ipc", [Replica(vllm.url, "s")], bucket_bytes=1), tensors)
    shared = ["share", "ipc_collect"] * 3  # each bucket's handles collected once the next can reuse its blocks
    released = ["ipc_collect", "empty_cache"]  # after the last bucket: back to the driver before the KV cache wakes
    if conf is None:  # off already: nothing to switch
        assert events == shared + released
    else:
        assert events == ["empty_cache", "expandable_segments:False", *shared, "empty_cache",
                          "expandable_segments:True", *released]


def test_the_allocator_toggle_keeps_every_other_option(monkeypatch):
    conf = "max_split_size_mb:128, expandable_segments:True,roundup_power2_divisions:[256:1,512:2],backend:native"
    assert conf_options(conf) == [("max_split_size_mb", "128"), ("expandable_segments", "True"),
                                  ("roundup_power2_divisions", "[256:1,512:2]"), ("backend", "native")]
    assert with_expandable_segments(conf, False) == ("max_split_size_mb:128,expandable_segments:False,"
                                                     "roundup_power2_divisions:[256:1,512:2],backend:native")
    assert with_expandable_segments("garbage_collection_threshold:0.6", True) == \
        "garbage_collection_threshold:0.6,expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert allocator_conf() == "max_split_size_mb:64,expandable_segments:True"


# ------------------------------------------------------------------------------------------------------------------
# two gloo FSDP ranks, two replicas
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-replicas"), num_layers=3)


def bf16_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    return {name: t.to(torch.bfloat16) for name, t in unique_tensors(state.items())}


def received(vllm) -> list[tuple[str, dict[str, tuple]]]:
    """(name, handles) of every tensor the replica was sent, in order."""
    got = []
    for path, _, body in vllm.calls:
        if path == "/update_weights":
            info = body["update_info"]
            got += zip(info["names"], pickle.loads(base64.b64decode(info["ipc_handles_pickled"])), strict=True)
    return got


def check_every_tensor_once(got: list, state: dict[str, torch.Tensor], ranks: dict[str, int]) -> None:
    """Each tensor once, in order, with a handle from each of `ranks` ({gpu uuid: rank}) of that rank's own copy."""
    assert [name for name, _ in got] == list(state)
    for name, handles in got:
        assert handles == {gpu: (rank, list(state[name].shape), digest(state[name])) for gpu, rank in ranks.items()}


@pytest.mark.timeout(300)
def test_two_fsdp_ranks_each_feed_the_replica_on_their_gpu(recording, model_dir, tmp_path):
    state = bf16_state(model_dir)
    a, b, both, refusing, fine = (recording(), recording(), recording(),
                                  recording(failing=("/update_weights",)), recording())
    two = TransferTarget("ipc", [Replica(a.url, "a", (0,)), Replica(b.url, "b", (1,))], trainer_gpus=(0, 1),
                         bucket_bytes=40_000)
    tp2 = TransferTarget("ipc", [Replica(both.url, "both", (0, 1))], trainer_gpus=(0, 1))
    failing = TransferTarget("ipc", [Replica(refusing.url, "r", (1,)), Replica(fine.url, "f", (0,))],
                             trainer_gpus=(0, 1), bucket_bytes=40_000)
    out = tmp_path / "pushed"
    spawn_ranks(push_to_replicas, str(model_dir), [two, tp2, failing, two], str(out))
    ranks = [torch.load(f"{out}.{rank}") for rank in (0, 1)]

    results = [r["results"] for r in ranks]
    assert results[0] == results[1]  # every outcome the same on every rank
    assert results[0][0] is None and results[0][1] is None and results[0][3] is None
    assert "/update_weights answered 500" in results[0][2]

    for vllm, gpu, rank in ((a, "GPU-0", 0), (b, "GPU-1", 1)):  # pushed twice: once each time
        got = received(vllm)
        check_every_tensor_once(got[: len(state)], state, {gpu: rank})
        check_every_tensor_once(got[len(state):], state, {gpu: rank})
    check_every_tensor_once(received(both), state, {"GPU-0": 0, "GPU-1": 1})  # TP 2: both GPUs' in one body
    for vllm in (a, b):
        paths = vllm.paths()
        assert paths.count("/init_weight_transfer_engine") == 1 and paths.count("/finish_weight_update") == 2
        assert paths[:2] == TRANSFER_ROUTES[:2] and paths[-1] == TRANSFER_ROUTES[-1]
    assert "/finish_weight_update" not in fine.paths()  # the refusal stopped every replica at the same bucket
    assert fine.paths().count("/update_weights") == refusing.paths().count("/update_weights") == 1

    urls = [[{url for url, _ in push} for push in r["posted"]] for r in ranks]  # per rank, per push
    assert urls[0] == [{a.url}, {both.url}, {fine.url}, {a.url}]  # rank 0: the replica on GPU 0, TP 2's body
    assert urls[1] == [{b.url}, set(), {refusing.url}, {b.url}]  # rank 1: the replica on GPU 1 only


# ------------------------------------------------------------------------------------------------------------------
# the engine's side: every replica paused and resumed around one push
# ------------------------------------------------------------------------------------------------------------------


def stand_in_processes(*servers) -> list[SimpleNamespace]:
    return [SimpleNamespace(url=s.url, pid=100 + i, port=8000 + i) for i, s in enumerate(servers)]


def test_transfer_sync_pauses_and_resumes_every_replica_around_one_push(recording):
    launch = VLLMLaunch(Path("/m"), 4096, device="cuda", settings=VLLMSettings(tensor_parallel_size=2,
                        data_parallel_size=2), engine_gpus=(4, 5, 6, 7), trainer_gpus=range(8), nccl_library=None)
    stats = SimpleNamespace(weight_transfers=0, weight_transfer_failures=0)
    sync, replicas = TransferSync(launch, stats), [recording(), recording()]
    assert sync.off is None  # colocated at TP 2 x DP 2: ipc
    targets: list[TransferTarget] = []

    def push(t: TransferTarget) -> None:
        assert all(r.paths() == ["/pause?mode=wait"] for r in replicas)  # both paused before the push
        targets.append(t)

    assert sync.sync(stand_in_processes(*replicas), push, asleep=False)
    assert [r.paths() for r in replicas] == [["/pause?mode=wait", "/reset_prefix_cache", "/resume"]] * 2
    (t,) = targets
    assert t.backend == "ipc" and t.trainer_gpus == tuple(range(8)) and t.dtype == "bfloat16"
    assert [(r.url, r.session, r.gpus) for r in t.replicas] == [
        (replicas[0].url, "100@8000", (4, 5)), (replicas[1].url, "101@8001", (6, 7))]
    assert stats.weight_transfers == 1

    def fails(_: TransferTarget) -> None:
        raise WeightTransferError("replica 1 refused")

    asleep = [recording(), recording()]
    assert not sync.sync(stand_in_processes(*asleep), fails, asleep=True)
    assert [r.paths() for r in asleep] == [["/wake_up?tags=weights"]] * 2  # left waking for the disk sync
    assert stats.weight_transfer_failures == 1 and "replica 1 refused" in sync.off
