"""A model given by its Hugging Face id (`org/name`, at a revision): found in the Hugging Face cache, or downloaded
there from the Hub (here `tests/fake_hub.py`'s stand-in on 127.0.0.1), served by `marl serve`; what cannot be had is
said in one line. No test reaches the network."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fake_hub import FakeHub, write_to_cache
from huggingface_hub import constants
from tiny_model import build_tiny_model

from marl.runner.launch import ServerProcess
from servers.hub_models import HubModelError, is_hub_id
from servers.model_files import check_model, resolve_model
from tests.conftest import ADMIN, admin_http, wait_state

SHORT_CONTEXT = 1024  # the context of revision v2 (main's is tiny_model's default, 2048): tells the two apart


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The model directories published as org/tiny: main, and v2 (another model, with a shorter context)."""
    root = tmp_path_factory.mktemp("published")
    return {"main": build_tiny_model(root / "main"),
            "v2": build_tiny_model(root / "v2", max_position_embeddings=SHORT_CONTEXT, seed=1)}


@pytest.fixture(scope="module")
def hub_cache(models, tmp_path_factory) -> Path:
    """A Hugging Face cache holding org/tiny at main and at v2, laid out as huggingface_hub lays it out."""
    cache = tmp_path_factory.mktemp("hf-cache")
    for revision, directory in models.items():
        write_to_cache(cache, "org/tiny", directory, revision=revision)
    return cache


@pytest.fixture
def in_cache(hub_cache, monkeypatch) -> Path:
    """This process looks models up in `hub_cache` (offline: tests/conftest.py)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    return hub_cache


def snapshot(cache: Path, revision: str) -> Path:
    storage = cache / "models--org--tiny"
    return storage / "snapshots" / (storage / "refs" / revision).read_text()


def marl(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marl.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("marl serve: error: "), result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


# ---------------------------------------------------------------------------------------------------------------
# Resolution, in this process (offline)
# ---------------------------------------------------------------------------------------------------------------


def test_what_reads_as_a_hub_id():
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("org/tiny") and is_hub_id("meta-llama/Llama-3.1-8B")
    for text in ("smollm2-135m", "gpt2", "/models/qwen", "a/b/c", "./tiny", "~/tiny", "org/na--me", "org/",
                 "org/x.git"):
        assert not is_hub_id(text), text


def test_an_id_resolves_to_its_snapshot_at_each_revision(in_cache):
    main, v2 = snapshot(in_cache, "main"), snapshot(in_cache, "v2")
    assert main != v2
    assert resolve_model("org/tiny") == main and (main / "model.safetensors").is_symlink()
    assert resolve_model("org/tiny", revision="v2") == v2
    assert resolve_model("org/tiny", revision=v2.name) == v2  # a commit hash
    check_model("org/tiny")
    check_model("org/tiny", revision="v2")


def test_offline_an_id_not_in_the_cache_is_said_in_one_line(in_cache):
    for model, revision in (("org/missing", None), ("org/tiny", "v3")):
        with pytest.raises(HubModelError) as info:
            resolve_model(model, revision)
        message = str(info.value)
        assert "\n" not in message and f"cannot resolve model {model!r}" in message
        assert f"not in the Hugging Face cache ({in_cache})" in message and "HF_HUB_OFFLINE=1" in message


def test_a_revision_belongs_to_an_id_and_other_names_keep_their_errors(in_cache, tmp_path):
    with pytest.raises(ValueError, match="revision 'v2' applies to a Hugging Face id .* is a directory"):
        resolve_model(str(tmp_path), revision="v2")
    with pytest.raises(ValueError, match="revision 'v2' applies to a Hugging Face id .* is an alias"):
        check_model("smollm2-135m", revision="v2")
    with pytest.raises(ValueError, match=r"no such directory and not a known alias \(did you mean 'smollm2-135m'"):
        check_model("smollm2-135")
    with pytest.raises(ValueError, match="a Hugging Face id \\(org/name"):
        check_model(str(tmp_path / "a" / "missing"))


# ---------------------------------------------------------------------------------------------------------------
# marl serve
# ---------------------------------------------------------------------------------------------------------------


def serve(model: str, tmp_path: Path, name: str, environment: dict[str, str],
          revision: str | None = None) -> ServerProcess:
    return ServerProcess(model=model, revision=revision, admin_token=ADMIN, data_dir=tmp_path / name, static=True,
                         device="cpu", log_path=tmp_path / f"{name}.log", environment=environment).start()


def assert_serves(process: ServerProcess, model: str, context: int) -> None:
    """The server loads `model`, lists it under its id with `context`, and answers a chat completion."""
    process.wait_healthy(timeout=120)
    with admin_http(process.url) as http:
        wait_state(http, "STATIC", timeout=120)
        card = http.get("/v1/models").json()["data"][0]
        assert (card["id"], card["max_model_len"]) == (model, context)
        reply = http.post("/v1/chat/completions", json={"model": model, "max_tokens": 4,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["role"] == "assistant"


def test_marl_serve_serves_an_id_from_the_cache_offline_at_its_revision(hub_cache, tmp_path):
    environment = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    revisions = {None: 2048, "v2": SHORT_CONTEXT}
    processes = {revision: serve("org/tiny", tmp_path, f"at-{revision}", environment, revision)
                 for revision in revisions}
    try:
        for revision, process in processes.items():
            assert_serves(process, "org/tiny", revisions[revision])
    finally:
        for process in processes.values():
            process.stop()
    for revision, process in processes.items():
        log = process.log_path.read_text()
        assert f"ready at {snapshot(hub_cache, revision or 'main')}" in log, log


def test_marl_serve_downloads_a_gated_model_with_hf_token(models, tmp_path):
    """Online (the stand-in Hub): the files land in HF_HUB_CACHE as huggingface_hub lays them out, with a progress
    bar; a gated model needs HF_TOKEN."""
    cache = tmp_path / "cache"
    with FakeHub() as hub:
        commit = hub.add("org/tiny", models["main"], gated=True)
        online = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0"}
        refused = marl("serve", "--model", "org/tiny", "--data-dir", str(tmp_path / "refused"), **online)
        assert_one_line_error(refused, "cannot resolve model 'org/tiny': a gated model",
                              f"accept its terms at {hub.url}/org/tiny", "set HF_TOKEN")
        process = serve("org/tiny", tmp_path, "gated", {**online, "HF_TOKEN": FakeHub.TOKEN})
        try:
            assert_serves(process, "org/tiny", 2048)
        finally:
            process.stop()
        assert "org/tiny/model.safetensors" in hub.downloads
    log = process.log_path.read_text()
    assert "Fetching 6 files" in log and "100%" in log, log  # huggingface_hub's progress bar
    by_hand = write_to_cache(tmp_path / "by-hand", "org/tiny", models["main"])
    downloaded = cache / "models--org--tiny"
    assert (downloaded / "refs" / "main").read_text() == commit == by_hand.name
    assert layout(downloaded) == layout(by_hand.parents[1])  # the tests' caches are laid out as huggingface_hub's


def layout(storage: Path) -> dict[str, str]:
    """A cached repository's refs, snapshot links and blobs: path -> the ref's commit, the link's target, or ''."""
    return {p.relative_to(storage).as_posix(): os.readlink(p) if p.is_symlink() else p.read_text() if "refs" in
            p.parts else "" for d in ("refs", "snapshots", "blobs") for p in sorted((storage / d).rglob("*"))
            if p.is_file() or p.is_symlink()}


