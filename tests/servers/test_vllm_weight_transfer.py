"""Weight sync through vLLM's weight-transfer engine, as far as a CPU can run it.

vLLM's weight-transfer engine is CUDA-only, so the pieces are checked apart: the command line and the setting;
the trainer's route sequence and bodies against a recording HTTP server; the buckets and their metadata against the
model's state dict; the nccl backend's broadcast, run over gloo into a receiving process that does what vLLM's worker
does (allocate each tensor from the metadata, receive it in order), from the one-process trainer and from two FSDP
ranks; and, with the CPU build of vLLM started with the flag, a training step whose transfer vLLM refuses (500),
after which the disk path serves the step's weights. None of it has run on a GPU.
"""

from __future__ import annotations

import base64
import json
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest
import torch
from tiny_model import build_tiny_model

from marl.protocol import VLLM_WEIGHT_SYNC_MODES, FSDPConfig, TrainConfig
from servers.engines.vllm_process import (
    VLLMLaunch,
    VLLMSettings,
    VLLMSettingsError,
    auto_weight_sync,
    trainer_nccl_library,
    vllm_python,
)
from servers.engines.weight_transfer import (
    Replica,
    TransferTarget,
    WeightPusher,
    WeightTransferError,
    layer_buckets,
    layer_key,
    travelling,
    unique_tensors,
    update_metadata,
)

PYTHON = Path(sys.executable)  # any existing python: the command line is only built
NCCL = "/site-packages/nvidia/nccl/lib/libnccl.so.2"  # a trainer's NCCL library, as found (only passed on)
TRANSFER_ROUTES = ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-transfer"), num_layers=3)


def policy_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def served_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The state dict's names, the tied head left out (it is the embedding)."""
    return [name for name in state if name != "lm_head.weight"]


# ------------------------------------------------------------------------------------------------------------------
# the setting and vLLM's command line
# ------------------------------------------------------------------------------------------------------------------


def transfer_config(launch: VLLMLaunch) -> dict | None:
    cmd = launch.command(port=8123)
    flag = "--weight-transfer-config"
    return json.loads(cmd[cmd.index(flag) + 1]) if flag in cmd else None


@pytest.mark.parametrize(("device", "shares_gpu", "settings", "gpus", "mode"), [
    ("cuda", True, {}, {}, "ipc"),  # auto: vLLM on the trainer's GPU
    ("cuda", False, {}, {}, "nccl"),  # auto: vLLM on GPUs of its own
    ("cpu", True, {}, {}, "disk"),  # auto: the CPU build has no weight-transfer engine
    ("cuda", True, {"tensor_parallel_size": 2}, {}, "disk"),  # GPUs 0-1 beside a trainer on GPU 0: partial overlap
    ("cuda", True, {"tensor_parallel_size": 2, "data_parallel_size": 4},  # colocated on all 8: ipc at TP x DP 8
     {"engine_gpus": range(8), "trainer_gpus": range(8)}, "ipc"),
    ("cuda", True, {"data_parallel_size": 2}, {"engine_gpus": (2, 3), "trainer_gpus": range(8)}, "ipc"),
    ("cuda", False, {"tensor_parallel_size": 2}, {"engine_gpus": (0, 1), "trainer_gpus": (2, 3)}, "nccl"),
    ("cuda", False, {}, {"nccl_library": None}, "disk"),  # GPUs of its own, but no NCCL of the trainer's to give it
    ("cuda", True, {"tensor_parallel_size": 2}, {"engine_gpus": (0, 1), "trainer_gpus": (1, 2)}, "disk"),
    ("cuda", False, {"weight_sync": "disk"}, {}, "disk"),
    ("cpu", False, {"weight_sync": "nccl"}, {"nccl_library": None}, "nccl"),  # as asked: vLLM's routes answer 500
    ("cpu", True, {"weight_sync": "ipc", "data_parallel_size": 2}, {}, "ipc"),  # and the disk takes over
])
def test_weight_sync_picks_the_backend_and_puts_it_on_the_command_line(device, shares_gpu, settings, gpus, mode):
    gpus = {"nccl_library": NCCL, **gpus}
    launch = VLLMLaunch(Path("/models/m"), 4096, device=device, settings=VLLMSettings(**settings),
                        shares_gpu=shares_gpu, python=PYTHON, **gpus)
    assert launch.weight_sync == mode
    assert transfer_config(launch) == (None if mode == "disk" else {"backend": mode})
    env = launch.environment()
    insecure = env.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    assert insecure == ("1" if mode == "ipc" else None)  # pickled IPC handles over HTTP need it, nothing else does
    # vLLM's PyNccl loads the trainer's NCCL (NCCL refuses a peer of another version), for nccl only
    assert env.get("VLLM_NCCL_SO_PATH") == (gpus["nccl_library"] if mode == "nccl" else None)
    assert (launch.disk_reason is None) == (mode != "disk")


