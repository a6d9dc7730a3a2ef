"""marl's side of the vLLM contract (bench/vllm_contract.py), taken from marl's code as it runs: the command lines
and environments of several launches, the HTTP calls of every exchange with vLLM recorded by a stand-in server, the
logits processor imported against stand-ins of vLLM's classes built from a manifest, and the worker extension's calls
read from its source."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib
import inspect
import json
import sys
import tempfile
import threading
import types
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ROOT / "servers" / "engines"
#: The modules vLLM imports from marl inside its own process (PYTHONPATH = servers/engines/).
IN_VLLM = ("vllm_lead", "vllm_lead_v1", "vllm_lead_v2", "vllm_worker_ext", "lead_tokens")
#: What the worker extension reads off vLLM's sleep allocator (servers/engines/vllm_worker_ext.py, `wake_memory`).
ALLOCATOR_READS = {"cumem_allocator": ("get_instance", "pointer_to_data"),
                   "allocation_data": ("tag", "handle", "is_asleep")}

Call = tuple[str, str, dict[str, list[str]], Any]


def marl_command_lines() -> list[tuple[list[str], dict[str, str]]]:
    """(argv, the VLLM_* variables marl sets) of a CPU, a LoRA, a colocated CUDA (sleep, ipc) and a CUDA launch on
    GPUs of its own (nccl)."""
    from servers.engines.vllm_lora import LoraSlots
    from servers.engines.vllm_process import VLLMLaunch, VLLMSettings

    python = Path(sys.executable)
    launches = [
        VLLMLaunch(Path("m"), 64, python=python),
        VLLMLaunch(Path("m"), 64, python=python, lora=LoraSlots(2, 16), settings=VLLMSettings(max_num_seqs=8)),
        VLLMLaunch(Path("m"), 64, device="cuda", shares_gpu=True, python=python, nccl_library=None,
                   settings=VLLMSettings(kv_cache_gb=1.0)),
        VLLMLaunch(Path("m"), 64, device="cuda", python=python, engine_gpus=(1,), trainer_gpus=(0,),
                   nccl_library="/x/libnccl.so.2"),
    ]
    found = []
    for launch in launches:
        env = launch.environment()
        ours = {k: v for k, v in env.items() if k.startswith("VLLM_") and env.get(k) != _outside(k)}
        found.append((launch.command(8000)[5:], ours))  # after the interpreter and its exec wrapper
    return found


def _outside(name: str) -> str | None:
    import os

    return os.environ.get(name)


def marl_calls() -> list[Call]:
    """Every HTTP call marl makes to vLLM, recorded: syncs (pause, reload, reset, resume), sleep and both wakes, a
    push over ipc (init, start, update, finish) and nccl's init body, adapter loads, generations whole and streamed."""
    from servers.backends import SamplingParams
    from servers.engines import vllm_http as wire
    from servers.engines.vllm_lora import _load, _post
    from servers.engines.weight_transfer import Replica, TransferRoutes, TransferTarget, WeightPusher

    with _recorder() as (url, calls), tempfile.TemporaryDirectory() as folder:
        wire.sync_weights(url, Path(folder))
        wire.sleep_for_training(url)
        wire.sync_weights_waking(url, Path(folder))
        wire.wake_fits(url, "vllm.gpu_memory_utilization")
        for asleep in (False, True):
            wire.before_transfer(url, asleep=asleep)
            wire.after_transfer(url, asleep=asleep)
        wire.generate_one_token(url)
        _generations(url, wire, SamplingParams)
        _load(url, "a", Path(folder))
        _post(url, "/v1/unload_lora_adapter", {"lora_name": "a"})
        import torch

        target = TransferTarget(backend="ipc", replicas=(Replica(url, "s"),), dtype=None)
        WeightPusher(share=lambda tensor: {"uuid": (0,)}).push(target, [("w", torch.zeros(2))])
        routes = TransferRoutes(url, 10)  # nccl's init: `WeightPusher._open_group`'s body, `NcclChannel`'s rendezvous
        routes.init({"rank_offset": 1, "world_size": 2, "packed": False, "nccl_unique_id_b64": ""})
        routes.close()
        return list(calls)


def _generations(url: str, wire: Any, params: Any) -> None:
    async def both() -> None:
        import httpx

        async with httpx.AsyncClient() as client:
            for stream in (False, True):
                body = wire.completion_body([1, 2], params(max_tokens=2, stream=stream, lead=((3,),)), max_tokens=2,
                                            stop_token_ids=[0])
                send = wire.stream_completion if stream else wire.whole_completion
                async for _ in send(client, url, body, lambda prompt, cached: None):
                    pass

    asyncio.run(both())


