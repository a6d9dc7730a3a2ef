"""Consistency checks across the objects of a valid spec: names, who plays each role, run.repeats against the
servers' GRPO group sizes, the stop condition. Each check is a function `(spec, findings)`; `check_spec` runs them all.

Decisions (also in the messages):
- A trainable server that no role uses is an error: it would never get an episode, so `run.max_steps` (every
  trainable server has taken that many steps) could never be reached. A static server no role uses is a warning.
- `run.repeats` (games played per task id) must equal every trainable server's `train.num_repeat` (its GRPO group
  size); left out, it is taken from them (they must then agree), or 1 when nothing is trainable.
- `run.run_dir` defaults to `runs/<name>`.
- A `past_of` server plays the checkpoints a local trainable server writes into the run directory: its `server`
  must be one (a remote swarm server keeps its checkpoints on its own machine). One that never checkpoints
  (`save_freq: 0`) leaves only the initial model to play: a warning. Of a server of LoRA policies it plays one
  policy (`policy:`, required there and refused elsewhere), whose snapshots that server serves itself.
- `run.eval_every` evaluates checkpoints too: every trainable server must be local and save checkpoints.
- Under `run.ray`, a local server sees only the GPUs its actor asks for (`resources: {GPU: n}`; none without it):
  `device: cuda` needs some, and its `placement` GPUs index those n.
- Trainer ranks on several machines are Ray actors (`placement.nodes` > 1 needs `run.ray`); under `run.ray` each
  rank has its own bundle (`rank_resources`, GPU included), so `placement.trainer_gpus` of an FSDP trainer is refused;
  so has each vLLM replica after the first (`replica_resources`), so `placement.engine_gpus` is refused there.
- A local server's model is a directory on this machine, an alias or a Hugging Face id, in the Hugging Face cache
  when HF_HUB_OFFLINE=1 (`check_local_models`; the Hub is not asked): checked where the topology is checked against
  this machine (`check_env`: `marl topology show`, `marl run`), not by `marl plan`,
  which sizes a topology meant for other machines.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from huggingface_hub import is_offline_mode

from marl.protocol import MODEL_ALIASES
from marl.topology.hub_config import HubConfigError, hub_config, is_hub_id

from .bundles import RayBundles, on_gpus, ray_bundles, server_ranks
from .locate import Locator
from .problems import Problem, did_you_mean
from .spec import NAME_RE, NAME_RULE, PastOfSpec, ServerKind, ServerSpec, TopologySpec


class Findings:
    """The problems (errors) and warnings found so far, each located by the `Locator`."""

    def __init__(self, locator: Locator):
        self.locator = locator
        self.problems: list[Problem] = []
        self.warnings: list[Problem] = []

    def bad(self, parts: Sequence[Any], message: str) -> None:
        self.problems.append(self.locator.problem(parts, message))

    def warn(self, parts: Sequence[Any], message: str) -> None:
        self.warnings.append(self.locator.problem(parts, message))


def check_spec(spec: TopologySpec, findings: Findings) -> None:
    """Run every check; fills in the defaults of `run.repeats` and `run.run_dir`."""
    for check in (check_names, check_role_players, check_role_policies, check_unused_servers, check_repeats, check_stop,
                  check_urls, check_past_of, check_eval_every, check_ray_gpus, check_ray_ranks,
                  check_trainer_sections):
        check(spec, findings)
    if spec.run.run_dir is None:
        spec.run.run_dir = Path("runs") / spec.name


def check_names(spec: TopologySpec, findings: Findings) -> None:
    """Server and role names become agent tags, directory names and dotlist keys."""
    for kind, names in (("server", spec.servers), ("role", spec.roles)):
        for name in names:
            if not NAME_RE.match(name):
                findings.bad([f"{kind}s", name], f"bad {kind} name {name!r}: {NAME_RULE}")


def _known_servers(spec: TopologySpec) -> str:
    return ", ".join(spec.servers) if spec.servers else "(none: add one under servers:)"


def check_role_players(spec: TopologySpec, findings: Findings) -> None:
    """Every role is played by a known server or by the env's script."""
    for name, role in spec.roles.items():
        if role.server is None and not role.scripted:
            findings.bad(["roles", name], f"no one plays this role: set server: (one of: {_known_servers(spec)})"
                                          " or scripted: true")
        elif role.server is not None and role.server not in spec.servers:
            findings.bad(["roles", name, "server"], f"unknown server {role.server!r}; known servers:"
                                                    f" {_known_servers(spec)}{did_you_mean(role.server, spec.servers)}")