def test_marl_serve_says_in_one_line_what_keeps_an_id_out(hub_cache, models, tmp_path):
    data = ["--data-dir", str(tmp_path / "data")]
    offline = marl("serve", "--model", "org/missing", *data, HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1")
    assert_one_line_error(offline, "cannot resolve model 'org/missing': not in the Hugging Face cache",
                          "HF_HUB_OFFLINE=1 forbids")
    with FakeHub() as hub:
        hub.add("org/tiny", models["main"])
        online = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0"}
        unknown = marl("serve", "--model", "org/nope", *data, **online)
        assert_one_line_error(unknown, "'org/nope': no such model repository on the Hub")
        revision = marl("serve", "--model", "org/tiny", "--revision", "v9", *data, **online)
        assert_one_line_error(revision, "org/tiny has no revision 'v9'")
    directory = marl("serve", "--model", str(models["main"]), "--revision", "v2", *data)
    assert_one_line_error(directory, "revision 'v2' applies to a Hugging Face id")


def test_marl_run_starts_a_topology_server_given_by_id_at_its_revision(hub_cache, tmp_path):
    """`model: org/tiny` and `revision: v2` in a topology reach `marl serve`, which loads v2 from the cache."""
    train = {"job": "tiny", "batch_size": 1, "num_repeat": 2, "save_freq": 0}
    spec = {"name": "by-id",
            "servers": {"listener_model": {"model": "org/tiny", "revision": "v2", "trainable": True, "device": "cpu",
                                           "train": train}},
            "roles": {"speaker": {"scripted": True}, "listener": {"server": "listener_model"}},
            "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3}},
            "run": {"max_steps": 1, "repeats": 2, "concurrency": 2, "run_dir": str(tmp_path / "run")}}
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = marl("run", str(path), HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stdout + result.stderr
    log = (tmp_path / "run" / "logs" / "listener_model.log").read_text()
    assert f"ready at {snapshot(hub_cache, 'v2')}" in log, log
