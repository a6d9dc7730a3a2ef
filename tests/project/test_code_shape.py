"""The shape rules hold everywhere but tests: functions of at most 60 lines, classes of at most 250."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _code_shape():
    spec = importlib.util.spec_from_file_location("code_shape", ROOT / "bench" / "code_shape.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_no_function_over_60_lines_and_no_class_over_250():
    shape = _code_shape()
    assert shape.python_files(), "the checker found no files: is CHECKED right?"
    bad = shape.offenders()
    assert not bad, "over the limits:\n" + "\n".join(map(str, bad))


def test_the_checker_catches_a_long_function_and_a_big_class_in_any_package(tmp_path):
    shape = _code_shape()
    (tmp_path / "marl").mkdir()
    (tmp_path / "servers").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    (tmp_path / "marl" / "long.py").write_text(f"def long():\n{body}\n")  # 61 lines
    (tmp_path / "marl" / "short.py").write_text("def short():\n    return 1\n")
    methods = "\n".join(f"    def m{i}(self):\n        return {i}\n" for i in range(90))
    (tmp_path / "servers" / "big.py").write_text(f"class Big:\n{methods}")  # 271 lines
    (tmp_path / "marl" / "big_client.py").write_text(f"class BigClient:\n{methods}")
    (tmp_path / "marl" / "small.py").write_text("class Small:\n    x = 1\n")
    names = sorted(b.name for b in shape.offenders(tmp_path))
    assert names == ["Big", "BigClient", "long"]
