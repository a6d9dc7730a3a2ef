"""Placement on the server's side: every process a server starts sees only its GPUs, and a trainer's ranks span two
nodes. Real processes throughout; the GPUs are CUDA_VISIBLE_DEVICES values (this machine has none: what is checked
is what each child process sees, and a real training step over two "nodes" on 127.0.0.1 with gloo)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from marl.launch import free_port
from marl.protocol import GRPOConfig, TrainConfig
from servers.engines.vllm_process import VLLMLaunch
from servers.entrypoint import ServeOptions, default_trainer_factory, vllm_placement
from servers.placement import Placement, visible_devices
from servers.trainers.fsdp import FSDPConfig, FSDPTrainer, RankFailure
from servers.trainers.fsdp_nodes import NodeJob, NodeRendezvous
from servers.trainers.fsdp_worker import RankPlace, RankSpec
from servers.trainers.grpo import GRPOTrainer
from tests.servers.test_fsdp_trainer import KNOBS, assert_weights_close, exported, two_group_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOKEN = "placement-test-token"


@pytest.fixture(scope="module")
def one_node(model_dir):
    """Two ranks on this node, on trainer GPUs 1 and 3 of a server that sees physical GPUs 4-7."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
        env.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        trainer = FSDPTrainer(model_dir, FSDPConfig(ranks=2, **KNOBS), device="cpu", threads_per_rank=1,
                              placement=Placement(trainer_gpus=(1, 3)))  # fmt: skip
    yield trainer
    trainer.close()


def place_of(trainer: FSDPTrainer, rank: int) -> dict[str, str | None]:
    """The torchrun variables and CUDA_VISIBLE_DEVICES that rank's process reported from its own environment."""
    return trainer.ranks.started[rank]["env"]


def test_gpu_indices_count_the_gpus_the_server_sees():
    assert visible_devices([0, 2], {}) == "0,2"
    assert visible_devices([1], {"CUDA_VISIBLE_DEVICES": "4,5"}) == "5"  # e.g. the GPUs Ray gave the actor
    with pytest.raises(ValueError, match="sees only 2"):
        visible_devices([2], {"CUDA_VISIBLE_DEVICES": "4,5"})
    assert Placement(engine_gpus=(2,)).engine_device(None) == "cuda:2"  # the in-process torch engine
    assert Placement(engine_gpus=(2,)).engine_device("cpu") == "cpu"
    assert Placement().engine_device(None) is None  # no placement: as before


def test_ranks_of_a_node_see_its_trainer_gpus_and_pick_theirs_by_local_rank(one_node):
    for rank in (0, 1):
        assert place_of(one_node, rank) == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": place_of(one_node, 0)["MASTER_PORT"],
            "CUDA_VISIBLE_DEVICES": "5,7",  # trainer GPUs 1 and 3 of 4,5,6,7: both, so NCCL sees its peer
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",  # the rank's default (the plan assumes it)
        }  # fmt: skip


