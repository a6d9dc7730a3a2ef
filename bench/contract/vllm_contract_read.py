"""Reads the facts marl depends on out of vLLM's sources, without importing them (vLLM 0.33's CUDA build needs torch
2.14 and a GPU to import much of itself): `read_manifest(source)` parses the Python files of a wheel, or of a folder
that holds the `vllm` package, and returns the manifest `bench/vllm_contract.py` writes and checks marl against.

Only the facts below are read, each from the file vLLM keeps it in (a fact whose file or class moved reads as
missing, and the check then fails, naming it):
- every HTTP route under `vllm/entrypoints/`: method, path, query parameters, body fields, the keys of its JSON answer;
- the fields of the request and response models marl sends or reads (`MODELS`), their bases' fields included;
- the command line's flags (the engine's and the frontend's argument dataclasses) and the environment variables;
- the two logits-processor interfaces (V1 and Model Runner V2), which base class each loader requires, and whether
  V2 is vLLM's default where Triton runs;
- the worker's and the model runners' methods (the worker extension calls them), the sleep allocator's tags;
- the weight-transfer engines' init and update fields; the paused refusal's status, error type and code.
"""

from __future__ import annotations

import ast
import re
import zipfile
from pathlib import Path
from typing import Any

__all__ = ["read_manifest"]

#: Where each class marl relies on lives (module path under the wheel's root).
CLASSES = {
    "logits_v1": ("vllm/v1/sample/logits_processor/interface.py", "LogitsProcessor"),
    "batch_update": ("vllm/v1/sample/logits_processor/interface.py", "BatchUpdate"),
    "logits_v2": ("vllm/v1/worker/gpu/sample/logits_processor/interface.py", "LogitsProcessor"),
    "logits_context": ("vllm/v1/worker/gpu/sample/logits_processor/interface.py", "LogitsContext"),
    "request_state": ("vllm/v1/worker/gpu/sample/logits_processor/interface.py", "LogitsProcRequestState"),
    "sampling_params": ("vllm/sampling_params.py", "SamplingParams"),
    "worker": ("vllm/v1/worker/gpu_worker.py", "Worker"),
    "runner_v1": ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner"),
    "runner_v2": ("vllm/v1/worker/gpu/model_runner.py", "GPUModelRunner"),
    "cumem_allocator": ("vllm/device_allocator/cumem.py", "CuMemAllocator"),
    "allocation_data": ("vllm/device_allocator/cumem.py", "AllocationData"),
    "ipc_init": ("vllm/distributed/weight_transfer/ipc_engine.py", "IPCWeightTransferInitInfo"),
    "ipc_update": ("vllm/distributed/weight_transfer/ipc_engine.py", "IPCWeightTransferUpdateInfo"),
    "nccl_init": ("vllm/distributed/weight_transfer/nccl_common.py", "NCCLWeightTransferInitInfo"),
    "nccl_update": ("vllm/distributed/weight_transfer/nccl_engine.py", "NCCLWeightTransferUpdateInfo"),
    "engine_args": ("vllm/engine/arg_utils.py", "EngineArgs"),
    "frontend_args": ("vllm/entrypoints/common/cli_args.py", "FrontendArgs"),
}
#: The loaders of custom logits processors, by interface: the file whose `issubclass(..., LogitsProcessor)` decides.
LOADERS = {"v1": "vllm/v1/sample/logits_processor/__init__.py",
           "v2": "vllm/v1/worker/gpu/sample/logits_processor/loader.py"}
#: Request and response models of the routes marl calls, by class name (found anywhere under vllm/entrypoints/).
MODELS = ("CompletionRequest", "StreamOptions", "CompletionResponse", "CompletionResponseChoice",
          "CompletionStreamResponse", "CompletionResponseStreamChoice", "CompletionLogProbs", "UsageInfo",
          "PromptTokenUsageInfo", "ErrorResponse", "ErrorInfo", "LoadLoRAAdapterRequest", "UnloadLoRAAdapterRequest")