@pytest.mark.parametrize(("cuda", "engine", "trainer", "found", "mode"), [
    (False, [0], [0], True, "disk"),
    (True, [0], [0], False, "ipc"),
    (True, [0, 1], [0, 1, 2, 3], False, "ipc"),  # TP 2 (or DP 2) inside the trainer's GPUs
    (True, list(range(8)), list(range(8)), True, "ipc"),  # TP x DP = 8 on the trainer's 8
    (True, [4, 5, 6, 7], [0, 1, 2, 3], True, "nccl"),
    (True, [4, 5, 6, 7], [0, 1, 2, 3], False, "disk"),
    (True, [0], [], True, "nccl"),  # a static server: no trainer
    (True, [3, 4], [0, 1, 2, 3], True, "disk"),  # partial overlap
])
def test_the_auto_rule(cuda, engine, trainer, found, mode):
    assert auto_weight_sync(cuda=cuda, engine_gpus=engine, trainer_gpus=trainer, nccl_library=found) == mode


def test_the_disk_says_why():
    def reason(**kwargs) -> str | None:
        kwargs = {"device": "cuda", "nccl_library": NCCL, **kwargs}
        return VLLMLaunch(Path("/models/m"), 4096, python=PYTHON, **kwargs).disk_reason

    assert reason(device="cpu") == "the CPU build has no weight-transfer engine"
    assert reason(settings=VLLMSettings(weight_sync="disk")) == "weight_sync is disk"
    assert "partly the trainer's" in reason(engine_gpus=(0, 1), trainer_gpus=(1, 2))
    assert "NCCL library was not found" in reason(engine_gpus=(1,), trainer_gpus=(0,), nccl_library=None)
    assert reason(engine_gpus=(1,), trainer_gpus=(0,)) is None


@pytest.mark.parametrize(("settings", "gpus", "words"), [
    ({"weight_sync": "nccl"}, {"nccl_library": None}, "vllm.weight_sync: nccl needs the trainer's NCCL library"),
    ({"weight_sync": "ipc", "tensor_parallel_size": 2}, {"engine_gpus": (0, 1), "trainer_gpus": (0,)},
     r"vllm.weight_sync: ipc needs every vLLM GPU to be a trainer GPU.*\[0, 1\], the trainer's \[0\]"),
])
def test_an_explicit_backend_that_cannot_work_is_refused_at_start(settings, gpus, words):
    with pytest.raises(VLLMSettingsError, match=words):
        VLLMLaunch(Path("/models/m"), 4096, device="cuda", settings=VLLMSettings(**settings), python=PYTHON,
                   shares_gpu=True, **{"nccl_library": NCCL, **gpus})