def test_a_users_allocator_setting_reaches_the_ranks(monkeypatch):
    place = RankPlace(rank=0, local_rank=0, local_world_size=1, master_addr="127.0.0.1", master_port=1)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert place.environment(1)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def start_trainer_node(port: int, node_rank: int, visible: str, *, token: str = TOKEN,
                       once: bool = True) -> subprocess.Popen:  # fmt: skip
    """`marl trainer-node` as a user runs it on the second machine (here: this one, seeing other GPUs)."""
    env = {**os.environ, "MARL_ADMIN_TOKEN": token, "CUDA_VISIBLE_DEVICES": visible}
    return subprocess.Popen([sys.executable, "-m", "marl.cli", "trainer-node", "--server", "127.0.0.1", "--port",
                             str(port), "--node-rank", str(node_rank), *(["--once"] if once else [])], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def test_a_second_node_joins_and_steps_as_the_one_node_group(one_node, model_dir, tmp_path):
    port = free_port()
    node = start_trainer_node(port, 1, visible="6,7")
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("CUDA_VISIBLE_DEVICES", "4,5")
            two_nodes = FSDPTrainer(model_dir, FSDPConfig(ranks=2, **KNOBS), device="cpu", threads_per_rank=1,
                                    placement=Placement(trainer_gpus=(1,), nodes=2, rendezvous_port=port),
                                    authkey=TOKEN.encode(), timeout_s=120)  # fmt: skip
        try:
            assert place_of(two_nodes, 0)["CUDA_VISIBLE_DEVICES"] == "5"  # GPU 1 of the server's 4,5
            remote = place_of(two_nodes, 1)
            assert remote["CUDA_VISIBLE_DEVICES"] == "7"  # GPU 1 of that node's own 6,7
            assert (remote["RANK"], remote["LOCAL_RANK"], remote["WORLD_SIZE"], remote["LOCAL_WORLD_SIZE"]) == (
                "1", "0", "2", "1")
            assert remote["MASTER_ADDR"] == "127.0.0.1" and remote["MASTER_PORT"] == place_of(two_nodes, 0)[
                "MASTER_PORT"]
            assert two_nodes.ranks.pids and len(two_nodes.ranks.pids) == 1  # only rank 0 is this node's process

            reference = GRPOTrainer(model_dir, GRPOConfig(**KNOBS))
            batch = two_group_batch(reference, AutoTokenizer.from_pretrained(model_dir))
            m_two, m_one = two_nodes.step(batch), one_node.step(batch)
            # the same split, the same gloo reductions: only the transport differs
            assert_weights_close(exported(two_nodes, tmp_path / "two"), exported(one_node, tmp_path / "one"),
                                 rel=1e-6)  # fmt: skip
            for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "micro_batches", "tokens_trained"):
                assert m_two[key] == pytest.approx(m_one[key], rel=1e-6, abs=1e-9), key
        finally:
            two_nodes.close()
        assert node.wait(timeout=60) == 0, node.stdout.read()  # its ranks left with the group, and so did it
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_a_node_that_never_joins_fails_the_start_naming_the_command(model_dir):
    started = time.monotonic()
    with pytest.raises(RankFailure, match=r"trainer nodes \[1\] did not join: run `marl trainer-node"):
        FSDPTrainer(model_dir, FSDPConfig(ranks=2, **KNOBS), device="cpu", threads_per_rank=1, timeout_s=3,
                    placement=Placement(nodes=2, rendezvous_port=free_port()), authkey=TOKEN.encode())  # fmt: skip
    assert time.monotonic() - started < 60


def test_the_rendezvous_admits_only_the_admin_token_and_known_nodes(model_dir):
    port = free_port()
    door = NodeRendezvous(port, TOKEN.encode())
    silent = socket.create_connection(("127.0.0.1", port))  # says nothing: must not hold the door shut
    try:
        with pytest.raises(AuthenticationError):
            Client(("127.0.0.1", port), authkey=b"wrong")
        job = NodeJob(RankSpec(model_dir=str(model_dir), config=FSDPConfig(ranks=2), world_size=2, device_type="cpu"),
                      node_rank=0, local_world_size=1, store_port=1, trainer_gpus=(0,))  # fmt: skip
        with Client(("127.0.0.1", port), authkey=TOKEN.encode()) as stranger:
            stranger.send(("node", 5))  # nodes are 1 .. nodes-1
            with Client(("127.0.0.1", port), authkey=TOKEN.encode()) as node:
                node.send(("node", 1))
                with pytest.raises(TimeoutError):  # no rank ever joins: only the two hellos are answered
                    door.gather(job, nodes=2, deadline=time.monotonic() + 2)
                kind, answer = node.recv()
                assert kind == "job" and answer.node_rank == 1 and answer.trainer_gpus == (0,)
            assert stranger.recv()[0] == "refused"
    finally:
        silent.close()
        door.close()


def launch_for(options: ServeOptions, model_dir: Path) -> VLLMLaunch:
    return VLLMLaunch(model_dir, 64, device="cuda", python=Path(sys.executable), **vllm_placement(options))


