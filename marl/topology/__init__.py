"""Topologies: which roles exist, which model server plays each role, which environment, how many games.

A topology is one YAML file (see `topologies/`). It is loaded with omegaconf (so `${name}` and
`${oc.env:VAR,default}` interpolations work, and `key=value` dotlist overrides from the command line are merged on
top), validated into pydantic models, checked for consistency and against the env, and turned into a networkx graph:

    role ──played_by──► server          role ──member_of──► team          server ──past_of──► server

    topo = Topology.load("topologies/signalling-cpu.yaml", ["run.max_steps=5"])
    topo.players()                       # {'speaker': 'speaker_model', 'listener': 'listener_model'}
    topo.dealt_roles()["speaker"]        # RoleInfo(team='speaker', count=1), from the env
    topo.spec.servers["speaker_model"].train.grpo.learning_rate

The package, in reading order:
    spec.py          the pydantic models (ServerSpec, RoleSpec, EnvSpec, RunSpec, TopologySpec) and one-object rules
    problems.py      Problem and TopologyError
    locate.py        YAML line / override of a key; pydantic errors -> problems
    checks.py        consistency checks across objects (who plays what, run.repeats, the stop condition)
    importing.py     importing env.class ("module:Class" or "module:factory")
    env_contract.py  the env constructed with env.args; its dealt_roles() against roles:
    load.py          omegaconf: files, overrides, interpolation; runs the validation and the checks
    graph.py         Topology: the graph and its queries (players, linked_servers, dealt_roles, ...)
The display of `marl topology show` lives in marl/watching/topology_view.py.

Decisions (also in the error messages):
- Every problem found is reported at once in one `TopologyError`; each names its YAML key as a dotted path, says
  what is wrong and how to fix it, and where it is: `file:line` or the command-line override that set it.
- Unknown keys are errors everywhere (typos must not be silently ignored), including `env.args` when the env's
  class or factory takes no `**kwargs`: `env.args` are passed to it as keyword arguments.
- `env.class` is imported and constructed while loading (`check_env=False` skips it, and the role checks); its
  `dealt_roles()` must match `roles:` by name; a role's `count` and `team` default to the env's.
"""

from envs.base import RoleInfo

from .graph import Topology
from .importing import import_class, import_env_factory
from .problems import Problem, TopologyError
from .spec import EnvSpec, PastOfSpec, RoleSpec, RunSpec, ServerKind, ServerSpec, TopologySpec

__all__ = [
    "EnvSpec", "PastOfSpec", "Problem", "RoleInfo", "RoleSpec", "RunSpec", "ServerKind", "ServerSpec", "Topology",
    "TopologyError", "TopologySpec", "import_class", "import_env_factory",
]
