"""The code keeps docs/architecture.md's "Which way imports run": no import circle in marl/, servers/ or envs/, and
every import runs the way the rules say.

Every import counts, wherever it stands: at module level, inside a function (a lazy import), or under
`if TYPE_CHECKING:` (a type-only import is still a dependency of the design). The one exception is
`ALLOWED_LAZY`, a deprecation shim, which must stay lazy and goes with it.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP = ("marl", "servers", "envs")

#: (importer, imported) allowed although a rule forbids it, if the import is made inside a function: the deprecated
#: `marl.protocol.Sample` resolves lazily to `servers.episodes.samples.Sample` until the next release (CHANGELOG.md).
ALLOWED_LAZY = {("marl.protocol", "servers.episodes.samples")}


@dataclass(frozen=True)
class Import:
    path: str  # the importing file, from the repository root
    line: int
    importer: str  # module names
    imported: str
    lazy: bool  # inside a function

    def __str__(self) -> str:
        return f"{self.path}:{self.line} -> {self.imported}"


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for top in TOP for p in sorted((root / top).rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The project module that importing `name` loads: `name`, or its longest known prefix (a name in a module)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, known: dict[str, Path]) -> set[str]:
    """The project modules an import statement loads (`from a import b`: the module a.b if there is one, else a)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importer's package, up level - 1
            package = importer if is_package else importer.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    return {m for m in (_resolve(n, known) for n in names) if m is not None and m != importer}


def _file_imports(path: Path, root: Path, known: dict[str, Path]) -> list[Import]:
    importer = module_name(path, root)
    where = str(path.relative_to(root))
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                for imported in sorted(_targets(child, importer, path.name == "__init__.py", known)):
                    found.append(Import(where, child.lineno, importer, imported, lazy))
            visit(child, lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(ast.parse(path.read_text(), filename=where), False)
    return found


def all_imports(root: Path = ROOT) -> list[Import]:
    known = project_modules(root)
    return [i for path in known.values() for i in _file_imports(path, root, known)]


def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


#: the bottom room both halves share: the wire formats, and the old paths of moved modules
SHARED = ("marl.protocol", "marl.apis", "marl.decision_record", "marl.moved", "marl.hub_ids")


@dataclass(frozen=True)
class Rule:
    says: str  # as docs/architecture.md says it
    applies: Callable[[str], bool]  # to an importer
    allowed: Callable[[str], bool]  # an imported module


RULES = [
    Rule("marl/protocol/ imports nothing of the project but itself; marl/decision_record.py, marl/moved.py and"
         " marl/hub_ids.py import nothing of the project",
         lambda m: _under(m, "marl.protocol", "marl.decision_record", "marl.moved", "marl.hub_ids"),
         lambda t: _under(t, "marl.protocol") and t != "marl.protocol"),
    Rule("marl/apis/ imports only marl/protocol/ (and itself)",
         lambda m: _under(m, "marl.apis"), lambda t: _under(t, "marl.protocol", "marl.apis")),
    Rule("servers/ imports from marl/ only marl.protocol, marl.apis, marl.decision_record, marl.moved and"
         " marl.hub_ids (never the coordinator, topologies or envs)",
         lambda m: _under(m, "servers"),
         lambda t: not _under(t, "marl") or _under(t, *SHARED)),
    Rule("servers/ never imports envs/", lambda m: _under(m, "servers"), lambda t: not _under(t, "envs")),
    Rule("envs/ imports neither servers/ nor marl/", lambda m: _under(m, "envs"),
         lambda t: not _under(t, "servers", "marl")),
    Rule("marl/ imports servers/ only in marl/cli.py", lambda m: _under(m, "marl") and m != "marl.cli",
         lambda t: not _under(t, "servers")),
    Rule("the rooms of marl/ below the run never import the run's machinery: marl/transaction/, marl/watching/,"
         " marl/agents/, marl/games/, marl/client/, marl/topology/ and marl/eval/ do not import marl/runner/run.py",
         lambda m: _under(m, "marl.transaction", "marl.watching", "marl.agents", "marl.games", "marl.client",
                          "marl.topology", "marl.eval"),
         lambda t: t != "marl.runner.run"),
]


def broken(rule: Rule, imports: list[Import]) -> list[Import]:
    return [i for i in imports if rule.applies(i.importer) and not rule.allowed(i.imported)
            and not (i.lazy and (i.importer, i.imported) in ALLOWED_LAZY)]


def circles(imports: list[Import]) -> list[list[str]]:
    graph = nx.DiGraph((i.importer, i.imported) for i in imports)
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    found = all_imports()
    assert len({i.importer for i in found}) > 100, "the parser found too few modules: is ROOT right?"
    return found


def test_no_import_circle(imports):
    found = circles(imports)
    ties = [str(i) for c in found for i in imports if i.importer in c and i.imported in c]
    assert not found, f"import circles: {found}\n" + "\n".join(sorted(ties))


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.says.split(" (")[0])
def test_imports_run_the_way_architecture_md_says(rule, imports):
    bad = broken(rule, imports)
    assert not bad, f"{rule.says}; broken by:\n" + "\n".join(map(str, bad))


def test_the_one_allowed_lazy_import_is_still_there_and_lazy(imports):
    """When the shim goes, its allowance goes too; while it stays, it must not become a module-level import."""
    for importer, imported in ALLOWED_LAZY:
        uses = [i for i in imports if (i.importer, i.imported) == (importer, imported)]
        assert uses, f"{importer} no longer imports {imported}: remove it from ALLOWED_LAZY"
        assert all(i.lazy for i in uses), f"must stay inside a function: {[str(i) for i in uses]}"


def test_the_parser_sees_every_kind_of_import(tmp_path):
    """Module level, relative, `from package import module`, inside a function, under TYPE_CHECKING."""
    for package in ("marl", "servers", "envs", "marl/apis"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "marl" / "protocol.py").write_text("")
    (tmp_path / "marl" / "apis" / "messages.py").write_text("from . import responses\nfrom ..protocol import X\n")
    (tmp_path / "marl" / "apis" / "responses.py").write_text("def f():\n    from marl.apis import messages\n")
    (tmp_path / "envs" / "base.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from servers import ledger\n")
    (tmp_path / "servers" / "ledger.py").write_text("from marl import protocol as p\nimport marl.apis.messages\n")
    found = {(i.importer, i.imported, i.lazy) for i in all_imports(tmp_path)}
    assert found == {
        ("marl.apis.messages", "marl.apis.responses", False), ("marl.apis.messages", "marl.protocol", False),
        ("marl.apis.responses", "marl.apis.messages", True), ("envs.base", "servers.ledger", False),
        ("servers.ledger", "marl.protocol", False), ("servers.ledger", "marl.apis.messages", False),
    }
    imports = all_imports(tmp_path)
    assert circles(imports) == [["marl.apis.messages", "marl.apis.responses"]]
    assert [str(i) for i in broken(RULES[4], imports)] == ["envs/base.py:3 -> servers.ledger"]
