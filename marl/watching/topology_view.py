"""`marl topology show`: a topology as a rich Tree (servers and their models' shapes, scripted roles, teams, env,
run, warnings)."""

from __future__ import annotations

from rich.text import Text
from rich.tree import Tree

from marl.plan import UnknownModel, architecture_of
from marl.topology import ServerKind, ServerSpec, Topology

_KIND_STYLES = {ServerKind.LOCAL_TRAINABLE: "green", ServerKind.LOCAL_STATIC: "blue",
                ServerKind.REMOTE_SWARM: "magenta", ServerKind.EXTERNAL_OPENAI: "yellow",
                ServerKind.PAST_SNAPSHOTS: "cyan"}
_SERVER_KEYS = ("revision", "url", "swarm_url", "device", "port", "prefix_cache_gb", "engine", "api_key_env",
                "admin_token_env")


def topology_tree(topology: Topology) -> Tree:
    """The whole topology, one branch per section."""
    spec = topology.spec
    title = Text.assemble(("topology ", "bold"), (spec.name, "bold cyan"))
    if topology.source:
        title.append(f"  ({topology.source})", style="dim")
    root = Tree(title)
    if spec.description:
        root.add(Text(spec.description, style="italic"))
    _add_servers(root, topology)
    _add_scripted(root, topology)
    _add_teams(root, topology)
    env = root.add(Text.assemble(("env  ", "bold"), spec.env.class_path))
    for key, value in spec.env.args.items():
        env.add(f"{key}={value}")
    _add_run(root, topology)
    if topology.overrides:
        root.add(Text.assemble(("overrides  ", "bold"), " ".join(topology.overrides)))
    if topology.warnings:
        warn = root.add(Text("warnings", style="bold yellow"))
        for w in topology.warnings:
            warn.add(Text(str(w), style="yellow"))
    return root


def _role_line(topology: Topology, role: str) -> str:
    policy = topology.spec.roles[role].policy
    played = f", policy {policy}" if policy else ""
    return f"{role} ×{topology.dealt_roles()[role].count} (team {topology.team_of(role)}{played})"


def _add_servers(root: Tree, topology: Topology) -> None:
    servers = root.add(Text("servers", style="bold"))
    for name, s in topology.spec.servers.items():
        line = Text.assemble((name, "bold"), "  ", (s.kind.value, _KIND_STYLES[s.kind]))
        if s.model:
            line.append(f"  model={s.model}")
        if s.past_of:
            source = s.past_of.server + (f".{s.past_of.policy}" if s.past_of.policy else "")
            line.append(f"  past_of={source} pool={s.past_of.pool} k={s.past_of.k}")
        for key in _SERVER_KEYS:
            value = getattr(s, key)
            if value is not None:
                line.append(f"  {key}={value}", style="dim" if key.endswith("_env") else "")
        node = servers.add(line)
        shape = _shape(s)
        if shape is not None:
            node.add(shape)
        if s.train is not None:
            set_keys = s.train.model_dump(exclude_unset=True)
            shown = " ".join(f"{k}={v}" for k, v in set_keys.items())
            node.add(Text.assemble(("train  ", "dim"), shown or "(all defaults)",
                                   (f"  num_repeat={s.train.num_repeat}" if "num_repeat" not in set_keys else "", "")))
        for policy, spec in (s.policies or {}).items():
            lora = spec.lora
            changes = " ".join(f"{k}={v}" for k, v in spec.train.items())
            node.add(Text.assemble(("policy  ", "dim"), (policy, "bold"), f"  LoRA rank={lora.rank}"
                                   f" alpha={lora.alpha:g}", f"  train {changes}" if changes else ""))
        plays = ", ".join(_role_line(topology, r) for r in topology.roles_of(name))
        node.add(Text.assemble(("plays  ", "dim"), plays or ("(no role)", "red")))


def _shape(server: ServerSpec) -> Text | None:
    """The model's shape, from its config.json (a directory, or a Hugging Face id's from the cache or the Hub) or
    marl's table of well-known models; why it is unknown for a server `marl run` starts, None for another one."""
    if server.model is None:
        return None
    try:
        arch = architecture_of(server.model, revision=server.revision)
    except UnknownModel as exc:
        return Text.assemble(("shape  ", "dim"), (str(exc), "yellow")) if server.is_local else None
    heads = f"{arch.num_heads} heads" + (f" ({arch.num_kv_heads} KV)" if arch.num_kv_heads != arch.num_heads else "")
    experts = f", {arch.num_experts} experts ({arch.experts_per_token} per token)" if arch.num_experts else ""
    params = arch.parameter_count()
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    return Text.assemble(("shape  ", "dim"), f"{arch.num_layers} layers, {heads}, hidden {arch.hidden_size}, vocab"
                         f" {arch.vocab_size}, context {arch.context_length}{experts}, {size} parameters")


def _add_scripted(root: Tree, topology: Topology) -> None:
    scripted = topology.scripted_roles()
    if scripted:
        sub = root.add(Text("scripted roles (the env's rule-based policy)", style="bold"))
        for role in scripted:
            sub.add(_role_line(topology, role))


def _add_teams(root: Tree, topology: Topology) -> None:
    source = "as the env deals them" if topology.env_checked else "from the file: env not checked"
    teams = root.add(Text.assemble(("teams", "bold"), (f"  ({source})", "dim")))
    dealt = topology.dealt_roles()
    for team, roles in topology.teams().items():
        members = ", ".join(f"{r} ×{dealt[r].count} → {topology.learner_of(r) or 'scripted'}" for r in roles)
        teams.add(Text.assemble((team, "bold"), "  ", members))


def _add_run(root: Tree, topology: Topology) -> None:
    run = topology.spec.run
    values = {"games": run.games if run.games is not None else "until max_steps",
              "max_steps": run.max_steps if run.max_steps is not None else "-",
              "repeats": run.repeats, "concurrency": run.concurrency,
              "per_server_concurrency": run.per_server_concurrency or "-",
              "lease_timeout_s": run.lease_timeout_s, "seed": run.seed, "run_dir": run.run_dir,
              "eval_every": run.eval_every or "-", "transcripts": run.transcripts}
    root.add(Text.assemble(("run  ", "bold"), "  ".join(f"{k}={v}" for k, v in values.items())))