def check_role_policies(spec: TopologySpec, findings: Findings) -> None:
    """A role of a server with LoRA policies plays one of them (named, where there are several); every policy is
    played (else it never gets an episode); a policy keeps its server's group size (a game fills every group)."""
    played: dict[str, set[str]] = {}
    for name, role in spec.roles.items():
        server = spec.servers.get(role.server) if role.server else None
        if server is None:
            continue
        policies = server.policies or {}
        if role.policy is not None and not policies:
            findings.bad(["roles", name, "policy"], f"servers.{role.server} trains one full-weight model, no"
                                                    f" policies: remove policy, or add servers.{role.server}.policies")
        elif role.policy is not None and role.policy not in policies:
            findings.bad(["roles", name, "policy"], f"unknown policy {role.policy!r} of servers.{role.server};"
                                                    f" its policies: {', '.join(policies)}"
                                                    f"{did_you_mean(role.policy, policies)}")
        elif role.policy is None and len(policies) > 1:
            findings.bad(["roles", name], f"servers.{role.server} trains {len(policies)} policies"
                                          f" ({', '.join(policies)}): name this role's with policy:")
        elif policies:
            played.setdefault(role.server, set()).add(role.policy or next(iter(policies)))
    for server_name, server in spec.servers.items():
        for policy in (server.policies or {}) if server_name in played else ():
            if policy not in played[server_name]:
                findings.bad(["servers", server_name, "policies", policy], "no role plays this policy: it would"
                             " never get an episode, so run.max_steps could never be reached. Point a role at it"
                             f" (roles.<role>.policy: {policy}) or remove it")
            elif "num_repeat" in server.policies[policy].train:
                findings.bad(["servers", server_name, "policies", policy, "train", "num_repeat"],
                             "a game plays one task for every policy at once: policies keep their server's"
                             " num_repeat (set it in the server's train:)")


def check_unused_servers(spec: TopologySpec, findings: Findings) -> None:
    """A trainable server no role uses would never get an episode (error); an unused static one is a warning."""
    played = {role.server for role in spec.roles.values()}
    if any(server is not None and server not in spec.servers for server in played):
        return  # a role names an unknown server: probably a typo of the server that looks unused
    for name, server in spec.servers.items():
        if name in played:
            continue
        if server.trainable:
            findings.bad(["servers", name], "trainable server that no role uses: it would never get an episode, so"
                                            " run.max_steps could never be reached. Point a role at it"
                                            f" (roles.<role>.server: {name}) or remove it")
        else:
            findings.warn(["servers", name], "no role uses this server" + (
                "; `marl run` would start it for nothing" if server.is_local else ""))


def check_trainer_sections(spec: TopologySpec, findings: Findings) -> None:
    """A train: section of a trainer the server does not run (`grpo:` under `trainer: fsdp`) is ignored: say so,
    since its knobs look as if they applied."""
    for name, server in spec.servers.items():
        if server.train is None:
            continue
        learners = [(["servers", name, "train"], server.train.trainer, server.train.model_fields_set)]
        learners += [(["servers", name, "policies", policy, "train"], server.train.trainer, set(p.train))
                     for policy, p in (server.policies or {}).items()]  # policies share the server's trainer
        for where, trainer, sections in learners:
            for section in sorted({"grpo", "fsdp"} & sections - {trainer}):
                findings.warn([*where, section], f"ignored: trainer is {trainer}, whose knobs are under"
                                                 f" train.{trainer}; move them there or remove {section}:")


def check_repeats(spec: TopologySpec, findings: Findings) -> None:
    """run.repeats = every trainable server's num_repeat; left out, taken from them (or 1)."""
    run = spec.run
    trainable = {n: s.train for n, s in spec.servers.items() if s.trainable and s.train is not None}
    if run.repeats is not None:
        wrong = [f"servers.{n}.train.num_repeat is {t.num_repeat}" for n, t in trainable.items()
                 if t.num_repeat != run.repeats]
        if wrong:
            findings.bad(["run", "repeats"],
                         f"is {run.repeats} but {', '.join(wrong)}: the coordinator plays run.repeats games of each"
                         " task id, and a server trains on groups of num_repeat episodes of one task, so its groups"
                         " would never fill (or would mix tasks). Make them equal (or drop run.repeats: it defaults"
                         " to the servers' num_repeat)")
        return
    sizes = {t.num_repeat for t in trainable.values()}
    if len(sizes) <= 1:
        run.repeats = sizes.pop() if sizes else 1
        return
    (first, first_train), *rest = trainable.items()
    for name, train in rest:
        if train.num_repeat != first_train.num_repeat:
            findings.bad(["servers", name, "train", "num_repeat"],
                         f"is {train.num_repeat} but servers.{first}.train.num_repeat is {first_train.num_repeat}: a"
                         " game plays one task on every trainable server at once, so all trainable servers need the"
                         " same GRPO group size (num_repeat); make them equal")


