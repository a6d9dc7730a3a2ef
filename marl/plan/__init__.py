"""`marl plan`: will a topology's models fit the devices it gives them? Memory per device and disk per step.

    architecture.py   a model's shape (config.json, or a table of well-known models) and its parameter count
    memory.py         the arithmetic: the engine, a trainer rank, a checkpoint (`Parts`: named byte counts)
    topology_plan.py  every server of a topology on its devices, and the problems at the keys to change
    box.py            beside the GPUs: which way the weights travel after a step, and the box's host memory
    report.py         the tables `marl plan` prints

    plan = plan_topology(Topology.load("topologies/werewolves-7b-14b-235b.yaml").spec)
    plan.problems            # [] when everything fits
"""

from .architecture import KNOWN_ARCHITECTURES, Architecture, UnknownModel, architecture_of
from .topology_plan import DeviceLoad, ServerPlan, TopologyPlan, plan_topology

__all__ = ["KNOWN_ARCHITECTURES", "Architecture", "DeviceLoad", "ServerPlan", "TopologyPlan", "UnknownModel",
           "architecture_of", "plan_topology"]