ROUTE_VERBS = {"get", "post", "put", "delete", "api_route"}
#: Modules marl's code inside vLLM's process imports names from: their top-level names are recorded.
IMPORTED_MODULES = ("vllm/__init__.py", "vllm/v1/sample/logits_processor/__init__.py",
                    "vllm/v1/sample/logits_processor/interface.py", "vllm/v1/sample/logits_processor/builtin.py",
                    "vllm/v1/worker/gpu/sample/logits_processor/__init__.py",
                    "vllm/v1/worker/gpu/sample/logits_processor/interface.py", "vllm/device_allocator/__init__.py",
                    "vllm/device_allocator/cumem.py")


class Sources:
    """The `vllm/**.py` files of a wheel or a folder, parsed on first use."""

    def __init__(self, source: Path) -> None:
        if source.is_file():
            with zipfile.ZipFile(source) as wheel:
                self.texts = {name: wheel.read(name).decode() for name in wheel.namelist()
                              if name.startswith("vllm/") and name.endswith(".py")}
                self.metadata = next((wheel.read(n).decode() for n in wheel.namelist()
                                      if n.endswith(".dist-info/METADATA")), "")
        else:
            root = source if (source / "vllm").is_dir() else source.parent
            self.texts = {str(p.relative_to(root)): p.read_text(errors="replace")
                          for p in (root / "vllm").rglob("*.py")}
            self.metadata = next((p.read_text() for p in root.glob("vllm*.dist-info/METADATA")), "")
        self._trees: dict[str, ast.Module | None] = {}

    def tree(self, path: str) -> ast.Module | None:
        if path not in self._trees:
            text = self.texts.get(path)
            self._trees[path] = ast.parse(text) if text is not None else None
        return self._trees[path]

    def distribution(self) -> tuple[str, str]:
        """(name, version) from the wheel's METADATA, else `vllm/_version.py`."""
        name = re.search(r"^Name: (.+)$", self.metadata, re.M)
        version = re.search(r"^Version: (.+)$", self.metadata, re.M)
        if version is None:
            version = re.search(r"version = .*?['\"]([^'\"]+)['\"]", self.texts.get("vllm/_version.py", ""))
        return (name.group(1).strip() if name else "vllm"), (version.group(1).strip() if version else "unknown")


def find_class(sources: Sources, path: str, name: str) -> ast.ClassDef | None:
    tree = sources.tree(path)
    return next((node for node in (tree.body if tree else []) if isinstance(node, ast.ClassDef) and node.name == name),
                None)


def imported_from(sources: Sources, path: str, name: str) -> str | None:
    """The module file a module-level `from x import name` in `path` names (None: not imported there)."""
    for node in ast.walk(sources.tree(path) or ast.Module(body=[], type_ignores=[])):
        if not (isinstance(node, ast.ImportFrom) and node.module):
            continue
        for alias in node.names:
            if (alias.asname or alias.name) != name:
                continue
            module = node.module.replace(".", "/")
            for candidate in (f"{module}.py", f"{module}/__init__.py"):
                if candidate in sources.texts:
                    return _reexported(sources, candidate, alias.name)
    return None


def _reexported(sources: Sources, path: str, name: str) -> str:
    """Follow a package `__init__` that re-exports `name` to the file that defines it."""
    if find_class(sources, path, name) is not None:
        return path
    return imported_from(sources, path, name) or path


