"""Old import paths of modules that moved, kept working for one release with a `DeprecationWarning`.

`MOVED_MODULES` maps each old dotted path to where the module lives now (CHANGELOG.md lists the same moves). A finder
at the end of `sys.meta_path` answers only names no file answers any more: importing an old path warns, names the
new one, and hands back the very module object of the new path, so `servers.ledger.Ledger is
servers.episodes.ledger.Ledger` and a patch through either name patches both. `marl` and `servers` install it on
import (`install()` is idempotent). Like `marl.protocol`, this module imports nothing of the project.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: old module path -> new module path (removed in the release after 0.1)
MOVED_MODULES: dict[str, str] = {
    "servers.adapter_files": "servers.policies.adapter_files",
    "servers.batch_wakeup": "servers.training.batch_wakeup",
    "servers.chat_completions": "servers.calls.chat",
    "servers.chat_format": "servers.calls.chat_format",
    "servers.checkpoint_dirs": "servers.training.checkpoint_dirs",
    "servers.completions_api": "servers.calls.completions",
    "servers.control_tokens": "servers.calls.control_tokens",
    "servers.engine_call": "servers.calls.engine_call",
    "servers.episode_recorder": "servers.episodes.recorder",
    "servers.episode_view": "servers.episodes.view",
    "servers.frozen_policies": "servers.policies.frozen",
    "servers.http_guards": "servers.http.guards",
    "servers.http_routes": "servers.http.routes",
    "servers.interfaces": "servers.backends",
    "servers.leases": "servers.episodes.leases",
    "servers.ledger": "servers.episodes.ledger",
    "servers.lifecycle": "servers.training.lifecycle",
    "servers.models": "servers.model_files",
    "servers.openapi": "servers.http.openapi",
    "servers.overdue": "servers.episodes.overdue",
    "servers.policy_backends": "servers.policies.views",
    "servers.policy_server": "servers.policies.server",
    "servers.prepared": "servers.episodes.prepared",
    "servers.prometheus_metrics": "servers.metrics.prometheus",
    "servers.rollout_pool": "servers.episodes.rollout_pool",
    "servers.samples": "servers.episodes.samples",
    "servers.telemetry": "servers.metrics.telemetry",
    "servers.tool_choice": "servers.calls.tool_choice",
    "servers.train_loop": "servers.training.loop",
    "servers.training_record": "servers.metrics.training_record",
    "servers.translated_apis": "servers.calls.translated",
    "marl.game_record": "marl.games.record",
    "marl.game_table": "marl.games.table",
    "marl.games_view": "marl.games.view",
    "marl.monitor": "marl.runner.server_watch",
    # marl/ in rooms (0.2): the run's machinery, the game transaction, watching a run, agents, the league
    "marl.run": "marl.runner.run",
    "marl.launch": "marl.runner.launch",
    "marl.server_watch": "marl.runner.server_watch",
    "marl.ray_cluster": "marl.runner.ray_cluster",
    "marl.endpoints": "marl.runner.endpoints",
    "marl.frozen_fleet": "marl.league.frozen_fleet",
    "marl.coordinator": "marl.transaction.coordinator",
    "marl.two_phase": "marl.transaction.two_phase",
    "marl.decision_log": "marl.transaction.decision_log",
    "marl.overwatch": "marl.watching.overwatch",
    "marl.plot": "marl.watching.plot",
    "marl.collapse": "marl.watching.collapse",
    "marl.topology_view": "marl.watching.topology_view",
    "marl.terminal": "marl.watching.terminal",
    "marl.agentscope_agents": "marl.agents.agentscope",
    "marl.snapshots": "marl.league.snapshots",
}


class _MovedModuleLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED_MODULES[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path goes in the next release)",
                      DeprecationWarning, stacklevel=2)  # warnings skips importlib's frames
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is the new path's, already executed."""


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old path of a moved module (last on `sys.meta_path`: never shadows a module that exists)."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader())


def install() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