def test_the_trainers_nccl_library_is_the_nvidia_wheels_beside_its_torch(tmp_path, monkeypatch):
    trainer_nccl_library.cache_clear()
    try:
        assert trainer_nccl_library() is None  # this CPU torch has no NCCL
        trainer_nccl_library.cache_clear()
        library = tmp_path / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
        library.parent.mkdir(parents=True)
        library.write_bytes(b"")
        monkeypatch.setattr(torch.version, "cuda", "12.9")
        monkeypatch.setattr(sys, "path", [str(tmp_path / "elsewhere"), str(tmp_path)])
        assert trainer_nccl_library() == str(library)
    finally:
        trainer_nccl_library.cache_clear()


@pytest.mark.parametrize(("values", "words"), [
    ({"weight_sync": "rdma"}, "must be one of auto, disk, ipc, nccl"),
    ({"extra_args": ["--weight-transfer-config={}"]}, "set weight_sync instead"),
])
def test_bad_weight_sync_settings_are_refused(values, words):
    with pytest.raises(VLLMSettingsError, match=words):
        VLLMSettings(**values)


def test_the_setting_reaches_marl_serve_from_a_topology():
    from marl.cli import _serve_options, parse
    from marl.runner.launch import vllm_flags
    from marl.topology import spec

    assert spec.VLLM_WEIGHT_SYNC_MODES is VLLM_WEIGHT_SYNC_MODES  # defined once, in the protocol
    flags = vllm_flags(spec.VLLMSpec(weight_sync="nccl"))
    assert flags == ["--vllm-weight-sync", "nccl"]
    options = _serve_options(parse(["serve", "--model", "m", "--engine", "vllm", *flags]))
    assert options.vllm.weight_sync == "nccl"


# ------------------------------------------------------------------------------------------------------------------
# buckets and metadata
# ------------------------------------------------------------------------------------------------------------------


def test_buckets_hold_whole_layers_and_carry_the_state_dicts_names_dtypes_and_shapes(model_dir):
    state = policy_state(model_dir)
    layer_bytes = sum(t.numel() * 2 for n, t in state.items() if layer_key(n) == "model.layers.0")
    buckets = list(layer_buckets(travelling(unique_tensors(state.items()), torch.bfloat16), layer_bytes))

    assert [name for bucket in buckets for name, _ in bucket] == served_names(state)
    owners: dict[str, int] = {}
    for index, bucket in enumerate(buckets):
        for name, _ in bucket:
            assert owners.setdefault(layer_key(name), index) == index, f"{name}: its layer is split"
        last_layer = layer_key(bucket[-1][0])
        before_it = sum(t.numel() * 2 for n, t in bucket if layer_key(n) != last_layer)
        assert before_it < layer_bytes  # cut at the first layer boundary once the bucket held bucket_bytes
        if index < len(buckets) - 1:
            assert sum(t.numel() * 2 for _, t in bucket) >= layer_bytes
    assert len(buckets) >= 3  # the embedding, three layers and the final norm do not fit one bucket

    meta = update_metadata(buckets[1])
    assert meta["names"] == [n for n, _ in buckets[1]]
    assert meta["dtype_names"] == ["bfloat16"] * len(buckets[1])
    assert meta["shapes"] == [list(state[n].shape) for n in meta["names"]]
    for name, tensor in buckets[1]:
        assert torch.equal(tensor, state[name].to(torch.bfloat16)) and tensor.is_contiguous()


# ------------------------------------------------------------------------------------------------------------------
# the routes, against a recording HTTP server
# ------------------------------------------------------------------------------------------------------------------




def fake_ipc_handle(tensor: torch.Tensor) -> dict[str, tuple]:
    """What `share_cuda_tensor` returns, with the tensor's numbers in place of CUDA's (a CPU has no IPC)."""
    return {"GPU-test": ("handle", tensor.numel(), str(tensor.dtype))}


