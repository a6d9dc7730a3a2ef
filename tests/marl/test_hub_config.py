"""`marl plan`, `marl topology show` and the topology checks read a model given by its Hugging Face id from its
config.json: in the Hugging Face cache, or fetched from the Hub (here tests/fake_hub.py's stand-in on 127.0.0.1);
what they cannot read they say in one line. No test reaches the network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fake_hub import FakeHub, write_to_cache
from huggingface_hub import constants
from tiny_model import build_tiny_model

from marl.plan import KNOWN_ARCHITECTURES, Architecture, UnknownModel, architecture_of
from marl.topology import Topology, TopologyError

SHORT_CONTEXT = 1024  # revision v2's context (main's: 2048)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("published")
    return {"main": build_tiny_model(root / "main"),
            "v2": build_tiny_model(root / "v2", max_position_embeddings=SHORT_CONTEXT, num_layers=3)}


@pytest.fixture(scope="module")
def hub_cache(models, tmp_path_factory) -> Path:
    """A Hugging Face cache holding org/tiny at main and at v2."""
    cache = tmp_path_factory.mktemp("hf-cache")
    for revision, directory in models.items():
        write_to_cache(cache, "org/tiny", directory, revision=revision)
    return cache


def topology(tmp_path: Path, **server) -> Path:
    """A trainable listener on the CPU (`server`: its keys) and a scripted speaker."""
    spec = {"name": "hub-models",
            "servers": {"listener_model": {"model": "org/tiny", "trainable": True, "device": "cpu",
                                           "train": {"job": "tiny", "batch_size": 1, "num_repeat": 2,
                                                     "save_freq": 0}, **server}},
            "roles": {"speaker": {"scripted": True}, "listener": {"server": "listener_model"}},
            "env": {"class": "envs.signalling:SignallingGame", "args": {"num_items": 3}},
            "run": {"max_steps": 1, "repeats": 2, "run_dir": str(tmp_path / "run")}}
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def marl(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marl.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "300", **env})


def test_the_shape_of_an_id_is_read_from_the_cache_at_its_revision(models, hub_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    for revision, directory in (("main", models["main"]), ("v2", models["v2"])):
        expected = Architecture.from_config(json.loads((directory / "config.json").read_text()), name="org/tiny")
        assert architecture_of("org/tiny", revision=None if revision == "main" else revision) == expected
    assert architecture_of("org/tiny", revision="v2").context_length == SHORT_CONTEXT
    with pytest.raises(UnknownModel) as info:
        architecture_of("org/other")
    message = str(info.value)
    assert "\n" not in message and f"'org/other' is not in the Hugging Face cache ({hub_cache})" in message
    assert "HF_HUB_OFFLINE=1 forbids fetching it" in message and "Qwen/Qwen2.5-7B-Instruct" in message


def test_marl_plan_and_topology_show_read_an_id_from_the_cache(hub_cache, tmp_path):
    path, cache = topology(tmp_path, revision="v2"), {"HF_HUB_CACHE": str(hub_cache)}
    shown = marl("topology", "show", str(path), **cache)
    assert shown.returncode == 0, shown.stderr
    assert "model=org/tiny  revision=v2" in shown.stdout
    assert "shape  3 layers, 4 heads, hidden 64, vocab" in shown.stdout and f"context {SHORT_CONTEXT}" in shown.stdout
    plan = marl("plan", str(path), **cache)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "listener_model: org/tiny" in plan.stdout and "fits: every planned device holds its peak" in plan.stdout


def test_an_id_neither_cached_nor_reachable_is_said_in_one_line(hub_cache, tmp_path):
    path, cache = topology(tmp_path, model="org/other"), {"HF_HUB_CACHE": str(hub_cache)}
    shown = marl("topology", "show", str(path), **cache)
    assert shown.returncode == 2 and "Traceback" not in shown.stderr, shown.stderr
    assert len(shown.stderr.strip().splitlines()) == 1, shown.stderr
    assert ("servers.listener_model.model: 'org/other' is not in the Hugging Face cache" in shown.stderr
            and "HF_HUB_OFFLINE=1 forbids fetching it" in shown.stderr), shown.stderr
    plan = marl("plan", str(path), **cache)
    assert plan.returncode == 1 and "Traceback" not in plan.stderr, plan.stdout + plan.stderr
    assert "servers.listener_model.model: cannot read the shape of 'org/other'" in plan.stdout, plan.stdout


def test_online_plan_fetches_config_json_alone_and_the_table_needs_no_hub(models, tmp_path):
    with FakeHub() as hub:
        hub.add("org/tiny", models["main"])
        online = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0"}
        plan = marl("plan", str(topology(tmp_path)), **online)
        assert plan.returncode == 0, plan.stdout + plan.stderr
        assert hub.downloads == ["org/tiny/config.json"]  # the shape, not the weights
        assert "qwen/qwen2.5-0.5b-instruct" in KNOWN_ARCHITECTURES
        known = marl("plan", str(topology(tmp_path, model="Qwen/Qwen2.5-0.5B-Instruct")), **online)
        assert known.returncode == 0 and hub.downloads == ["org/tiny/config.json"], known.stdout + known.stderr
        unknown = marl("plan", str(topology(tmp_path, model="org/nope")), **online)
    assert unknown.returncode == 1, unknown.stdout + unknown.stderr
    assert f"'org/nope': no such model repository on the Hub ({hub.url}/org/nope)" in unknown.stdout, unknown.stdout
    assert not [request for request in hub.requests if "Qwen" in request]


def test_a_revision_belongs_to_a_hub_id(tiny_model, tmp_path):
    for server, key, needle in (({"model": str(tiny_model)}, "revision", "is a directory on this machine, which"
                                 " has no revisions"),
                                ({"model": "smollm2-135m"}, "revision", "an alias marl builds, which has no"
                                 " revisions"),
                                ({"model": None, "swarm_url": "http://gpu-box:10086", "device": None},
                                 "revision", "a revision of which model?")):
        with pytest.raises(TopologyError, match=f"servers.listener_model.{key}: .*{needle}"):
            Topology.load(topology(tmp_path, revision="v2", **server), check_env=True)


def test_the_revision_reaches_marl_serve_and_the_snapshots_of_the_base_model(tmp_path):
    from marl.league.snapshots import resolve_snapshot, snapshots_on_disk
    from marl.runner.launch import ServerProcess

    spec = Topology.load(topology(tmp_path, revision="v2"), check_env=False)
    initial = resolve_snapshot(spec, tmp_path / "run", "listener_model", "initial")
    assert (initial.model, initial.revision) == ("org/tiny", "v2")
    assert snapshots_on_disk(tmp_path / "run", "listener_model", "org/tiny", revision="v2")[0] == initial
    process = ServerProcess(model=initial.model, revision=initial.revision, admin_token="t", data_dir=tmp_path / "d",
                            log_path=tmp_path / "server.log", static=True)
    assert process.args[process.args.index("--model"):][:2] == ["--model", "org/tiny"]
    assert process.args[process.args.index("--revision") + 1] == "v2"
