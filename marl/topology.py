"""Topologies: which roles exist, which model server plays each role, which environment, how many games.

A topology is one YAML file (see `topologies/`). It is loaded with omegaconf (so `${name}` and
`${oc.env:VAR,default}` interpolations work, and `key=value` dotlist overrides from the command line are merged on
top), validated into the pydantic models below, checked for consistency, and turned into a networkx graph:

    role ──played_by──► server          role ──member_of──► team

    topo = Topology.load("topologies/signalling-cpu.yaml", ["run.max_steps=5"])
    topo.server_of("speaker")            # 'speaker_model'
    topo.spec.servers["speaker_model"].train.learning_rate

Servers come in four kinds (`ServerSpec.kind`), told apart by which keys are set:

    model:               + trainable: true   local trainable   `marl run` starts `marl serve --model MODEL`
    model:               + trainable: false  local static      `marl run` starts `marl serve --model MODEL --static`
    swarm_url:           + trainable: true   remote swarm      a swarm server someone else started
    url: + model:                            external OpenAI   a fixed OpenAI-compatible endpoint (e.g. vLLM)

Decisions (also in the error messages):
- Every problem found is reported at once in one `TopologyError`; each names its YAML key as a dotted path
  (`roles.listener.server`), says what is wrong and how to fix it, and where it is: `file:line` (looked up with
  PyYAML; omegaconf keeps no line numbers) or the command-line override that set it.
- Unknown keys are errors everywhere (typos must not be silently ignored), including `env.args` when the env class's
  constructor takes no `**kwargs`: `env.args` are passed to it as keyword arguments.
- A trainable server that no role uses is an error: it would never get an episode, so `run.max_steps` (every
  trainable server has taken that many steps) could never be reached. A static server no role uses is a warning.
- `run.repeats` (games played per task id) must equal every trainable server's `train.num_repeat` (its GRPO group
  size); left out, it is taken from them (they must then agree), or 1 when nothing is trainable.
- A role without `team` is a team of its own (team name = role name). `run.run_dir` defaults to `runs/<name>`;
  `name` defaults to the file's stem.
- `env.class` ("module:Class") is imported while loading (`check_env=False` skips it). When the module is not found,
  the current directory is added to `sys.path` and the import retried, so a user's own `my_env.py` works.
"""

from __future__ import annotations

import difflib
import enum
import importlib
import inspect
import os
import pkgutil
import re
import sys
import traceback
import types
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import networkx as nx
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from marl.protocol import TrainConfig

if TYPE_CHECKING:
    from rich.tree import Tree

__all__ = [
    "EnvSpec", "Problem", "RoleSpec", "RunSpec", "ServerKind", "ServerSpec", "Topology", "TopologyError",
    "TopologySpec", "import_class",
]

#: Names of servers, roles and teams: they become agent tags, directory names and dotlist keys (so no dots).
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
_NAME_RULE = "names may contain letters, digits, '_' and '-' (no dots or spaces)"


# --------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a topology."""

    key: str  # dotted YAML path, e.g. "roles.listener.server"; "" for the whole file
    message: str  # what is wrong and how to fix it
    where: str = ""  # "file.yaml:12", "override 'run.max_steps=x'", "file.yaml", or "" (from_dict)

    def __str__(self) -> str:
        parts = [p for p in (self.where, self.key) if p]
        return ": ".join([*parts, self.message])


