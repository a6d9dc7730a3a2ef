"""The env against the topology, at load: `env.class` is imported, called with `env.args`, and the roles it deals
(`dealt_roles()`, the `GameEnv` contract of envs/base.py) are compared with `roles:`.

- `env.args` are keyword arguments: a key the class or factory does not take is an error at `env.args.<key>`
  (unless it takes `**kwargs`); an exception from the constructor is an error at `env.args`, or, when it names the
  argument it refuses (an `arg` attribute: `envs.textarena_env.GameRefused`), at `env.args.<arg>` (a TextArena
  game id at `env.textarena`, an OpenSpiel game at `env.openspiel`).
- Every role the env deals needs a player in `roles:` (error at `roles`), and every role in `roles:` must be one the
  env deals (error at `roles.<name>`): a server whose roles are never dealt would never play.
- `roles.<name>.count` and `.team` may be left out (the env's are taken); given, they must equal the env's.
- Not checked: that a scripted role's turns have a scripted action. The base `scripted_action` picks the first
  option, and raises NotImplementedError on a free-text turn, which only a game can reveal (docs/envs.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from envs.base import GameEnv, RoleInfo

from .checks import Findings
from .importing import import_env_factory
from .problems import did_you_mean, short
from .spec import EnvSpec, TopologySpec

#: What the coordinator calls on an env (the members of `GameEnv`).
GAME_ENV_MEMBERS = tuple(sorted({*GameEnv.__annotations__, *(n for n in vars(GameEnv) if not n.startswith("_"))}))


def check_env(spec: TopologySpec, findings: Findings) -> dict[str, RoleInfo] | None:
    """Check the env against `spec`; returns the roles it deals, in `roles:` order (None if it could not be asked)."""
    dealt = check_env_alone(spec.env, findings)
    if dealt is None:
        return None
    compare_roles(spec, dealt, findings)
    return {name: dealt[name] for name in spec.roles if name in dealt}


def check_env_alone(env_spec: EnvSpec, findings: Findings) -> dict[str, RoleInfo] | None:
    """The env on its own: it imports, takes `env.args`, constructs and deals roles; returns the roles it deals
    (None if it could not be asked). Needs no other section: a topology whose servers do not validate still gets
    its env checked (`load.py`)."""
    try:
        factory = import_env_factory(env_spec.class_path)
    except ImportError as exc:
        findings.bad(["env", "class"], f"{exc}. Fix env.class (an import path 'module:Class' or 'module:factory')"
                                       " or the module")
        return None
    if not check_env_args(factory, env_spec, findings):
        return None
    env = _construct(factory, env_spec, findings)
    if env is None:
        return None
    try:
        return _dealt_roles(env, findings)
    finally:
        _close(env)


def check_env_args(factory: Callable[..., Any], env_spec: EnvSpec, findings: Findings) -> bool:
    """`env.args` against the signature of the class or factory; False if one is not taken."""
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): the call will tell
        return True
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return True
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [key for key in env_spec.args if key not in names]
    for key in unknown:
        findings.bad(["env", "args", key], f"{_name(factory)}() takes no argument {key!r}{did_you_mean(key, names)};"
                                           f" its arguments: {', '.join(names) or '(none)'}")
    return not unknown


def _construct(factory: Callable[..., Any], env_spec: EnvSpec, findings: Findings) -> Any:
    call = f"{_name(factory)}({', '.join(f'{k}={short(v, 30)}' for k, v in env_spec.args.items())})"
    try:
        env = factory(**env_spec.args)
    except Exception as exc:  # noqa: BLE001 - any constructor error is the topology's problem to report
        if isinstance(arg := getattr(exc, "arg", None), str):  # an env's refusal that names its argument (GameRefused)
            findings.bad(_refused_key(env_spec, arg), str(exc))
        else:
            findings.bad(["env", "args"], f"constructing the env failed: {call} raised {type(exc).__name__}: {exc}")
        return None
    # Properties are looked up on the class: they may need reset() first (TextAECEnv.replies_by_role does).
    missing = [name for name in GAME_ENV_MEMBERS if not (hasattr(type(env), name) or hasattr(env, name))]
    if missing:
        what = "None" if env is None else f"a {type(env).__name__}, which lacks {', '.join(missing)}"
        findings.bad(["env", "class"], f"{call} returned {what}: not an env marl can play (envs.base.GameEnv);"
                                       " subclass envs.base.TextAECEnv or wrap a PettingZoo env in"
                                       " envs.adapter.TextAdapter (docs/envs.md)")
        return None
    return env


def _refused_key(env_spec: EnvSpec, arg: str) -> list[str]:
    """Where an env's refusal of one argument is reported: `env.textarena` (`env.openspiel`) for the game of a
    TextArena (OpenSpiel) env, named there, else `env.args.<arg>`."""
    if arg == "game" and env_spec.suite is not None:
        return ["env", env_spec.suite]
    return ["env", "args", arg]


def _dealt_roles(env: Any, findings: Findings) -> dict[str, RoleInfo] | None:
    """The env's `dealt_roles()` as RoleInfo values; None (and a problem at env.class) if it cannot say."""
    try:
        dealt = env.dealt_roles()
        if not isinstance(dealt, Mapping) or not dealt:
            raise TypeError(f"expected a non-empty dict role -> RoleInfo(team, count), got {short(dealt)}")
        return {str(role): RoleInfo(team=str(info.team), count=int(info.count)) for role, info in dealt.items()}
    except Exception as exc:  # noqa: BLE001 - the env's bug, reported where the env is named
        findings.bad(["env", "class"], f"{type(env).__name__}.dealt_roles() failed: {type(exc).__name__}: {exc};"
                                       " it must work before reset() and return {role: RoleInfo(team, count)}")
        return None