def test_an_ipc_push_inits_once_then_starts_updates_each_bucket_and_finishes(recording, model_dir):
    vllm, state = recording(), policy_state(model_dir)
    target = TransferTarget(backend="ipc", replicas=[Replica(vllm.url, "pid-1")], bucket_bytes=1, version="7")
    pusher = WeightPusher(share=fake_ipc_handle)
    pusher.push(target, unique_tensors(state.items()))

    updates = len({layer_key(name) for name in served_names(state)})  # bucket_bytes=1: one bucket per layer
    assert vllm.paths() == TRANSFER_ROUTES[:2] + ["/update_weights"] * updates + ["/finish_weight_update"]
    bodies = vllm.bodies()
    assert bodies[0] == {"init_info": {"packed": False}}
    assert bodies[1] is None and bodies[-1] == {"weight_version": "7"}
    sent = []
    for body in bodies[2:-1]:
        info = body["update_info"]
        handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
        assert set(info) == {"names", "dtype_names", "shapes", "ipc_handles_pickled"}
        assert handles == [fake_ipc_handle(state[n].to(torch.bfloat16)) for n in info["names"]]
        assert info["dtype_names"] == ["bfloat16"] * len(info["names"])
        sent += info["names"]
    assert sent == served_names(state)

    pusher.push(target, unique_tensors(state.items()))  # the same vLLM: no second init
    assert vllm.paths().count("/init_weight_transfer_engine") == 1
    pusher.push(TransferTarget(backend="ipc", replicas=[Replica(vllm.url, "pid-2")]), unique_tensors(state.items()))
    assert vllm.paths().count("/init_weight_transfer_engine") == 2  # a restarted vLLM: init again


@pytest.mark.parametrize("failing", TRANSFER_ROUTES)
def test_a_refused_route_raises_and_stops_the_push(recording, model_dir, failing):
    vllm, state = recording(failing=(failing,)), policy_state(model_dir)
    target = TransferTarget(backend="ipc", replicas=[Replica(vllm.url, "s")], bucket_bytes=1)
    with pytest.raises(WeightTransferError, match=f"vLLM {failing} answered 500"):
        WeightPusher(share=fake_ipc_handle).push(target, unique_tensors(state.items()))
    assert vllm.paths()[-1] == failing and vllm.paths() == [p for p in vllm.paths() if p in TRANSFER_ROUTES]
    if failing != "/finish_weight_update":
        assert vllm.paths().count("/update_weights") <= 1  # nothing is sent after a refusal


# ------------------------------------------------------------------------------------------------------------------
# the nccl backend's broadcast, over gloo, into a receiving process that does what vLLM's worker does
# ------------------------------------------------------------------------------------------------------------------