@contextlib.contextmanager
def _recorder() -> Iterator[tuple[str, list[Call]]]:
    """A stand-in vLLM on a free loopback port that records (method, path, query, JSON body) and answers as vLLM."""
    calls: list[Call] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            self._answer(None)

        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            length = int(self.headers.get("Content-Length") or 0)
            self._answer(json.loads(self.rfile.read(length)) if length else None)

        def _answer(self, body: Any) -> None:
            parts = urlsplit(self.path)
            calls.append((self.command, parts.path, parse_qs(parts.query), body))
            data, kind = _answer(parts.path, body)
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", calls
    finally:
        server.shutdown()
        server.server_close()


def _answer(path: str, body: Any) -> tuple[bytes, str]:
    if path == "/reset_prefix_cache":
        return b'{"success": true}', "application/json"
    if path == "/collective_rpc":
        fits = {"gpu": 0, "free_bytes": 2**40, "kv_cache_bytes": 2**30, "holders": []}
        return json.dumps({"results": [fits]}).encode(), "application/json"
    if path != "/v1/completions":
        return b"{}", "application/json"
    choice = {"index": 0, "text": "", "token_ids": [5], "logprobs": {"token_logprobs": [-1.0]},
              "finish_reason": "length"}
    usage = {"prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}
    if not (body or {}).get("stream"):
        return json.dumps({"choices": [choice], "usage": usage}).encode(), "application/json"
    events = [{"choices": [choice]}, {"choices": [], "usage": usage}]
    return ("".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n").encode(), "text/event-stream"


# ----------------------------------------------------------------------------------------------------------------
# the logits processor, against stand-ins of vLLM's classes built from the manifest
# ----------------------------------------------------------------------------------------------------------------


def problems_of_lead(manifest: dict[str, Any]) -> list[str]:
    """vLLM loads `vllm_lead:LeadConstraint` through each logits-processor loader it has: the class must subclass
    the base that loader requires, be built as that loader builds it, and implement its base's methods with the
    same parameters."""
    from servers.engines.vllm_process import LEAD_PROCESSOR

    module_name, class_name = LEAD_PROCESSOR.split(":")
    with _stand_in_vllm(manifest) as bases:
        try:
            lead = getattr(importlib.import_module(module_name), class_name)
        except Exception as exc:  # noqa: BLE001 - reported: vLLM would fail its start the same way
            return [f"{LEAD_PROCESSOR} does not import against vLLM's names: {type(exc).__name__}: {exc}"]
        problems = []
        for interface, base_path in manifest["logits_loaders"].items():
            if base_path is not None:
                problems += _interface_problems(manifest, interface, base_path, bases, lead)
        return problems


def _interface_problems(manifest: dict, interface: str, base_path: str, bases: dict, lead: type) -> list[str]:
    import torch

    default = " (Model Runner V2, vLLM's default where Triton runs: on CUDA)" if interface == "v2" else ""
    base = bases.get(base_path)
    if base is None or not issubclass(lead, base):
        return [f"{lead.__module__}:{lead.__name__} is not a subclass of {base_path}, which vLLM's {interface} "
                f"logits-processor loader requires{default}"]
    built_with = {"v1": (None, torch.device("cpu"), False), "v2": (None, bases["request_state"]())}[interface]
    try:
        instance = lead(*built_with)
    except Exception as exc:  # noqa: BLE001 - reported
        return [f"{lead.__name__} cannot be built as the {interface} loader builds it: {type(exc).__name__}: {exc}"]
    problems = [] if isinstance(instance, base) else [f"{lead.__name__}(...) is no {base_path} under {interface}"]
    for method, params in manifest["classes"][f"logits_{interface}"]["methods"].items():
        owner = next(k for k in type(instance).__mro__ if method in k.__dict__)
        if owner is base or owner is object:
            continue  # vLLM's own default
        ours = [p for p in inspect.signature(getattr(type(instance), method)).parameters if p not in ("self", "cls")]
        if ours != params:
            problems.append(f"{type(instance).__name__}.{method}{tuple(ours)} differs from the {interface} interface's"
                            f" {method}{tuple(params)}")
    return problems


@contextlib.contextmanager
def _stand_in_vllm(manifest: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """sys.modules holds a `vllm` made of the manifest's names (placeholders, and the logits-processor interfaces
    as ABCs with the manifest's abstract methods); marl's in-vLLM modules import fresh against it."""
    saved = {name: module for name, module in sys.modules.items() if name == "vllm" or name.startswith("vllm.")
             or name in IN_VLLM}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(ENGINES))
    bases = _install(manifest)
    try:
        yield bases
    finally:
        sys.path.remove(str(ENGINES))
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.") or n in IN_VLLM]:
            del sys.modules[name]
        sys.modules.update(saved)


def _install(manifest: dict[str, Any]) -> dict[str, Any]:
    import abc

    classes, made = manifest["classes"], {}
    for interface in ("v1", "v2"):
        facts = classes.get(f"logits_{interface}")
        if facts is not None:
            body = {name: (abc.abstractmethod(_placeholder()) if name in facts["abstract"] else _placeholder())
                    for name in facts["methods"] if name != "validate_params"}
            body["validate_params"] = classmethod(lambda cls, params: None)
            made[interface] = abc.ABCMeta("LogitsProcessor", (abc.ABC,), body)
    if classes.get("request_state"):
        fields = {field: None for field in classes["request_state"]["fields"]}
        made["request_state"] = type("LogitsProcRequestState", (), fields)
    bases = {}
    for path, names in manifest["module_names"].items():
        if names is None:
            continue
        dotted = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        module = _module(dotted)
        interface = "v2" if "/worker/gpu/" in path else "v1"
        for name in names:
            value = made.get(interface) if name == "LogitsProcessor" else (
                made.get("request_state") if name == "LogitsProcRequestState" else type(name, (), {}))
            setattr(module, name, value if value is not None else type(name, (), {}))
        if "LogitsProcessor" in names and path.endswith("interface.py"):
            bases[f"{dotted}.LogitsProcessor"] = module.LogitsProcessor
    bases["request_state"] = made.get("request_state", type("LogitsProcRequestState", (), {}))
    return bases


def _placeholder() -> Any:
    """A new method that does nothing (new each time: `abstractmethod` marks the function object itself)."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return None

    return method


def _module(dotted: str) -> types.ModuleType:
    """`dotted` in sys.modules (and each parent package, with the child set on it)."""
    parts = dotted.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].__path__ = []  # a package: submodules import
            if i > 1:
                setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], sys.modules[name])
    return sys.modules[dotted]


# ----------------------------------------------------------------------------------------------------------------
# the worker extension and marl's imports from vLLM, read from the source
# ----------------------------------------------------------------------------------------------------------------


def problems_of_worker_extension(manifest: dict[str, Any]) -> list[str]:
    """The worker extension is mixed into vLLM's worker: every `self.x` it uses and did not define must be the
    worker's, every `self.model_runner.y` both model runners', the keywords it passes `reload_weights` the runners'
    parameters; its own methods must not replace the worker's; the allocator fields it reads must exist."""
    from servers.engines.vllm_process import WORKER_EXTENSION

    module_name, class_name = WORKER_EXTENSION.split(".")
    tree = ast.parse((ENGINES / f"{module_name}.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    classes = manifest["classes"]
    worker, runners = classes["worker"], [classes["runner_v1"], classes["runner_v2"]]
    own = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    problems = [f"{class_name}.{name} would replace vLLM's Worker.{name}" for name in own if name in worker["methods"]]
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "self" and node.attr not in own \
                and node.attr not in worker["methods"] and node.attr not in worker["attributes"]:
            problems.append(f"{class_name} uses self.{node.attr}, which vLLM's Worker lacks")
        if isinstance(node, ast.Attribute) and getattr(getattr(node.value, "value", None), "id", None) == "self" \
                and getattr(node.value, "attr", None) == "model_runner":
            problems += [f"{class_name} calls model_runner.{node.attr}, which a model runner lacks" for r in runners
                         if r is None or (node.attr not in r["methods"] and node.attr not in r["attributes"])]
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "reload_weights":
            problems += [f"reload_weights({k.arg}=...) is no parameter of a model runner's" for k in node.keywords
                         for r in runners if r is None or k.arg not in r["methods"].get("reload_weights", [])]
    for key, fields in ALLOCATOR_READS.items():
        facts = classes.get(key) or {"fields": [], "attributes": []}
        problems += [f"the worker extension reads {key}.{f}, which vLLM lacks" for f in fields
                     if f not in facts["fields"] + facts["attributes"] + list(facts.get("methods", {}))]
    return sorted(set(problems)) + _import_problems(manifest)


def _import_problems(manifest: dict[str, Any]) -> list[str]:
    """Every `from vllm... import name` in marl's in-vLLM modules names something that module has."""
    problems = []
    for module in IN_VLLM:
        path = ENGINES / f"{module}.py"
        if not path.exists():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                problems += _missing(manifest, module, node)
    return problems


def _missing(manifest: dict[str, Any], module: str, node: ast.ImportFrom) -> list[str]:
    base = node.module.replace(".", "/")
    names = manifest["module_names"].get(f"{base}.py") or manifest["module_names"].get(f"{base}/__init__.py")
    if names is None and f"{base}.py" not in manifest["module_names"] and f"{base}/__init__.py" not in \
            manifest["module_names"]:
        return [f"{module} imports from {node.module}, which the contract does not read (add it to IMPORTED_MODULES)"]
    return [f"{module} imports {a.name} from {node.module}, which vLLM lacks" for a in node.names
            if names is None or a.name not in names]