def class_facts(sources: Sources, path: str, name: str, depth: int = 0) -> dict[str, Any] | None:
    """A class's methods (parameter names), abstract methods, fields (annotated names) and `self.x` attributes,
    its bases' (found in vLLM) merged under its own."""
    node = find_class(sources, path, name)
    if node is None and (elsewhere := imported_from(sources, path, name)) not in (None, path):
        return class_facts(sources, elsewhere, name, depth + 1)  # re-exported: read where it is defined
    if node is None:
        return None
    facts: dict[str, Any] = {"module": path, "methods": {}, "abstract": [], "fields": [], "attributes": []}
    for base in node.bases if depth < 8 else []:
        base_name = base.id if isinstance(base, ast.Name) else None
        base_path = base_name and (path if find_class(sources, path, base_name) else imported_from(sources, path,
                                                                                                    base_name))
        if base_path and (inherited := class_facts(sources, base_path, base_name, depth + 1)):
            for key in ("methods",):
                facts[key].update(inherited[key])
            for key in ("abstract", "fields", "attributes"):
                facts[key] += [item for item in inherited[key] if item not in facts[key]]
    _own_members(node, facts)
    return facts


def _own_members(node: ast.ClassDef, facts: dict[str, Any]) -> None:
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id not in \
                facts["fields"]:
            facts["fields"].append(item.target.id)
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            args = item.args
            names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
            names += [f"*{args.vararg.arg}"] if args.vararg else []
            names += [f"**{args.kwarg.arg}"] if args.kwarg else []
            facts["methods"][item.name] = [n for n in names if n not in ("self", "cls")]
            decorators = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in item.decorator_list}
            if "abstractmethod" in decorators and item.name not in facts["abstract"]:
                facts["abstract"].append(item.name)
            elif "abstractmethod" not in decorators and item.name in facts["abstract"]:
                facts["abstract"].remove(item.name)  # implemented here
            for sub in ast.walk(item):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self" \
                        and isinstance(sub.ctx, ast.Store) and sub.attr not in facts["attributes"]:
                    facts["attributes"].append(sub.attr)


def loader_base(sources: Sources, path: str) -> str | None:
    """The class a logits-processor loader requires: `issubclass(x, LogitsProcessor)` in `path`, as 'module.Class'."""
    tree = sources.tree(path)
    for node in ast.walk(tree or ast.Module(body=[], type_ignores=[])):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "issubclass" and len(node.args) == 2 \
                and isinstance(node.args[1], ast.Name):
            name = node.args[1].id
            where = path if find_class(sources, path, name) else imported_from(sources, path, name)
            return f"{where.removesuffix('.py').replace('/', '.')}.{name}" if where else None
    return None


def v2_is_default(sources: Sources) -> bool | None:
    """Whether `VllmConfig.use_v2_model_runner` ends in `return True` (V2 unless Triton is missing, an unsupported
    feature is on or VLLM_USE_V2_MODEL_RUNNER says otherwise); None when the property is not there."""
    config = find_class(sources, "vllm/config/vllm.py", "VllmConfig")
    prop = next((n for n in (config.body if config else []) if isinstance(n, ast.FunctionDef)
                 and n.name == "use_v2_model_runner"), None)
    if prop is None:
        return None
    last = prop.body[-1]
    return isinstance(last, ast.Return) and isinstance(last.value, ast.Constant) and last.value.value is True