def compare_roles(spec: TopologySpec, dealt: Mapping[str, RoleInfo], findings: Findings) -> None:
    """`roles:` against the roles the env deals: the same names, and count/team (when given) the env's."""
    env = spec.env.qualname
    for role, info in dealt.items():
        if role not in spec.roles:
            findings.bad(["roles"], f"{env} deals role {role!r} ({info.count} × team {info.team}) but no one plays"
                                    f" it: add roles.{role} with server: (a model) or scripted: true")
    for name, role in spec.roles.items():
        info = dealt.get(name)
        if info is None:
            findings.bad(["roles", name], f"{env} never deals role {name!r}{did_you_mean(name, dealt)}: it deals"
                                          f" {', '.join(dealt)}{_never_plays(spec, name, dealt)}. Use one of those"
                                          " role names, or remove this role")
            continue
        if role.count is not None and role.count != info.count:
            findings.bad(["roles", name, "count"], f"is {role.count} but {env} deals {info.count} {name}: set count:"
                                                   f" {info.count}, or leave count out (the env's is taken)")
        if role.team is not None and role.team != info.team:
            findings.bad(["roles", name, "team"], f"is {role.team!r} but {env} puts {name} in team {info.team!r}:"
                                                  f" set team: {info.team}, or leave team out (the env's is taken)")


def _never_plays(spec: TopologySpec, role: str, dealt: Mapping[str, RoleInfo]) -> str:
    """", so servers.X would never get an episode" when `role` was a trainable server's only dealt hope."""
    server = spec.roles[role].server
    if server is None or server not in spec.servers or not spec.servers[server].trainable:
        return ""
    if any(r.server == server and name in dealt for name, r in spec.roles.items()):
        return ""
    return f"; servers.{server} plays no role the env deals, so it would never get an episode"


def _name(factory: Callable[..., Any]) -> str:
    return getattr(factory, "__qualname__", None) or getattr(factory, "__name__", None) or repr(factory)


def _close(env: Any) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 - the env was only asked for its roles
        pass
