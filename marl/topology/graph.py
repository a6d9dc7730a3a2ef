"""`Topology`: a checked topology as a graph of roles, servers and teams, and the queries `marl run` asks of it.

    role ──played_by──► server          role ──member_of──► team          server ──past_of──► server

Role nodes carry the resolved `count` and `team`: the env's (`dealt_roles()`) when the env was checked at load,
else the YAML's (count 1 and team = the role's name when left out).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import networkx as nx

from envs.base import RoleInfo

from .importing import import_env_factory
from .load import read_dict, read_file
from .problems import Problem, TopologyError
from .spec import PastOfSpec, ServerKind, TopologySpec

#: Between a server's name and its policy's in a learner's name (server names hold no dots).
LEARNER_SEPARATOR = "."


class Topology:
    """A validated topology: the typed spec (`spec`), the role/server/team graph (`graph`), and `warnings`.

    Graph nodes are "role:NAME", "server:NAME" and "team:NAME" (see `node`), each with attributes `kind` ("role",
    "server", "team") and `name`; role nodes also carry `count`, `scripted`, `team`; server nodes `server_kind`
    (a `ServerKind`), `trainable`, `model`. Edges: role → server (`kind="played_by"`), role → team
    (`kind="member_of"`), a past_of server → the trainable server whose checkpoints it plays (`kind="past_of"`).
    Scripted roles have no `played_by` edge. Lists come in file order.
    """

    def __init__(self, spec: TopologySpec, *, source: Path | None = None, overrides: Sequence[str] = (),
                 warnings: Sequence[Problem] = (), dealt: dict[str, RoleInfo] | None = None):
        """`dealt`: the env's dealt roles, as checked at load (None: not checked; the YAML's count/team are used)."""
        self.spec = spec
        self.source = source
        self.overrides = list(overrides)
        self.warnings = list(warnings)
        self.env_checked = dealt is not None
        from_yaml = {name: RoleInfo(team=role.team or name, count=role.count or 1) for name, role in spec.roles.items()}
        self._dealt = {**from_yaml, **{name: info for name, info in (dealt or {}).items() if name in spec.roles}}
        self.graph = self._build_graph()

    # -- construction --------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike[str], overrides: Sequence[str] = (), *, check_env: bool = True) -> Topology:
        """Load a YAML topology, merge `key=value` overrides, validate. Raises `TopologyError` with every problem.

        `check_env`: import `env.class`, construct it with `env.args` and check `roles:` against its
        `dealt_roles()` (False: none of that, e.g. for an env not written yet).
        """
        overrides = [overrides] if isinstance(overrides, str) else list(overrides)
        path = Path(path)
        loaded = read_file(path, overrides, check_env=check_env)
        return cls(loaded.spec, source=path, overrides=overrides, warnings=loaded.warnings, dealt=loaded.dealt)

    @classmethod
    def from_dict(cls, data: dict[str, Any], overrides: Sequence[str] = (), *, check_env: bool = True) -> Topology:
        """Validate a topology given as a dict (same schema as the YAML; interpolations are resolved)."""
        overrides = [overrides] if isinstance(overrides, str) else list(overrides)
        loaded = read_dict(data, overrides, check_env=check_env)
        return cls(loaded.spec, overrides=overrides, warnings=loaded.warnings, dealt=loaded.dealt)

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
        for name, s in self.spec.servers.items():
            if s.past_of is not None:
                g.add_edge(self.node("server", name), self.node("server", s.past_of.server), kind="past_of")
        for name, r in self.spec.roles.items():
            info = self._dealt[name]
            role, team = self.node("role", name), self.node("team", info.team)
            g.add_node(role, kind="role", name=name, count=info.count, scripted=r.scripted, team=info.team)
            if team not in g:
                g.add_node(team, kind="team", name=info.team)
            g.add_edge(role, team, kind="member_of")
            if r.server is not None:
                g.add_edge(role, self.node("server", r.server), kind="played_by")
        return g

    def _role_node(self, role: str) -> str:
        node = self.node("role", role)
        if node not in self.graph:
            raise KeyError(f"unknown role {role!r}; roles: {', '.join(self.spec.roles)}")
        return node

    def _edge_target(self, node: str, kind: str) -> str | None:
        """The name of the node `node` points to by an edge of `kind` (None: no such edge)."""
        return next((self.graph.nodes[t]["name"] for t in self.graph.successors(node)
                     if self.graph.edges[node, t]["kind"] == kind), None)

    # -- roles ---------------------------------------------------------------------------------------------

    def players(self) -> dict[str, str | None]:
        """Role -> the server that plays it, None for a role scripted by the env; every role, in file order.

        The coordinator's seating plan: an agent dealt role R is played by `players()[R]`'s model, or by
        `env.scripted_action` when it is None.
        """
        return {name: self._edge_target(self.node("role", name), "played_by") for name in self.spec.roles}

    def server_of(self, role: str) -> str | None:
        """The server that plays `role`; None for a scripted role. KeyError for an unknown role."""
        return self._edge_target(self._role_node(role), "played_by")

    def team_of(self, role: str) -> str:
        """The team of `role` (its member_of edge): the env's team, or the YAML's when the env was not checked."""
        team = self._edge_target(self._role_node(role), "member_of")
        assert team is not None  # every role node has its member_of edge
        return team

    def teams(self) -> dict[str, list[str]]:
        """Team name -> its roles, in file order."""
        out: dict[str, list[str]] = {}
        for name in self.spec.roles:
            out.setdefault(self.team_of(name), []).append(name)
        return out

    def scripted_roles(self) -> list[str]:
        """Roles the env plays itself (`scripted: true`): `env.scripted_action` moves for their agents."""
        return [name for name, server in self.players().items() if server is None]

    def dealt_roles(self) -> dict[str, RoleInfo]:
        """Role -> RoleInfo(team, count) of every role a game deals, in file order.

        From the env's `dealt_roles()` when the env was checked at load (the default), so the coordinator and the
        CLI need not construct the env again; else from the YAML (`count` default 1, `team` default the role name).
        """
        return {name: self._dealt[name] for name in self.spec.roles}

    # -- servers -------------------------------------------------------------------------------------------

    def roles_of(self, server: str) -> list[str]:
        """The roles `server` plays, in file order. KeyError for an unknown server."""
        node = self.node("server", server)
        if node not in self.graph:
            raise KeyError(f"unknown server {server!r}; servers: {', '.join(self.spec.servers)}")
        players = set(self.graph.predecessors(node))
        return [name for name in self.spec.roles if self.node("role", name) in players]

    def linked_servers(self) -> list[str]:
        """The trainable servers that play at least one role, in file order: every game begins an episode on each
        of them and commits it with the rewards of the roles it plays (the servers a game's transaction links).

        At load every trainable server plays a role (else the topology is refused), so this equals
        `trainable_servers()` for a loaded topology; it is read from the graph (trainable server nodes reachable
        from a role node by a played_by edge).
        """
        linked = {t for _, t, kind in self.graph.edges(data="kind") if kind == "played_by"}
        return [name for name in self.trainable_servers() if self.node("server", name) in linked]

    # -- learners: who trains on a role's episodes --------------------------------------------------------------

    def learners(self) -> dict[str, tuple[str, str | None]]:
        """Learner name -> (server, policy), in file order. A trainable server without `policies:` is one learner,
        named after it (policy None); each LoRA policy of a server is one, named `server.policy`. The coordinator
        leases, commits and watches learners: a policy is to it what a server of its own is."""
        out: dict[str, tuple[str, str | None]] = {}
        for name in self.trainable_servers():
            policies = self.spec.servers[name].policies
            out.update({f"{name}{LEARNER_SEPARATOR}{p}": (name, p) for p in policies} if policies
                       else {name: (name, None)})  # fmt: skip
        return out

    def learner_of(self, role: str) -> str | None:
        """The learner that trains on `role`'s episodes: its server, or `server.policy`; for a role of a static
        server, that server; None for a scripted role."""
        server = self.server_of(role)
        policies = self.spec.servers[server].policies if server is not None else None
        if not policies:
            return server
        policy = self.spec.roles[role].policy or next(iter(policies))
        return f"{server}{LEARNER_SEPARATOR}{policy}"

    def role_learners(self) -> dict[str, str | None]:
        """`players()` with learners: role -> who the coordinator leases for it (the seating plan of `marl run`)."""
        return {name: self.learner_of(name) for name in self.spec.roles}

    def linked_learners(self) -> list[str]:
        """The learners that play at least one role: `linked_servers()`, each server of policies as its policies."""
        played = set(self.role_learners().values())
        return [name for name, (server, _) in self.learners().items()
                if name in played and server in self.linked_servers()]  # fmt: skip

    def trainable_servers(self) -> list[str]:
        """Servers that train (local trainable and remote swarm servers)."""
        return [n for n, s in self.spec.servers.items() if s.trainable]

    def local_servers(self) -> list[str]:
        """Servers `marl run` starts itself as one `marl serve` each (with `--static` unless trainable); past_of
        servers, started one process per snapshot by `marl.league`, are `past_of_servers()`."""
        return [n for n, s in self.spec.servers.items() if s.is_local and s.past_of is None]

    def past_of_servers(self) -> dict[str, PastOfSpec]:
        """Servers that play past checkpoints of a trainable server -> which (see marl/league/__init__.py)."""
        return {n: s.past_of for n, s in self.spec.servers.items() if s.past_of is not None}

    def remote_servers(self) -> list[str]:
        """Servers someone else runs: remote swarm servers and external OpenAI endpoints."""
        return [n for n, s in self.spec.servers.items() if not s.is_local]

    def static_endpoints(self) -> list[str]:
        """Servers without leases or training, reached through one shared OpenAI endpoint: local static servers and
        external OpenAI endpoints."""
        return [n for n, s in self.spec.servers.items() if s.kind in (ServerKind.LOCAL_STATIC,
                                                                     ServerKind.EXTERNAL_OPENAI)]

    # -- the env -------------------------------------------------------------------------------------------

    def env_class(self) -> Callable[..., Any]:
        """Import and return what `env.class` names: the env class, or a factory function that returns the env.

        Either is called the same way: `topology.env_class()(**topology.spec.env.args)` (or `make_env()`).
        Raises `TopologyError` naming `env.class`.
        """
        try:
            return import_env_factory(self.spec.env.class_path)
        except ImportError as exc:
            where = str(self.source) if self.source else ""
            raise TopologyError([Problem("env.class", str(exc), where)], where or None) from exc

    def make_env(self) -> Any:
        """A new env: `env.class` called with `env.args` (a `GameEnv`; checked at load unless `check_env=False`)."""
        return self.env_class()(**self.spec.env.args)

    @property
    def name(self) -> str:
        return self.spec.name

    def __repr__(self) -> str:
        return (f"Topology({self.spec.name!r}, servers={list(self.spec.servers)}, roles={list(self.spec.roles)},"
                f" env={self.spec.env.class_path!r})")