def routes(sources: Sources) -> dict[str, dict[str, list[str]]]:
    """Every route under vllm/entrypoints/: 'POST /path' -> its query parameters, body fields (a model's fields, an
    embedded `Body`, or keys read off the raw JSON) and the keys of the JSON it answers with."""
    found: dict[str, dict[str, list[str]]] = {}
    for path in sorted(p for p in sources.texts if p.startswith("vllm/entrypoints/")):
        for node in ast.walk(sources.tree(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for key in _route_keys(node):
                    found[key] = _route_shape(sources, path, node)
    return found


def _route_keys(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    keys = []
    for decorator in function.decorator_list:
        if not (isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", None) in ROUTE_VERBS
                and decorator.args and isinstance(decorator.args[0], ast.Constant)
                and str(decorator.args[0].value).startswith("/")):
            continue
        verbs = [decorator.func.attr.upper()]
        if verbs == ["API_ROUTE"]:
            methods = next((k.value for k in decorator.keywords if k.arg == "methods"), None)
            verbs = [e.value for e in getattr(methods, "elts", [])] or ["GET"]
        keys += [f"{verb} {decorator.args[0].value}" for verb in verbs]
    return keys


def _route_shape(sources: Sources, path: str, function: ast.AST) -> dict[str, list[str]]:
    shape: dict[str, list[str]] = {"query": [], "body": [], "answers": []}
    for arg in function.args.args + function.args.kwonlyargs:
        kind = _param_kind(arg.annotation)
        if kind in ("query", "body"):
            shape[kind].append(arg.arg)
        elif kind is not None:  # a request model: its fields
            model = model_fields(sources, kind, near=path)
            shape["body"] += model or []
    for node in ast.walk(function):
        call = node if isinstance(node, ast.Call) else None
        attr = getattr(call.func, "attr", None) if call else None
        if attr in ("get", "getlist") and call.args and isinstance(call.args[0], ast.Constant):
            owner = call.func.value
            if getattr(owner, "attr", None) == "query_params":
                shape["query"].append(call.args[0].value)
            elif getattr(owner, "id", None) == "body":
                shape["body"].append(call.args[0].value)
        if call and getattr(call.func, "id", None) == "JSONResponse":
            content = next((k.value for k in call.keywords if k.arg == "content"), call.args[0] if call.args else None)
            if isinstance(content, ast.Dict):
                shape["answers"] += [k.value for k in content.keys if isinstance(k, ast.Constant)]
    return {key: sorted(set(values)) for key, values in shape.items()}


def _param_kind(annotation: ast.AST | None) -> str | None:
    """'query' or 'body' for `Annotated[..., Query()|Body()]`, a class name for a model, None for anything else."""
    if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", None) == "Annotated":
        for part in getattr(annotation.slice, "elts", [])[1:]:
            name = getattr(getattr(part, "func", None), "id", None)
            if name in ("Query", "Body"):
                return name.lower()
        return None
    name = getattr(annotation, "id", None)
    return name if name and name[0].isupper() and name not in ("Request", "Response") else None


def model_fields(sources: Sources, name: str, near: str = "vllm/entrypoints/") -> list[str] | None:
    """A model's fields (its bases' included), the class found where `near` imports it from, else anywhere under
    vllm/entrypoints/ (the first file that defines it)."""
    where = imported_from(sources, near, name) if near.endswith(".py") else None
    where = where or next((p for p in sorted(sources.texts) if p.startswith("vllm/entrypoints/")
                           and find_class(sources, p, name) is not None), None)
    facts = class_facts(sources, where, name) if where else None
    return sorted(facts["fields"]) if facts else None


def cli_flags(sources: Sources) -> list[str]:
    """`--x-y` for every field of the engine's and the frontend's argument dataclasses (vLLM derives its flags from
    them), and every literal `--flag` the two files add by hand."""
    flags = set()
    for key in ("engine_args", "frontend_args"):
        path, name = CLASSES[key]
        if find_class(sources, path, name) is None:  # it moved between releases: wherever entrypoints define it
            path = next((p for p in sorted(sources.texts) if p.startswith("vllm/entrypoints/")
                         and find_class(sources, p, name) is not None), path)
        facts = class_facts(sources, path, name)
        flags |= {"--" + field.replace("_", "-") for field in (facts["fields"] if facts else [])}
        flags |= set(re.findall(r"[\"'](--[a-z][a-z0-9-]+)[\"']", sources.texts.get(path, "")))
    return sorted(flags)


def env_vars(sources: Sources) -> list[str]:
    """The keys of `environment_variables` in vllm/envs.py: every variable vLLM reads."""
    return sorted(set(re.findall(r"^\s+[\"'](VLLM_[A-Z0-9_]+)[\"']\s*:", sources.texts.get("vllm/envs.py", ""), re.M)))


def paused_refusal(sources: Sources) -> dict[str, Any]:
    """How a paused vLLM refuses a new request: the code its engine core gives the error, whether that error is
    retryable, and what a retryable error becomes on the wire (status, error type)."""
    core = sources.texts.get("vllm/v1/engine/core.py", "")
    reject = re.search(r"def _reject_add_while_paused.*?RequestError\((.*?)\)", core, re.S)
    code = re.search(r"code=\"([a-z_]+)\"", reject.group(1)) if reject else None
    handler = sources.texts.get("vllm/entrypoints/serve/exception_handling/error_response.py", "")
    retryable_type = re.search(r"\"(\w+)\"\s*if isinstance\(exc, RetryableRequestError\)", handler)
    exceptions = sources.texts.get("vllm/exceptions.py", "")
    retryable = re.search(r"class RetryableRequestError.*?status_code = HTTPStatus\.(\w+)", exceptions, re.S)
    stream = sources.texts.get("vllm/entrypoints/openai/completion/serving.py", "")
    return {"code": code.group(1) if code else None,
            "retryable": bool(reject and "retryable=True" in reject.group(1)),
            "status": {"SERVICE_UNAVAILABLE": 503}.get(retryable.group(1)) if retryable else None,
            "type": retryable_type.group(1) if retryable_type else None,
            "streamed_as_sse_error": "_convert_generation_error_to_streaming_response" in stream}


def sleep_tags(sources: Sources) -> dict[str, list[str]]:
    """The sleep allocator's tags: those a wake must name (the rest wake with any wake), and those a level-1 sleep
    offloads to host memory (the rest are discarded)."""
    cumem = "".join(text for path, text in sources.texts.items() if path.startswith("vllm/device_allocator/"))
    deferrable = re.search(r"^DEFERRABLE_TAGS[^=\n]*=\s*[({\[]([^)}\]]*)", cumem, re.M)
    backend = sources.texts.get("vllm/device_allocator/sleep_mode_backend.py", "")
    offloaded = re.search(r"offload_tags[^=]*=\s*\(([^)]*)\)\s*\n\s*if level == 1:\s*\n\s*offload_tags = \(\"(\w+)\"",
                          backend)
    kept = re.findall(r"\"(\w+)\"", offloaded.group(1)) + [offloaded.group(2)] if offloaded else []
    return {"deferrable": sorted(re.findall(r"\"(\w+)\"", deferrable.group(1))) if deferrable else [],
            "offloaded_at_level_1": sorted(kept)}


def module_names(sources: Sources, path: str) -> list[str] | None:
    """The names a module defines or imports at its top level (and those a package's lazy `__getattr__` offers
    through a `MODULE_ATTRS`-style dict of string keys); None when the module is not there."""
    tree = sources.tree(path)
    if tree is None:
        return None
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if isinstance(node.value, ast.Dict):  # a lazy-import table: its keys are importable names
                names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return sorted(names)


def read_manifest(source: Path) -> dict[str, Any]:
    """Every fact above, for the vLLM at `source`."""
    sources = Sources(source)
    name, version = sources.distribution()
    classes = {key: class_facts(sources, path, cls) for key, (path, cls) in CLASSES.items()
               if key not in ("engine_args", "frontend_args")}
    return {
        "distribution": name, "version": version,
        "entry_module_runs": "if __name__ == \"__main__\"" in sources.texts.get(
            "vllm/entrypoints/launchers/api_server/entry.py", ""),
        "logits_loaders": {key: loader_base(sources, path) for key, path in LOADERS.items()},
        "v2_default_where_triton_runs": v2_is_default(sources),
        "classes": classes,
        "module_names": {path: module_names(sources, path) for path in IMPORTED_MODULES},
        "models": {name: model_fields(sources, name) for name in MODELS},
        "routes": routes(sources),
        "cli_flags": cli_flags(sources),
        "env_vars": env_vars(sources),
        "paused_refusal": paused_refusal(sources),
        "sleep_tags": sleep_tags(sources),
    }