def test_vllm_sees_only_its_engine_gpus_and_sleeps_only_beside_its_trainer(model_dir, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    serve = dict(model="m", port=1, engine="vllm", device="cuda")
    apart = launch_for(ServeOptions(**serve, placement=Placement(engine_gpus=(0,), trainer_gpus=(1, 2))), model_dir)
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"],
                           env=apart.environment(), capture_output=True, text=True, check=True)  # fmt: skip
    assert child.stdout.strip() == "4"  # engine GPU 0 of what the server sees
    assert not apart.sleeps_between_steps and "--enable-sleep-mode" not in apart.command(8000)
    assert apart.command(8000)[apart.command(8000).index("--gpu-memory-utilization") + 1] == "0.9"  # its own GPU

    beside = launch_for(ServeOptions(**serve, placement=Placement(engine_gpus=(1,), trainer_gpus=(1, 2))), model_dir)
    assert beside.environment()["CUDA_VISIBLE_DEVICES"] == "5"
    assert beside.sleeps_between_steps and "--enable-sleep-mode" in beside.command(8000)

    default = launch_for(ServeOptions(**serve), model_dir)  # no placement: as before (GPU 0 shared, all seen)
    assert default.sleeps_between_steps and default.environment()["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    static = launch_for(ServeOptions(**serve, static=True, placement=Placement(engine_gpus=(1,))), model_dir)
    assert not static.sleeps_between_steps


def test_a_busy_rendezvous_port_and_a_grpo_trainer_on_two_nodes_are_refused_naming_the_fix(model_dir):
    taken = socket.create_server(("0.0.0.0", 0))
    try:
        with pytest.raises(OSError, match=r"set placement.rendezvous_port \(marl serve --rendezvous-port\)"):
            FSDPTrainer(model_dir, FSDPConfig(ranks=2), device="cpu", authkey=TOKEN.encode(),
                        placement=Placement(nodes=2, rendezvous_port=taken.getsockname()[1]))  # fmt: skip
    finally:
        taken.close()
    with pytest.raises(ValueError, match="trainer grpo trains in one process on one GPU"):
        default_trainer_factory("cpu", Placement(nodes=2))(model_dir, TrainConfig())


def test_a_server_trains_over_two_nodes_and_the_node_rejoins_each_new_trainer(local_server):
    """The server's trainer (built at every engine start, as `marl serve` builds it) on two nodes: a step through
    the server, then a stop and a start: the same `marl trainer-node` process serves the new group too."""
    from tests.conftest import ADMIN, admin_http, play_episode, wait_state, wait_version

    port = free_port()
    node = start_trainer_node(port, 1, visible="3", token=ADMIN, once=False)
    trainers = default_trainer_factory("cpu", Placement(nodes=2, rendezvous_port=port), ADMIN.encode())
    try:
        with local_server(trainer_factory=trainers) as srv, admin_http(srv.url) as http:
            config = TrainConfig(batch_size=1, num_repeat=2, save_freq=0, trainer="fsdp",
                                 fsdp={"ranks": 2, "learning_rate": 1e-3})  # fmt: skip
            assert http.post("/control/config", json=config.model_dump(mode="json")).status_code == 200
            assert http.post("/control/start").status_code == 200
            status = wait_state(http, "ROLLING", "OFFLINE", timeout=180)  # two groups of processes to start
            assert status["state"] == "ROLLING", (status.get("last_error"), node.poll())
            first = srv.server.lifecycle.trainer
            assert place_of(first, 1)["RANK"] == "1" and place_of(first, 1)["CUDA_VISIBLE_DEVICES"] == "3"
            play_episode(http, "t0", 1.0), play_episode(http, "t0", 0.0)
            wait_version(http, 1, timeout=180)
            assert http.post("/control/stop").status_code == 200
            wait_state(http, "OFFLINE")
            assert http.post("/control/start").status_code == 200
            wait_state(http, "ROLLING", timeout=180)
            again = srv.server.lifecycle.trainer
            assert again is not first and place_of(again, 1)["RANK"] == "1"  # rank 1 came back, from the node
        assert node.poll() is None  # it waits for the server's next trainer
    finally:
        node.terminate()
        node.wait(timeout=30)