def receiving_vllm(port_out: mp.SimpleQueue, received_path: str) -> None:
    """A process answering vLLM's transfer routes as its NCCL worker does (`NCCLWeightTransferEngine`, unpacked): join
    the group at `rank_offset` in the init, allocate each tensor of an update from its metadata and receive it by
    broadcast from rank 0; at the finish, save what it received (and the routes it was called on)."""
    state: dict = {"group": None, "received": {}, "routes": []}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else {}
            state["routes"].append(self.path)
            if self.path == "/init_weight_transfer_engine":
                info = body["init_info"]
                assert info["packed"] is False
                store = torch.distributed.TCPStore(info["master_address"], info["master_port"], is_master=False,
                                                   timeout=timedelta(seconds=60))
                state["group"] = torch.distributed.ProcessGroupGloo(store, info["rank_offset"], info["world_size"],
                                                                    timedelta(seconds=60))
            elif self.path == "/update_weights":
                info = body["update_info"]
                for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
                    weight = torch.empty(shape, dtype=getattr(torch, dtype))
                    state["group"].broadcast(weight, 0).wait()
                    state["received"][name] = weight
            elif self.path == "/finish_weight_update":
                torch.save({"received": state["received"], "routes": state["routes"]}, received_path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_out.put(server.server_address[1])
    server.serve_forever()


@pytest.fixture
def receivers(tmp_path) -> Iterator[list[tuple[str, Path]]]:
    """Two receiving processes (two replicas of one worker each): (url, where it saves what it received)."""
    context = mp.get_context("spawn")
    started = []
    for index in range(2):
        port_out, received = context.SimpleQueue(), tmp_path / f"received-{index}.pt"
        process = context.Process(target=receiving_vllm, args=(port_out, str(received)), daemon=True)
        process.start()
        started.append((process, port_out, received))
    yield [(f"http://127.0.0.1:{port_out.get()}", received) for _, port_out, received in started]
    for process, _, _ in started:
        process.kill()
        process.join(10)


@pytest.fixture
def receiver(receivers) -> tuple[str, Path]:
    return receivers[0]


def gloo_target(url: str) -> TransferTarget:
    """vLLM's nccl backend with its broadcast run over gloo; buckets of about a decoder layer of the tiny model."""
    return TransferTarget(backend="nccl", channel="gloo", replicas=[Replica(url, "s")], dtype="bfloat16",
                          bucket_bytes=40_000, timeout_s=60)


def assert_received(received: Path, state: dict[str, torch.Tensor]) -> None:
    got = torch.load(received)
    assert got["routes"][:2] == TRANSFER_ROUTES[:2] and got["routes"][-1] == TRANSFER_ROUTES[-1]
    assert got["routes"].count("/update_weights") > 1  # several buckets
    assert list(got["received"]) == served_names(state)
    for name, tensor in got["received"].items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, state[name].to(torch.bfloat16)), name


def test_an_nccl_push_broadcasts_every_bucket_into_the_receiving_process(receiver, model_dir):
    url, received = receiver
    state = policy_state(model_dir)
    WeightPusher().push(gloo_target(url), unique_tensors(state.items()))
    assert_received(received, state)


def test_an_nccl_push_to_two_replicas_forms_one_group_and_every_broadcast_reaches_both(receivers, model_dir):
    state = policy_state(model_dir)
    (url_a, received_a), (url_b, received_b) = receivers
    target = TransferTarget(backend="nccl", channel="gloo", replicas=[Replica(url_a, "a"), Replica(url_b, "b")],
                            dtype="bfloat16", bucket_bytes=40_000, timeout_s=60)
    assert (target.world_size, target.rank_offset(0), target.rank_offset(1)) == (3, 1, 2)
    WeightPusher().push(target, unique_tensors(state.items()))  # the group forms only if both inits ran at once
    assert_received(received_a, state)
    assert_received(received_b, state)


def test_fsdp_ranks_gather_and_rank_0_pushes_and_a_refused_push_leaves_the_ranks_whole(receiver, recording,
                                                                                        model_dir, tmp_path):
    from servers.trainers.fsdp import FSDPTrainer

    url, received = receiver
    trainer = FSDPTrainer(model_dir, FSDPConfig(ranks=2, mixed_precision="fp32"), threads_per_rank=1)
    try:
        refusing = recording(failing=("/start_weight_update",))
        with pytest.raises(WeightTransferError, match="start_weight_update answered 500"):
            trainer.push_weights(TransferTarget(backend="ipc", replicas=[Replica(refusing.url, "s")]))
        trainer.push_weights(gloo_target(url))  # the same ranks, still whole
        assert_received(received, policy_state(model_dir))
        trainer.export_weights(tmp_path / "export")  # and still serving commands
    finally:
        trainer.close()