class TopologyError(ValueError):
    """A topology that cannot be loaded. `problems` lists every problem found; the message shows them all."""

    def __init__(self, problems: Sequence[Problem], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        what = f"topology {source}" if source else "topology"
        if len(self.problems) == 1:
            only = self.problems[0]
            text = str(only) if source and only.where.startswith(source) else f"invalid {what}: {only}"
        else:
            text = f"invalid {what} ({len(self.problems)} problems):\n" + "\n".join(f"  {p}" for p in self.problems)
        super().__init__(text)


def _did_you_mean(word: object, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(candidates), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------------------------
# The spec (what the YAML says), as typed pydantic models
# --------------------------------------------------------------------------------------------------------------


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerKind(str, enum.Enum):
    LOCAL_TRAINABLE = "local trainable"
    LOCAL_STATIC = "local static"
    REMOTE_SWARM = "remote swarm"
    EXTERNAL_OPENAI = "external OpenAI"


class ServerSpec(_Spec):
    """One model server. Which keys are set decides its kind (see the module docstring)."""

    model: str | None = Field(None, description="Local: model directory or alias. External: the model id to request."
                                                " Remote swarm: optional, the model it is expected to serve.")
    trainable: bool = False
    # local servers only
    device: str | None = Field(None, description="Local: cpu or cuda (default: cuda when available).")
    port: int | None = Field(None, ge=1, le=65535, description="Local: fixed port (default: a free one).")
    prefix_cache_gb: float | None = Field(None, ge=0, description="Local: memory for the keys/values of finished "
                                          "calls that the next turn of a conversation reuses (default 2; 0: off).")
    # external OpenAI endpoint
    url: str | None = Field(None, description="External: OpenAI base URL, e.g. http://host:8000/v1.")
    api_key_env: str | None = Field(None, description="External: environment variable holding the API key.")
    # remote swarm server
    swarm_url: str | None = Field(None, description="Remote swarm server root URL, e.g. http://gpu-box:10086.")
    admin_token_env: str | None = Field(None, description="Remote swarm: environment variable holding the admin token.")
    # trainable servers
    train: TrainConfig | None = Field(None, description="Trainable: the config synced to the server.")

    @property
    def kind(self) -> ServerKind:
        if self.swarm_url is not None:
            return ServerKind.REMOTE_SWARM
        if self.url is not None:
            return ServerKind.EXTERNAL_OPENAI
        return ServerKind.LOCAL_TRAINABLE if self.trainable else ServerKind.LOCAL_STATIC

    @property
    def is_local(self) -> bool:
        return self.kind in (ServerKind.LOCAL_TRAINABLE, ServerKind.LOCAL_STATIC)


class RoleSpec(_Spec):
    """One role: played by a model server (`server`) or by the env's scripted policy (`scripted: true`)."""

    server: str | None = None
    scripted: bool = False
    count: int = Field(1, ge=1, description="How many agents play this role in one game.")
    team: str | None = Field(None, description="Team name (default: the role's name).")


class EnvSpec(_Spec):
    class_path: str = Field(alias="class", description="Import path 'module:Class' of the environment class.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the env class.")

    @property
    def module(self) -> str:
        return self.class_path.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.class_path.partition(":")[2]


class RunSpec(_Spec):
    games: int | None = Field(None, ge=1, description="Total games (None: until max_steps).")
    max_steps: int | None = Field(None, ge=1, description="Stop once every trainable server took this many steps.")
    repeats: int | None = Field(None, ge=1, description="Games per task id (= every trainable server's num_repeat).")
    concurrency: int = Field(8, ge=1, description="Games in flight.")
    per_server_concurrency: int | None = Field(None, ge=1, description="Cap of concurrent leases per server.")
    lease_timeout_s: float = Field(60.0, gt=0)
    max_tokens: int = Field(64, ge=1, description="Longest reply of an LLM agent per turn.")
    temperature: float = Field(1.0, ge=0, le=2, description="Sampling temperature of the LLM agents.")
    seed: int = 0
    run_dir: Path | None = Field(None, description="Output directory (default: runs/<name>).")


class TopologySpec(_Spec):
    name: str = Field(min_length=1)
    description: str | None = None
    servers: dict[str, ServerSpec] = Field(default_factory=dict)
    roles: dict[str, RoleSpec] = Field(min_length=1)
    env: EnvSpec
    run: RunSpec = Field(default_factory=RunSpec)


# Hints appended to "required key is missing" errors.
_MISSING_HINTS = {
    "name": "give the topology a name, e.g. name: my-experiment",
    "roles": "list who plays what, e.g. roles: {speaker: {server: speaker_model}}",
    "env": "name the environment, e.g. env: {class: envs.signalling:SignallingGame, args: {}}",
    "env.class": "give the env's import path 'module:Class', e.g. class: envs.signalling:SignallingGame",
}


# --------------------------------------------------------------------------------------------------------------
# Importing the env class
# --------------------------------------------------------------------------------------------------------------


def import_class(path: str) -> type:
    """Import "module:Class" (or "module:Outer.Inner") and return the class. Raises ImportError with a clear message."""
    module_name, sep, qualname = path.partition(":")
    if not sep or not module_name or not qualname:
        guess = ""
        if not sep and "." in path:
            head, _, tail = path.rpartition(".")
            guess = f"; did you mean '{head}:{tail}'?"
        raise ImportError(f"{path!r} is not an import path 'module:Class'{guess}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        cwd = os.getcwd()
        if exc.name == top and cwd not in sys.path and "" not in sys.path:
            sys.path.insert(0, cwd)  # a user's own env module next to where they run `marl`
            return import_class(path)
        hint = ""
        parent, _, leaf = module_name.rpartition(".")
        if exc.name == module_name and parent:  # a typo in the last part: list the package's modules
            try:
                package = importlib.import_module(parent)
                siblings = [m.name for m in pkgutil.iter_modules(getattr(package, "__path__", []))]
                hint = _did_you_mean(leaf, siblings).replace("(did you mean '", f"(did you mean '{parent}.")
            except Exception:  # noqa: BLE001 - only a hint
                hint = ""
        raise ImportError(f"cannot import module {module_name!r}: {exc}{hint}") from exc
    except Exception as exc:  # a SyntaxError, or an import inside the module failing
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
        at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        if isinstance(exc, SyntaxError) and exc.filename:
            at = f" (at {exc.filename}:{exc.lineno})"
        raise ImportError(f"importing module {module_name!r} failed: {type(exc).__name__}: {exc}{at}") from exc
    obj: Any = module
    for part in qualname.split("."):
        if not hasattr(obj, part):
            names = [n for n, v in vars(obj).items() if inspect.isclass(v) and not n.startswith("_")]
            raise ImportError(f"module {module_name!r} has no attribute {qualname!r}{_did_you_mean(part, names)}")
        obj = getattr(obj, part)
    if not inspect.isclass(obj):
        raise ImportError(f"{path!r} is a {type(obj).__name__}, not a class")
    return obj


# --------------------------------------------------------------------------------------------------------------
# Where a key is: YAML line numbers and overrides
# --------------------------------------------------------------------------------------------------------------


class _Locator:
    def __init__(self, source: str | None, text: str | None, overrides: Sequence[tuple[str, str]] = ()):
        self.source = source
        self.overrides = list(overrides)  # (key, original text)
        self.root = None
        if text is not None:
            try:
                self.root = yaml.compose(text, Loader=yaml.SafeLoader)
            except yaml.YAMLError:
                self.root = None

    def _line(self, parts: Sequence[str]) -> tuple[int | None, bool]:
        """(line of the deepest key of `parts` found in the file, whether all of `parts` was found)."""
        node = self.root
        if node is None:
            return None, False
        line = node.start_mark.line + 1
        for part in parts:
            if isinstance(node, yaml.MappingNode):
                for key_node, value_node in node.value:
                    if str(key_node.value) == part:
                        line, node = key_node.start_mark.line + 1, value_node
                        break
                else:
                    return line, False
            elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
                node = node.value[int(part)]
                line = node.start_mark.line + 1
            else:
                return line, False
        return line, True

    def where(self, parts: Sequence[Any]) -> str:
        """Where the value at `parts` came from: the override that set it (or something inside it, when the key is
        not in the file), else the file and line."""
        parts = [str(p) for p in parts]
        line, found = self._line(parts)
        for key, text in reversed(self.overrides):  # the last override of a key wins, as in the merge
            kparts = key.split(".")
            if parts[:len(kparts)] == kparts or (parts and kparts[:len(parts)] == parts and not found):
                return f"override {text!r}"
        if self.source is None:
            return ""
        return f"{self.source}:{line}" if line else self.source

    def problem(self, parts: Sequence[Any], message: str) -> Problem:
        return Problem(".".join(str(p) for p in parts), message, self.where(parts))


# --------------------------------------------------------------------------------------------------------------
# Pydantic errors -> problems
# --------------------------------------------------------------------------------------------------------------


def _unwrap(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _model_at(loc: Sequence[Any]) -> type[BaseModel] | None:
    tp: Any = TopologySpec
    for part in loc:
        tp = _unwrap(tp)
        if inspect.isclass(tp) and issubclass(tp, BaseModel):
            field = next((f for n, f in tp.model_fields.items() if part in (n, f.alias)), None)
            if field is None:
                return None
            tp = field.annotation
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        else:
            return None
    tp = _unwrap(tp)
    return tp if inspect.isclass(tp) and issubclass(tp, BaseModel) else None


def _allowed_keys(loc: Sequence[Any]) -> list[str]:
    model = _model_at(loc)
    return [f.alias or n for n, f in model.model_fields.items()] if model else []


def _pydantic_problems(exc: ValidationError, locator: _Locator) -> list[Problem]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = [p for p in err["loc"] if p != "[key]"]
        kind = err["type"]
        if kind == "extra_forbidden":
            allowed = _allowed_keys(loc[:-1])
            what = {"ServerSpec": "a server", "RoleSpec": "a role", "EnvSpec": "env", "RunSpec": "run",
                    "TrainConfig": "train (a TrainConfig)", "TopologySpec": "a topology"}
            model = _model_at(loc[:-1])
            here = what.get(model.__name__, model.__name__) if model else "here"
            msg = f"unknown key {str(loc[-1])!r}{_did_you_mean(loc[-1], allowed)}"
            if allowed:
                msg += f"; the keys of {here} are: {', '.join(allowed)}"
        elif kind == "missing":
            dotted = ".".join(str(p) for p in loc)
            hint = _MISSING_HINTS.get(dotted) or _MISSING_HINTS.get(str(loc[-1]) if loc else "", "")
            msg = "required key is missing" + (f": {hint}" if hint else "")
        else:
            msg = f"{err['msg']} (got {_short(err.get('input'))})"
        problems.append(locator.problem(loc, msg))
    return problems


# --------------------------------------------------------------------------------------------------------------
# Consistency checks (after the types are right)
# --------------------------------------------------------------------------------------------------------------


def _check(spec: TopologySpec, locator: _Locator, check_env: bool) -> tuple[list[Problem], list[Problem]]:
    """Returns (problems, warnings). Fills in run.repeats and run.run_dir defaults."""
    problems: list[Problem] = []
    warnings: list[Problem] = []

    def bad(parts: Sequence[Any], message: str) -> None:
        problems.append(locator.problem(parts, message))

    def warn(parts: Sequence[Any], message: str) -> None:
        warnings.append(locator.problem(parts, message))

    server_names = list(spec.servers)
    broken: set[str] = set()  # servers whose kind cannot be told
    known = ", ".join(server_names) if server_names else "(none: add one under servers:)"

    # -- servers -----------------------------------------------------------------------------------------
    for name, s in spec.servers.items():
        at = ["servers", name]
        if not NAME_RE.match(name):
            bad(at, f"bad server name {name!r}: {_NAME_RULE}")
        if s.url is not None and s.swarm_url is not None:
            bad(at, "both url (an external OpenAI endpoint) and swarm_url (a remote swarm server) are set: keep"
                    " swarm_url for a swarm server you train, url for a fixed OpenAI-compatible endpoint")
            broken.add(name)
            continue
        if s.model is None and s.url is None and s.swarm_url is None:
            bad(at, "says neither what nor where the model is: give model: (a local server that `marl run` starts,"
                    " e.g. model: smollm2-135m), url: + model: (an external OpenAI endpoint), or swarm_url: (a"
                    " remote swarm server)")
            broken.add(name)
            continue
        kind = s.kind
        remote = kind in (ServerKind.REMOTE_SWARM, ServerKind.EXTERNAL_OPENAI)
        if remote:
            for key in ("device", "port", "prefix_cache_gb"):
                if getattr(s, key) is not None:
                    which = "url" if kind is ServerKind.EXTERNAL_OPENAI else "swarm_url"
                    bad([*at, key], f"{key} only applies to a local server that `marl run` starts, but this server"
                                    f" is remote ({which}: is set): remove {key}, or remove {which} to run it locally")
        for key, url in (("url", s.url), ("swarm_url", s.swarm_url)):
            if url is not None and not re.match(r"^https?://[^/\s]+", url):
                bad([*at, key], f"{url!r} is not an http(s) URL, e.g. http://host:8000"
                                f"{'/v1' if key == 'url' else ''}")
        if kind is ServerKind.EXTERNAL_OPENAI:
            if s.model is None:
                bad([*at, "model"], "an external OpenAI endpoint needs the model id to request, e.g."
                                    " model: Qwen/Qwen3-235B-A22B-Instruct-2507")
            if s.trainable:
                bad([*at, "trainable"], "an external OpenAI endpoint cannot be trained: set trainable: false, or run"
                                        " `marl serve` on that machine and give its swarm_url: instead of url:")
            if s.admin_token_env is not None:
                bad([*at, "admin_token_env"], "an external OpenAI endpoint has no admin token; for its API key use"
                                              " api_key_env:")
            if not s.url.rstrip("/").endswith("/v1"):
                warn([*at, "url"], f"{s.url!r} does not end in /v1; OpenAI base URLs usually do"
                                   " (e.g. http://host:8000/v1)")
        if kind is ServerKind.REMOTE_SWARM:
            if not s.trainable:
                bad([*at, "trainable"], "a remote swarm server is one you train: set trainable: true; for a frozen"
                                        " remote model give its OpenAI endpoint instead (url: http://host:port/v1"
                                        " and model:)")
            if s.api_key_env is not None:
                bad([*at, "api_key_env"], "a swarm server hands out a key per episode; api_key_env is for external"
                                          " OpenAI endpoints (url:). For its admin token use admin_token_env:")
            if s.swarm_url.rstrip("/").endswith("/v1"):
                warn([*at, "swarm_url"], "swarm_url is the server's root URL, not its OpenAI base URL: drop /v1")
        if kind in (ServerKind.LOCAL_TRAINABLE, ServerKind.LOCAL_STATIC):
            for key in ("api_key_env", "admin_token_env"):
                if getattr(s, key) is not None:
                    bad([*at, key], f"{key} only applies to remote servers (url: or swarm_url:); `marl run`"
                                    " makes its own tokens for the servers it starts: remove it")
        if s.trainable and s.train is None:
            bad([*at, "train"], "a trainable server needs its training config: add train: (a TrainConfig), e.g."
                                " train: {job: my-job, batch_size: 4, num_repeat: 4, learning_rate: 2.0e-5};"
                                " or set trainable: false")
        if not s.trainable and s.train is not None:
            bad([*at, "train"], "a static server does not train: remove train:, or set trainable: true")

    # -- roles -------------------------------------------------------------------------------------------
    used: dict[str, list[str]] = {name: [] for name in spec.servers}
    dangling = False  # a role names an unknown server: probably a typo of the server that looks unused
    for name, r in spec.roles.items():
        at = ["roles", name]
        if not NAME_RE.match(name):
            bad(at, f"bad role name {name!r}: {_NAME_RULE}")
        if r.team is not None and not NAME_RE.match(r.team):
            bad([*at, "team"], f"bad team name {r.team!r}: {_NAME_RULE}")
        if r.server is not None and r.scripted:
            bad(at, f"both server: {r.server} and scripted: true; a role is played by a model server or by the"
                    " env's scripted policy, not both: remove one")
        elif r.server is None and not r.scripted:
            bad(at, f"no one plays this role: set server: (one of: {known}) or scripted: true")
        elif r.server is not None:
            if r.server not in spec.servers:
                dangling = True
                bad([*at, "server"], f"unknown server {r.server!r}; known servers: {known}"
                                     f"{_did_you_mean(r.server, server_names)}")
            else:
                used[r.server].append(name)
    for name, s in spec.servers.items():
        if not used[name] and name not in broken and not dangling:
            if s.trainable:
                bad(["servers", name], "trainable server that no role uses: it would never get an episode, so"
                                       " run.max_steps could never be reached. Point a role at it"
                                       f" (roles.<role>.server: {name}) or remove it")
            else:
                warn(["servers", name], "no role uses this server" + (
                    "; `marl run` would start it for nothing" if s.is_local else ""))

    # -- run: repeats, stop condition ----------------------------------------------------------------------
    run = spec.run
    trainable = {n: s for n, s in spec.servers.items() if s.trainable and s.train is not None}
    if run.repeats is None:
        sizes = {s.train.num_repeat for s in trainable.values()}
        if len(sizes) > 1:
            first, *rest = trainable.items()
            for name, s in rest:
                if s.train.num_repeat != first[1].train.num_repeat:
                    bad(["servers", name, "train", "num_repeat"],
                        f"is {s.train.num_repeat} but servers.{first[0]}.train.num_repeat is"
                        f" {first[1].train.num_repeat}: a game plays one task on every trainable server at once, so"
                        " all trainable servers need the same GRPO group size (num_repeat); make them equal")
        else:
            run.repeats = sizes.pop() if sizes else 1
    else:
        wrong = [f"servers.{n}.train.num_repeat is {s.train.num_repeat}" for n, s in trainable.items()
                 if s.train.num_repeat != run.repeats]
        if wrong:
            bad(["run", "repeats"],
                f"is {run.repeats} but {', '.join(wrong)}: the coordinator plays run.repeats games of each task id,"
                " and a server trains on groups of num_repeat episodes of one task, so its groups would never fill"
                " (or would mix tasks). Make them equal (or drop run.repeats: it defaults to the servers'"
                " num_repeat)")
    if run.games is None and run.max_steps is None:
        bad(["run"], "the run never stops: set run.max_steps (training steps every trainable server must take)"
                     " or run.games (total games)")
    if run.max_steps is not None and not any(s.trainable for s in spec.servers.values()):
        bad(["run", "max_steps"], "no server is trainable, so no training step is ever taken: set run.games instead")
    if run.games is not None and run.repeats and run.games % run.repeats:
        warn(["run", "games"], f"{run.games} is not a multiple of run.repeats ({run.repeats}): the last task's"
                               " GRPO group will be incomplete")
    if run.run_dir is None:
        run.run_dir = Path("runs") / spec.name

    # -- env ---------------------------------------------------------------------------------------------
    env = spec.env
    if ":" not in env.class_path or not env.module or not env.qualname:
        guess = ""
        if ":" not in env.class_path and "." in env.class_path:
            head, _, tail = env.class_path.rpartition(".")
            guess = f"; did you mean '{head}:{tail}'?"
        bad(["env", "class"], f"{env.class_path!r} is not an import path 'module:Class'{guess}")
    elif check_env:
        try:
            cls = import_class(env.class_path)
        except ImportError as exc:
            bad(["env", "class"], f"{exc}. Fix env.class (an import path 'module:Class') or the module")
        else:
            try:
                params = inspect.signature(cls).parameters.values()
            except (TypeError, ValueError):
                params = None
            if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params):
                names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
                for key in env.args:
                    if key not in names:
                        bad(["env", "args", key],
                            f"{cls.__name__}() takes no argument {key!r}{_did_you_mean(key, names)};"
                            f" its arguments: {', '.join(names) or '(none)'}")
    return problems, warnings


# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------

_OVERRIDE_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


def _parse_overrides(overrides: Sequence[str], source: str | None) -> tuple[list[tuple[str, str]], list[DictConfig]]:
    parsed, configs, problems = [], [], []
    for text in overrides:
        key, eq, _value = text.partition("=")
        key = key.strip()
        if not eq:
            problems.append(Problem(key, "expected key=value, e.g. run.max_steps=5 (use key=null to clear a value)",
                                    f"override {text!r}"))
            continue
        if not _OVERRIDE_KEY_RE.match(key):
            problems.append(Problem(key, "bad key: a dotted path of YAML keys, e.g. servers.speaker_model.train."
                                         "learning_rate=1e-5", f"override {text!r}"))
            continue
        try:
            configs.append(OmegaConf.from_dotlist([text]))
        except (yaml.YAMLError, OmegaConfBaseException, ValueError) as exc:  # the value is not valid YAML
            problems.append(Problem(key, f"cannot parse the value: {str(exc).splitlines()[0]}; quote it or fix it",
                                    f"override {text!r}"))
            continue
        parsed.append((key, text))
    if problems:
        raise TopologyError(problems, source)
    return parsed, configs


def _resolve(cfg: DictConfig, locator: _Locator) -> dict[str, Any]:
    try:
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        key = str(getattr(exc, "full_key", "") or "")
        msg = str(exc).split("\n    full_key:")[0].strip()
        if "Missing mandatory value" in msg:
            msg = "value is ??? (mandatory): set it in the file or on the command line (key=value)"
        elif "Environment variable" in msg:
            msg += "; set it, or give a default: ${oc.env:VAR,default}"
        else:
            msg = f"cannot resolve the interpolation: {msg}"
        raise TopologyError([locator.problem(key.split(".") if key else [], msg)], locator.source) from exc
    return data  # type: ignore[return-value]


class Topology:
    """A validated topology: the typed spec, the role/server/team graph, and warnings.

    Graph nodes are "role:NAME", "server:NAME" and "team:NAME" (see `node`), each with attributes `kind` ("role",
    "server", "team") and `name`; role nodes also carry `count`, `scripted`, `team`; server nodes `server_kind`
    (a `ServerKind`), `trainable`, `model`. Edges: role → server (`kind="played_by"`), role → team
    (`kind="member_of"`). Scripted roles have no `played_by` edge.
    """

    def __init__(self, spec: TopologySpec, *, source: Path | None = None, overrides: Sequence[str] = (),
                 warnings: Sequence[Problem] = ()):
        self.spec = spec
        self.source = source
        self.overrides = list(overrides)
        self.warnings = list(warnings)
        self.graph = self._build_graph()

    # -- construction --------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike[str], overrides: Sequence[str] = (), *, check_env: bool = True) -> Topology:
        """Load a YAML topology, merge `key=value` overrides, validate. Raises `TopologyError`."""
        overrides = [overrides] if isinstance(overrides, str) else list(overrides)
        path = Path(path)
        source = str(path)
        if not path.is_file():
            hint = ""
            if path.is_dir():
                hint = "; it is a directory"
            else:
                near = [str(p) for p in sorted(path.parent.glob("*.y*ml"))] if path.parent.is_dir() else []
                near = near or [str(p) for p in sorted(Path("topologies").glob("*.y*ml"))]
                if near:
                    hint = f"; available: {', '.join(near)}{_did_you_mean(str(path), near)}"
            raise TopologyError([Problem("", f"no such topology file (working directory: {os.getcwd()}){hint}",
                                         source)], source)
        text = path.read_text(encoding="utf-8")
        locator = _Locator(source, text)
        try:
            cfg = OmegaConf.create(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
            where = f"{source}:{mark.line + 1}" if mark else source
            detail = " ".join(str(exc).split())
            raise TopologyError([Problem("", f"not valid YAML: {detail}", where)], source) from exc
        except OmegaConfBaseException as exc:
            raise TopologyError([Problem("", f"cannot load: {exc}", source)], source) from exc
        if not isinstance(cfg, DictConfig) or (len(cfg) == 0 and not overrides):
            raise TopologyError([Problem("", "a topology is a YAML mapping with servers:, roles:, env: and run:"
                                             " (see topologies/signalling-cpu.yaml)", source)], source)
        if "name" not in cfg:
            cfg.name = path.stem
        return cls._from_config(cfg, overrides, locator, check_env=check_env, source=path)

    @classmethod
    def from_dict(cls, data: dict[str, Any], overrides: Sequence[str] = (), *, check_env: bool = True) -> Topology:
        """Validate a topology given as a dict (same schema as the YAML; interpolations are resolved)."""
        overrides = [overrides] if isinstance(overrides, str) else list(overrides)
        if not isinstance(data, dict):
            raise TopologyError([Problem("", f"a topology is a mapping, not {type(data).__name__}")])
        try:
            cfg = OmegaConf.create(data)
        except OmegaConfBaseException as exc:
            raise TopologyError([Problem("", f"cannot read the topology: {exc}")]) from exc
        return cls._from_config(cfg, overrides, _Locator(None, None), check_env=check_env, source=None)

    @classmethod
    def _from_config(cls, cfg: DictConfig, overrides: Sequence[str], locator: _Locator, *, check_env: bool,
                     source: Path | None) -> Topology:
        src = locator.source
        parsed, configs = _parse_overrides(list(overrides), src)
        locator.overrides = parsed
        for (key, text), extra in zip(parsed, configs):
            try:
                cfg = OmegaConf.merge(cfg, extra)
            except OmegaConfBaseException as exc:
                raise TopologyError([Problem(key, f"cannot apply: {str(exc).splitlines()[0]}",
                                             f"override {text!r}")], src) from exc
        data = _resolve(cfg, locator)
        try:
            spec = TopologySpec.model_validate(data)
        except ValidationError as exc:
            raise TopologyError(_pydantic_problems(exc, locator), src) from exc
        problems, warnings = _check(spec, locator, check_env)
        if problems:
            raise TopologyError(problems, src)
        return cls(spec, source=source, overrides=list(overrides), warnings=warnings)

    def to_dict(self) -> dict[str, Any]:
        """The resolved topology as plain data (defaults filled in); `from_dict` accepts it back."""
        data = self.spec.model_dump(mode="json", by_alias=True)
        for name, server in self.spec.servers.items():  # keep the file's train keys only: the rest are defaults
            if server.train is not None:
                data["servers"][name]["train"] = server.train.model_dump(mode="json", exclude_unset=True)
        return data

    # -- the graph -----------------------------------------------------------------------------------------

    @staticmethod
    def node(kind: str, name: str) -> str:
        """Graph node id of a role, server or team: `Topology.node("role", "speaker") == "role:speaker"`."""
        return f"{kind}:{name}"

    def _build_graph(self) -> nx.DiGraph:
        g = nx.DiGraph(name=self.spec.name)
        for name, s in self.spec.servers.items():
            g.add_node(self.node("server", name), kind="server", name=name, server_kind=s.kind,
                       trainable=s.trainable, model=s.model)
        for name, r in self.spec.roles.items():
            team = r.team or name
            role = self.node("role", name)
            g.add_node(role, kind="role", name=name, count=r.count, scripted=r.scripted, team=team)
            if not g.has_node(self.node("team", team)):
                g.add_node(self.node("team", team), kind="team", name=team)
            g.add_edge(role, self.node("team", team), kind="member_of")
            if r.server is not None:
                g.add_edge(role, self.node("server", r.server), kind="played_by")
        return g

    def _names(self, kind: str) -> list[str]:
        return [d["name"] for _, d in self.graph.nodes(data=True) if d["kind"] == kind]

    def server_of(self, role: str) -> str | None:
        """The server that plays `role`; None for a scripted role."""
        node = self.node("role", role)
        if node not in self.graph:
            raise KeyError(f"unknown role {role!r}; roles: {', '.join(self.spec.roles)}")
        return next((self.graph.nodes[t]["name"] for t in self.graph.successors(node)
                     if self.graph.edges[node, t]["kind"] == "played_by"), None)

    def roles_of(self, server: str) -> list[str]:
        """The roles `server` plays, in file order."""
        node = self.node("server", server)
        if node not in self.graph:
            raise KeyError(f"unknown server {server!r}; servers: {', '.join(self.spec.servers)}")
        players = set(self.graph.predecessors(node))
        return [name for name in self.spec.roles if self.node("role", name) in players]

    def team_of(self, role: str) -> str:
        if role not in self.spec.roles:
            raise KeyError(f"unknown role {role!r}; roles: {', '.join(self.spec.roles)}")
        return self.spec.roles[role].team or role

    def teams(self) -> dict[str, list[str]]:
        """Team name -> its roles, in file order."""
        out: dict[str, list[str]] = {}
        for name in self.spec.roles:
            out.setdefault(self.team_of(name), []).append(name)
        return out

    def trainable_servers(self) -> list[str]:
        return [n for n, s in self.spec.servers.items() if s.trainable]

    def local_servers(self) -> list[str]:
        """Servers `marl run` starts itself (`marl serve`, with `--static` unless trainable)."""
        return [n for n, s in self.spec.servers.items() if s.is_local]

    def remote_servers(self) -> list[str]:
        """Servers someone else runs: remote swarm servers and external OpenAI endpoints."""
        return [n for n, s in self.spec.servers.items() if not s.is_local]

    def static_endpoints(self) -> list[str]:
        """Servers without leases or training, reached through one shared OpenAI endpoint: local static servers and
        external OpenAI endpoints."""
        return [n for n, s in self.spec.servers.items() if s.kind in (ServerKind.LOCAL_STATIC,
                                                                     ServerKind.EXTERNAL_OPENAI)]

    def scripted_roles(self) -> list[str]:
        return [n for n, r in self.spec.roles.items() if r.scripted]

    def env_class(self) -> type:
        """Import and return the env class (`env.class`). Raises `TopologyError` naming `env.class`."""
        try:
            return import_class(self.spec.env.class_path)
        except ImportError as exc:
            where = str(self.source) if self.source else ""
            raise TopologyError([Problem("env.class", str(exc), where)], where or None) from exc

    @property
    def name(self) -> str:
        return self.spec.name

    def __repr__(self) -> str:
        return (f"Topology({self.spec.name!r}, servers={list(self.spec.servers)}, roles={list(self.spec.roles)},"
                f" env={self.spec.env.class_path!r})")

    # -- display -------------------------------------------------------------------------------------------

    def tree(self) -> Tree:
        """A rich Tree of the topology: servers (kind, model, roles), scripted roles, teams, env, run."""
        from rich.text import Text
        from rich.tree import Tree

        spec = self.spec
        title = Text.assemble(("topology ", "bold"), (spec.name, "bold cyan"))
        if self.source:
            title.append(f"  ({self.source})", style="dim")
        root = Tree(title)
        if spec.description:
            root.add(Text(spec.description, style="italic"))

        servers = root.add(Text("servers", style="bold"))
        styles = {ServerKind.LOCAL_TRAINABLE: "green", ServerKind.LOCAL_STATIC: "blue",
                  ServerKind.REMOTE_SWARM: "magenta", ServerKind.EXTERNAL_OPENAI: "yellow"}
        for name, s in spec.servers.items():
            line = Text.assemble((name, "bold"), "  ", (s.kind.value, styles[s.kind]))
            if s.model:
                line.append(f"  model={s.model}")
            for key in ("url", "swarm_url", "device", "port", "prefix_cache_gb", "api_key_env", "admin_token_env"):
                value = getattr(s, key)
                if value is not None:
                    line.append(f"  {key}={value}", style="dim" if key.endswith("_env") else "")
            node = servers.add(line)
            if s.train is not None:
                set_keys = s.train.model_dump(exclude_unset=True)
                shown = " ".join(f"{k}={v}" for k, v in set_keys.items())
                node.add(Text.assemble(("train  ", "dim"), shown or "(all defaults)",
                                       (f"  num_repeat={s.train.num_repeat}" if "num_repeat" not in set_keys
                                        else "", "")))
            roles = self.roles_of(name)
            plays = ", ".join(f"{r} ×{spec.roles[r].count} (team {self.team_of(r)})" for r in roles)
            node.add(Text.assemble(("plays  ", "dim"), plays or ("(no role)", "red")))
        scripted = self.scripted_roles()
        if scripted:
            sub = root.add(Text("scripted roles (the env's rule-based policy)", style="bold"))
            for r in scripted:
                sub.add(f"{r} ×{spec.roles[r].count} (team {self.team_of(r)})")

        teams = root.add(Text("teams", style="bold"))
        for team, roles in self.teams().items():
            members = ", ".join(
                f"{r} ×{spec.roles[r].count} → {self.server_of(r) or 'scripted'}" for r in roles)
            teams.add(Text.assemble((team, "bold"), "  ", members))

        env = root.add(Text.assemble(("env  ", "bold"), spec.env.class_path))
        for key, value in spec.env.args.items():
            env.add(f"{key}={value}")

        run = spec.run
        values = {"games": run.games if run.games is not None else "until max_steps",
                  "max_steps": run.max_steps if run.max_steps is not None else "-",
                  "repeats": run.repeats, "concurrency": run.concurrency,
                  "per_server_concurrency": run.per_server_concurrency or "-",
                  "lease_timeout_s": run.lease_timeout_s, "seed": run.seed, "run_dir": run.run_dir}
        root.add(Text.assemble(("run  ", "bold"), "  ".join(f"{k}={v}" for k, v in values.items())))
        if self.overrides:
            root.add(Text.assemble(("overrides  ", "bold"), " ".join(self.overrides)))
        if self.warnings:
            warn = root.add(Text("warnings", style="bold yellow"))
            for w in self.warnings:
                warn.add(Text(str(w), style="yellow"))
        return root
