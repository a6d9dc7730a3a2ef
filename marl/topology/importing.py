"""Importing `env.class`: "module:Class" or "module:factory", with errors that say what to fix.

When the module is not found, the current directory is added to `sys.path` and the import retried, so a user's own
`my_env.py` next to where they run `marl` works without installing it.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import sys
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .problems import did_you_mean, short


def import_env_factory(path: str) -> Callable[..., Any]:
    """Import "module:Class" or "module:function" (also "module:Outer.Inner") and return what makes the env.

    A class is called with `env.args` like a factory function is, so both are returned as they are. Raises
    ImportError with a clear message when the module or the name is missing, or the name is not callable.
    """
    obj = _import_object(path)
    if not callable(obj):
        raise ImportError(f"{path!r} is not a class or a function that returns the env (it is {short(obj)})")
    return obj


def import_class(path: str) -> type:
    """Import "module:Class" and return the class; like `import_env_factory`, for code that needs a class."""
    obj = _import_object(path)
    if not inspect.isclass(obj):
        raise ImportError(f"{path!r} is a {type(obj).__name__}, not a class")
    return obj


def import_path_problem(path: str) -> str | None:
    """What is wrong with `path` as "module:name" (None: nothing), with a guess for a dotted "module.name"."""
    module_name, sep, qualname = path.partition(":")
    if sep and module_name and qualname:
        return None
    guess = ""
    if not sep and "." in path:
        head, _, tail = path.rpartition(".")
        guess = f"; did you mean '{head}:{tail}'?"
    return f"{path!r} is not an import path 'module:Class' or 'module:factory'{guess}"


def _import_object(path: str) -> Any:
    if problem := import_path_problem(path):
        raise ImportError(problem)
    module_name, _, qualname = path.partition(":")
    obj: Any = _import_module(module_name)
    for part in qualname.split("."):
        if not hasattr(obj, part):
            names = [n for n, v in vars(obj).items() if callable(v) and not n.startswith("_")
                     and getattr(v, "__module__", module_name) == module_name]
            raise ImportError(f"module {module_name!r} has no attribute {qualname!r}{did_you_mean(part, names)}")
        obj = getattr(obj, part)
    return obj


def _import_module(module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        cwd = os.getcwd()
        if exc.name == top and cwd not in sys.path and "" not in sys.path:
            sys.path.insert(0, cwd)  # a user's own env module next to where they run `marl`
            return _import_module(module_name)
        raise ImportError(f"cannot import module {module_name!r}: {exc}{_sibling_hint(exc, module_name)}") from exc
    except Exception as exc:  # a SyntaxError, or an import inside the module failing
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
        at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        if isinstance(exc, SyntaxError) and exc.filename:
            at = f" (at {exc.filename}:{exc.lineno})"
        raise ImportError(f"importing module {module_name!r} failed: {type(exc).__name__}: {exc}{at}") from exc


def _sibling_hint(exc: ModuleNotFoundError, module_name: str) -> str:
    """A typo in the last part of a dotted module name: the closest module of its package."""
    parent, _, leaf = module_name.rpartition(".")
    if exc.name != module_name or not parent:
        return ""
    try:
        package = importlib.import_module(parent)
    except Exception:  # noqa: BLE001 - only a hint
        return ""
    siblings = [m.name for m in pkgutil.iter_modules(getattr(package, "__path__", []))]
    return did_you_mean(leaf, siblings).replace("(did you mean '", f"(did you mean '{parent}.")