def check_stop(spec: TopologySpec, findings: Findings) -> None:
    """run.max_steps needs something to train; run.games should fill whole GRPO groups."""
    run = spec.run
    if run.max_steps is not None and not any(s.trainable for s in spec.servers.values()):
        findings.bad(["run", "max_steps"], "no server is trainable, so no training step is ever taken: set run.games"
                                           " instead")
    if run.games is not None and run.repeats and run.games % run.repeats:
        findings.warn(["run", "games"], f"{run.games} is not a multiple of run.repeats ({run.repeats}): the last"
                                        " task's GRPO group will be incomplete")


def check_urls(spec: TopologySpec, findings: Findings) -> None:
    """URLs that work but are probably not what was meant (warnings)."""
    for name, server in spec.servers.items():
        if server.url is not None and server.swarm_url is None and not server.url.rstrip("/").endswith("/v1"):
            findings.warn(["servers", name, "url"], f"{server.url!r} does not end in /v1; OpenAI base URLs usually"
                                                    " do (e.g. http://host:8000/v1)")
        if server.swarm_url is not None and server.swarm_url.rstrip("/").endswith("/v1"):
            findings.warn(["servers", name, "swarm_url"], "swarm_url is the server's root URL, not its OpenAI base"
                                                          " URL: drop /v1")


def check_past_of(spec: TopologySpec, findings: Findings) -> None:
    """A past_of server names a local trainable server whose checkpoints it plays (with `policy:`, the checkpoints of
    one of its LoRA policies)."""
    for name, server in spec.servers.items():
        if server.past_of is None:
            continue
        source = server.past_of.server
        where = ["servers", name, "past_of", "server"]
        if source not in spec.servers:
            findings.bad(where, f"unknown server {source!r}; known servers: {_known_servers(spec)}"
                                f"{did_you_mean(source, spec.servers)}")
            continue
        kind = spec.servers[source].kind
        if kind is not ServerKind.LOCAL_TRAINABLE:
            findings.bad(where, f"servers.{source} is a {kind.value} server: past_of plays the checkpoints that a"
                                " local trainable server (model: + trainable: true) writes into the run directory")
        elif _past_policy_ok(name, server.past_of, spec.servers[source], findings):
            policy = server.past_of.policy
            train = spec.servers[source].policy_train(policy) if policy else spec.servers[source].train
            if train.save_freq == 0:
                who = f"servers.{source}" + (f".policies.{policy}" if policy else "")
                findings.warn(where, f"{who}.train.save_freq is 0: it never saves a checkpoint, so this server"
                                     " always plays its initial model")


def _past_policy_ok(name: str, past_of: PastOfSpec, source: ServerSpec, findings: Findings) -> bool:
    """past_of.policy names one of the source's LoRA policies where it has some, and is left out where it has none."""
    where = ["servers", name, "past_of", "policy"]
    policies = source.policies or {}
    if past_of.policy is None and policies:
        findings.bad(["servers", name, "past_of"], f"servers.{past_of.server} trains LoRA policies, each with its"
                     f" own checkpoints: name the one to play with policy: (one of {', '.join(policies)})")
    elif past_of.policy is not None and not policies:
        findings.bad(where, f"servers.{past_of.server} trains no LoRA policies (one full-weight model): remove"
                            " policy")
    elif past_of.policy is not None and past_of.policy not in policies:
        findings.bad(where, f"servers.{past_of.server} has no policy {past_of.policy!r}; its policies:"
                            f" {', '.join(policies)}{did_you_mean(past_of.policy, policies)}")
    else:
        return True
    return False