# ------------------------------------------------------------------------------------------------------------------
# the CPU build of vLLM, started with the flag: it refuses the transfer, and the disk path serves the step's weights
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not vllm_python().exists(), reason=f"no vLLM environment at {vllm_python()} (`make vllm`)")
@pytest.mark.timeout(900)
def test_a_transfer_vllm_refuses_falls_back_to_the_disk_and_the_steps_weights_serve(tmp_path):
    from conftest import admin_http, wait_state, wait_version
    from test_vllm_engine import (
        LOGPROB_TOLERANCE,
        START_TIMEOUT_S,
        VLLMServer,
        ask,
        assert_matches,
        fp32_logprobs,
        ids_and_logprobs,
        leased,
        max_gap,
        one_episode,
    )

    model = build_tiny_model(tmp_path / "model", hidden_size=64, num_heads=2)  # head size 32: the CPU build's least
    flags = ["--vllm-weight-sync", "ipc", "--vllm-kv-cache-gb", "0.25"]
    with VLLMServer(model, tmp_path / "server", vllm_flags=flags) as srv, admin_http(srv.url) as http:
        config = TrainConfig(batch_size=1, num_repeat=2, save_freq=1, learning_rate=1e-2, lease_patience_s=600)
        assert http.post("/control/config", json=config.model_dump(mode="json")).status_code == 200
        assert http.post("/control/start").status_code == 200
        wait_state(http, "ROLLING", timeout=START_TIMEOUT_S)
        engine, trainer = srv.server.lifecycle.engine, srv.server.lifecycle.trainer
        assert engine.transfer_off is None  # asked for: it tries
        assert "Creating weight transfer engine: IPCWeightTransferEngine" in engine.log_path.read_text()
        trainer._pusher = WeightPusher(share=fake_ipc_handle)  # a CPU has no CUDA IPC: handles vLLM cannot open

        one_episode(http, "a", 1.0)
        one_episode(http, "a", 0.0)
        wait_version(http, 1, timeout=START_TIMEOUT_S)
        stats = engine.stats
        assert (stats.weight_transfer_failures, stats.weight_transfers, stats.weight_loads) == (1, 0, 1)
        assert "/update_weights answered 500" in engine.transfer_off  # init and start were taken, the update not

        checkpoint = srv.server.lifecycle.checkpoints.latest()
        with leased(http) as (_, client):
            body = ask(client, [{"role": "user", "content": "Say yes."}], max_tokens=16, seed=3)
        assert_matches(checkpoint, body)  # vLLM serves the step's weights, reloaded from the disk
        prompt, completion, served = ids_and_logprobs(body)
        assert max_gap(fp32_logprobs(model, prompt, completion), served) > 10 * LOGPROB_TOLERANCE  # not the old ones
        check_a_restart_after_a_push_starts_from_its_copy(engine, http, model)  # the initial weights: not step 1's
        assert http.post("/control/stop").status_code == 200


def check_a_restart_after_a_push_starts_from_its_copy(engine, http, weights: Path) -> None:
    """A push leaves vLLM no file to reload: the train loop exports the pushed weights after it, and a vLLM that
    dies restarts from that copy, waiting for it while it has not landed; when the export failed, the engine is down
    and says why. (A CPU cannot push for real: the engine is put in the state a push leaves it in.)"""
    from test_vllm_engine import ask, assert_matches, leased, until_refused

    engine._pushed = True
    engine._restart_copy.clear()  # the loop's export still to come
    with leased(http) as (_, client):
        threading.Timer(3.0, engine.keep_restart_copy, [weights]).start()  # lands while vLLM restarts
        os.kill(engine.pid, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while True:  # a call racing the crash's detection may fail first
            try:
                body = ask(client, [{"role": "user", "content": "Say yes."}], max_tokens=16, seed=3)
                break
            except openai.InternalServerError:
                assert time.monotonic() < deadline, "vLLM never served again after its restart"
                time.sleep(0.5)
        assert engine.stats.restarts == 1
        assert_matches(weights, body)  # the copy's weights serve, not those vLLM had before it died
        engine._pushed = True
        engine._restart_copy.clear()
        engine.keep_restart_copy(None)  # the export failed
        os.kill(engine.pid, signal.SIGKILL)
        until_refused(client, "could not be exported")
    assert engine.stats.restarts == 1
