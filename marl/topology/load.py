"""Reading a topology: YAML with omegaconf (`${name}` and `${oc.env:VAR,default}` interpolations), `key=value`
dotlist overrides merged on top, pydantic validation, the consistency checks and, with `check_env`, the checks
against this machine: the env's, and that every local server's model is here (a directory or an alias).

Every problem found is reported at once in one `TopologyError`; each names its YAML key as a dotted path
(`roles.listener.server`), says what is wrong and how to fix it, and where it is: `file:line` or the override
that set it. `name` defaults to the file's stem.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import ValidationError

from envs.base import RoleInfo

from .checks import Findings, check_local_models, check_spec
from .env_contract import check_env as check_env_contract
from .env_contract import check_env_alone
from .locate import Locator, pydantic_problems
from .problems import Problem, TopologyError, did_you_mean
from .spec import EnvSpec, TopologySpec

_OVERRIDE_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


@dataclass
class Loaded:
    """A checked spec and what the checks learnt: warnings, and the env's dealt roles (None: env not checked)."""

    spec: TopologySpec
    warnings: list[Problem]
    dealt: dict[str, RoleInfo] | None


def read_file(path: Path, overrides: Sequence[str], *, check_env: bool) -> Loaded:
    """Load and check the topology file at `path`. Raises `TopologyError`."""
    source = str(path)
    if not path.is_file():
        raise TopologyError([Problem("", f"no such topology file (working directory: {os.getcwd()})"
                                         f"{_missing_file_hint(path)}", source)], source)
    text = path.read_text(encoding="utf-8")
    try:
        cfg = OmegaConf.create(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise TopologyError([Problem("", f"not valid YAML: {' '.join(str(exc).split())}", where)], source) from exc
    except OmegaConfBaseException as exc:
        raise TopologyError([Problem("", f"cannot load: {exc}", source)], source) from exc
    if not isinstance(cfg, DictConfig) or (len(cfg) == 0 and not overrides):
        raise TopologyError([Problem("", "a topology is a YAML mapping with servers:, roles:, env: and run:"
                                         " (see topologies/signalling-cpu.yaml)", source)], source)
    if "name" not in cfg:
        cfg.name = path.stem
    return check_config(cfg, overrides, Locator(source, text), check_env=check_env)


def _missing_file_hint(path: Path) -> str:
    if path.is_dir():
        return "; it is a directory"
    near = [str(p) for p in sorted(path.parent.glob("*.y*ml"))] if path.parent.is_dir() else []
    near = near or [str(p) for p in sorted(Path("topologies").glob("*.y*ml"))]
    return f"; available: {', '.join(near)}{did_you_mean(str(path), near)}" if near else ""


def read_dict(data: dict[str, Any], overrides: Sequence[str], *, check_env: bool) -> Loaded:
    """Check a topology given as a dict (same schema as the YAML; interpolations are resolved)."""
    if not isinstance(data, dict):
        raise TopologyError([Problem("", f"a topology is a mapping, not {type(data).__name__}")])
    try:
        cfg = OmegaConf.create(data)
    except OmegaConfBaseException as exc:
        raise TopologyError([Problem("", f"cannot read the topology: {exc}")]) from exc
    return check_config(cfg, overrides, Locator(None, None), check_env=check_env)


def check_config(cfg: DictConfig, overrides: Sequence[str], locator: Locator, *, check_env: bool) -> Loaded:
    """Merge the overrides, resolve, validate and check. Raises `TopologyError` with every problem found."""
    src = locator.source
    parsed, configs = _parse_overrides(overrides, src)
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
        problems = pydantic_problems(exc, locator)
        if check_env:
            problems += _env_alone_problems(data, problems, locator)
        raise TopologyError(problems, src) from exc
    findings = Findings(locator)
    check_spec(spec, findings)
    dealt = None
    if check_env:  # against this machine: the env imports and deals the roles, the local models are here
        dealt = check_env_contract(spec, findings)
        check_local_models(spec, findings)
    if findings.problems:
        raise TopologyError(findings.problems, src)
    return Loaded(spec, findings.warnings, dealt)


def _env_alone_problems(data: dict[str, Any], found: list[Problem], locator: Locator) -> list[Problem]:
    """The env's own problems (it imports, takes its args, deals roles) in a topology whose other sections do not
    validate: they do not depend on those sections, so they are reported with theirs (a misspelt game id beside a
    server without train:), not after those are fixed. Nothing when the env section itself is invalid."""
    if any(problem.key == "env" or problem.key.startswith("env.") for problem in found):
        return []
    try:
        env = EnvSpec.model_validate(data.get("env"))
    except ValidationError:
        return []
    findings = Findings(locator)
    check_env_alone(env, findings)
    return findings.problems


def _parse_overrides(overrides: Sequence[str], source: str | None) -> tuple[list[tuple[str, str]], list[DictConfig]]:
    """(key, text) of each `key=value` override and its config; every malformed one is a problem."""
    parsed, configs, problems = [], [], []
    for text in overrides:
        key, eq, _value = text.partition("=")
        key = key.strip()
        where = f"override {text!r}"
        if not eq:
            problems.append(Problem(key, "expected key=value, e.g. run.max_steps=5 (use key=null to clear a value)",
                                    where))
            continue
        if not _OVERRIDE_KEY_RE.match(key):
            problems.append(Problem(key, "bad key: a dotted path of YAML keys, e.g. servers.speaker_model.train."
                                         "learning_rate=1e-5", where))
            continue
        try:
            configs.append(OmegaConf.from_dotlist([text]))
        except (yaml.YAMLError, OmegaConfBaseException, ValueError) as exc:  # the value is not valid YAML
            problems.append(Problem(key, f"cannot parse the value: {str(exc).splitlines()[0]}; quote it or fix it",
                                    where))
            continue
        parsed.append((key, text))
    if problems:
        raise TopologyError(problems, source)
    return parsed, configs


def _resolve(cfg: DictConfig, locator: Locator) -> dict[str, Any]:
    """The config as plain data, interpolations resolved; an unresolvable one is a problem at its key."""
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