def check_eval_every(spec: TopologySpec, findings: Findings) -> None:
    """run.eval_every plays checkpoints: every trainable server must be local and save them (each of its LoRA
    policies, with its own train.save_freq)."""
    every = spec.run.eval_every
    if every is None:
        if spec.run.eval_exploitability:
            findings.bad(["run", "eval_exploitability"], "it measures at each run.eval_every evaluation, and"
                                                         " run.eval_every is not set: set it (e.g. 10)")
        return
    trainable = {name: s for name, s in spec.servers.items() if s.trainable}
    if not trainable:
        findings.bad(["run", "eval_every"], "no server is trainable: there are no checkpoints to evaluate; remove it")
    for name, server in trainable.items():
        if server.kind is not ServerKind.LOCAL_TRAINABLE:
            findings.bad(["run", "eval_every"], f"servers.{name} is a remote swarm server: evaluations play the"
                                                " checkpoints local trainable servers write into the run directory")
            continue
        learners = {f"servers.{name}.policies.{p}": server.policy_train(p) for p in server.policies or {}}
        for where, train in (learners or {f"servers.{name}": server.train}).items():
            if train.save_freq == 0:
                findings.bad(["run", "eval_every"], f"{where}.train.save_freq is 0: it saves no checkpoints to"
                                                    f" evaluate; set it to a divisor of {every}")
            elif every % train.save_freq:
                findings.warn(["run", "eval_every"], f"{every} is not a multiple of {where}.train.save_freq"
                                                     f" ({train.save_freq}): each evaluation plays the newest"
                                                     " checkpoint at that point")


def check_ray_gpus(spec: TopologySpec, findings: Findings) -> None:
    """Under run.ray a server actor's `marl serve` sees the GPUs Ray gave it, and no others."""
    if spec.run.ray is None:
        return
    for name, server in spec.servers.items():
        if not server.is_local or server.kind is ServerKind.PAST_SNAPSHOTS:
            continue
        granted = int((server.resources or {}).get("GPU", 0))
        placed = server.placement and [*(server.placement.engine_gpus or []), *(server.placement.trainer_gpus or [])]
        if server.device == "cuda" and granted == 0:
            findings.bad(["servers", name, "device"], "under run.ray a server sees only the GPUs its actor asks"
                                                      " for: add resources: {GPU: n}, or device: cpu")
        if placed and max(placed) >= granted:
            findings.bad(["servers", name, "placement"], f"under run.ray the server sees the {granted} GPU(s) of"
                                                         f" resources.GPU, numbered from 0, but placement uses GPU"
                                                         f" {max(placed)}: ask for resources: {{GPU:"
                                                         f" {max(placed) + 1}}} or more, or renumber")


def check_ray_ranks(spec: TopologySpec, findings: Findings) -> None:
    """Trainer ranks on other machines are Ray actors in the server's placement group (marl/topology/bundles.py)."""
    for name, server in spec.servers.items():
        placement = server.placement
        if placement is not None and placement.rendezvous_port is not None:
            findings.warn(["servers", name, "placement", "rendezvous_port"], "deprecated and not used: ranks on other"
                          " machines are Ray actors now (run.ray, docs/ray.md); remove it")
        if not server.is_local or server.kind is ServerKind.PAST_SNAPSHOTS:
            continue
        if spec.run.ray is None:
            if placement is not None and placement.nodes > 1:
                findings.bad(["servers", name, "placement", "nodes"], f"{placement.nodes} machines need run.ray:"
                             " the trainer's ranks and vLLM's replicas on other machines are Ray actors"
                             " (docs/ray.md); add run.ray: {address: auto}, or nodes: 1")
            continue
        for key, message in _ray_rank_problems(server):
            findings.bad(["servers", name, *key], message)


def _ray_rank_problems(server: ServerSpec) -> list[tuple[tuple[str, ...], str]]:
    """What a local server's placement group cannot be under run.ray, by key."""
    ranks, bundles = server_ranks(server), ray_bundles(server)
    problems = [((key,), "Ray refuses a bundle that asks for nothing: ask for some CPU (or another resource)")
                for key, bundle in (("resources", bundles.bundles[0]), ("rank_resources", bundles.rank_bundle),
                                    ("replica_resources", bundles.replica_bundle))
                if bundle is not None and not any(bundle.values())]
    if server.rank_resources is not None and not ranks:
        problems.append((("rank_resources",), "only a trainer with ranks has them: set train.trainer: fsdp, or"
                                              " remove rank_resources"))
    problems += _ray_replica_problems(server, bundles)
    if not ranks:
        return problems
    problems += _bundle_gpu_problems(server, "rank_resources", bundles.rank_bundle, 1, "trainer rank")
    if server.placement is not None and server.placement.trainer_gpus is not None:
        problems.append((("placement", "trainer_gpus"), "under run.ray each trainer rank is a Ray actor with its own"
                                                        " GPU (rank_resources: {GPU: 1} by default on GPUs): remove"
                                                        " trainer_gpus, and set train.fsdp.ranks"))
    sync = server.vllm.weight_sync if server.vllm is not None else "auto"
    if sync in ("nccl", "ipc") and server.placement is not None and server.placement.nodes > 1:
        problems.append((("vllm", "weight_sync"), f"{sync} meets the trainer's ranks on the server's machine, but"
                                                  " placement.nodes lets them run on others: weight_sync: auto or"
                                                  " disk (a shared filesystem)"))
    return problems


