"""Check the code's shape rules: no function over 60 lines and no class over 250 lines, outside tests.

    python bench/code_shape.py            # lists offenders, exit 1 if any; also prints the longest functions
    python bench/code_shape.py --smoke    # the same report, exit 0 (the limits are tests/project/test_code_shape.py's)

A function's length is its lines from `def` to its last line, docstring included. The rules are the redesign's:
short functions read at once, and each class (one responsibility) stays small enough to hold in one's head.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("marl", "servers", "envs", "bench", "examples")  # everything but tests/
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250


@dataclass(frozen=True)
class Block:
    path: Path
    name: str
    kind: str  # "function" or "class"
    line: int
    length: int
    root: Path = ROOT

    def __str__(self) -> str:
        return f"{self.path.relative_to(self.root)}:{self.line} {self.kind} {self.name}: {self.length} lines"


def blocks(path: Path, root: Path = ROOT) -> Iterator[Block]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            yield Block(path, node.name, kind, first, node.end_lineno - first + 1, root)


def python_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for folder in CHECKED if (root / folder).is_dir() for p in (root / folder).rglob("*.py"))


def offenders(root: Path = ROOT) -> list[Block]:
    found = []
    for path in python_files(root):
        for block in blocks(path, root):
            limit = MAX_FUNCTION_LINES if block.kind == "function" else MAX_CLASS_LINES
            if block.length > limit:
                found.append(block)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=5, help="also list the N longest functions and classes")
    parser.add_argument("--smoke", action="store_true",
                        help="check that the script runs: same report, exit 0 even with offenders")
    args = parser.parse_args()
    every = [b for p in python_files() for b in blocks(p)]
    functions = sorted((b for b in every if b.kind == "function"), key=lambda b: -b.length)
    classes = sorted((b for b in every if b.kind == "class"), key=lambda b: -b.length)
    print(f"longest functions (limit {MAX_FUNCTION_LINES}):", *functions[: args.top], sep="\n  ")
    print(f"longest classes (limit {MAX_CLASS_LINES}):", *classes[: args.top], sep="\n  ")
    bad = offenders()
    print(f"{len(bad)} over the limits", *bad, sep="\n  " if bad else "")
    return 1 if bad and not args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