def _bundle_gpu_problems(server: ServerSpec, key: str, bundle: dict[str, float], wanted: int,
                         what: str) -> list[tuple[tuple[str, ...], str]]:  # fmt: skip
    """A rank's or replica's bundle asks for `wanted` GPUs on GPUs, none on the CPU."""
    gpus = bundle.get("GPU", 0)
    if on_gpus(server) and gpus != wanted:
        return [((key, "GPU"), f"each {what} runs on {wanted} GPU(s) of its own, but its bundle asks for {gpus:g}:"
                               f" GPU: {wanted}")]
    if not on_gpus(server) and gpus:
        return [((key, "GPU"), f"the server runs on the CPU (device: cpu, or no GPU in resources): its {what}s would"
                               " not use a GPU; remove it")]
    return []


def _ray_replica_problems(server: ServerSpec, bundles: RayBundles) -> list[tuple[tuple[str, ...], str]]:
    """vLLM's replicas after the first are Ray actors in bundles of their own (servers.engines.vllm_ray)."""
    if server.replica_resources is not None and not bundles.replicas:
        return [(("replica_resources",), "only vLLM replicas after the first have them: set engine: vllm and"
                                         " vllm.data_parallel_size > 1, or remove replica_resources")]
    if not bundles.replicas:
        return []
    problems = _bundle_gpu_problems(server, "replica_resources", bundles.replica_bundle,
                                    server.vllm.tensor_parallel_size, "vLLM replica")
    if server.placement is not None and server.placement.engine_gpus is not None:
        problems.append((("placement", "engine_gpus"), "under run.ray vLLM's replicas after the first take the GPUs"
                                                       " of their own bundles (replica_resources), the first the"
                                                       " first tensor_parallel_size of resources.GPU: remove"
                                                       " engine_gpus"))
    sync, spread = server.vllm.weight_sync, server.placement is not None and server.placement.nodes > 1
    if server.trainable and (sync == "ipc" or (sync == "nccl" and spread)):
        where = "on the trainer's GPUs" if sync == "ipc" else "on the server's machine"
        problems.append((("vllm", "weight_sync"), f"{sync} meets vLLM {where}, but its replicas after the first"
                                                  " are Ray actors with GPUs of their own bundles"
                                                  f"{', maybe on other machines' * spread}: weight_sync: auto or"
                                                  " disk (a shared filesystem)"))
    return problems


def check_local_models(spec: TopologySpec, findings: Findings) -> None:
    """The model of a server `marl run` starts here is a directory on this machine, an alias `marl serve` builds
    (`marl.protocol.MODEL_ALIASES`) or a Hugging Face id (`org/name`), which HF_HUB_OFFLINE=1 needs in the Hugging
    Face cache; only an id has a revision. Under run.ray a server may run on another node, which may have the
    directory or the cached model: a warning there."""
    for name, server in spec.servers.items():
        if server.kind not in (ServerKind.LOCAL_TRAINABLE, ServerKind.LOCAL_STATIC) or server.model is None:
            continue
        problem = _local_model_problem(server)
        if problem is None:
            continue
        key, message = problem
        if spec.run.ray is not None:
            findings.warn(["servers", name, key], message + "; under run.ray the node that runs it needs it")
        else:
            findings.bad(["servers", name, key], message)


def _local_model_problem(server: ServerSpec) -> tuple[str, str] | None:
    """(key, message) of what keeps `marl serve` from finding this server's model here, or None."""
    model = server.model or ""
    path = Path(model).expanduser()
    if path.is_dir():
        return None if server.revision is None else ("revision", f"{model!r} is a directory on this machine, which"
                                                     " has no revisions: remove revision, or name the model by its"
                                                     " Hugging Face id")
    if model in MODEL_ALIASES:
        return None
    if is_hub_id(model) and not path.exists():
        if not is_offline_mode():
            return None  # `marl serve` fetches it (and says in one line if it cannot)
        try:
            hub_config(model, server.revision, cache_only=True)
        except HubConfigError as exc:
            return "model", str(exc)
        return None
    what = "is a file, not a model directory" if path.exists() else "is no directory here and no model alias"
    return "model", (f"{model!r} {what}{did_you_mean(model, MODEL_ALIASES)}: give a Hugging Face id (org/name), a"
                     " Hugging Face model directory (config.json, weights, tokenizer) or an alias"
                     f" ({', '.join(MODEL_ALIASES)})")
