"""`marl episode show DATA_DIR [EPISODE]`: one episode's training samples, token by token, from a server's ledger.

What the trainer sees is shown as it is stored: the exact token ids, decoded span by span. Tokens the model
generated (loss mask 1, trained on) are wrapped in `[[ ... ]]`; everything else (system prompt, observations,
chat-template tokens: mask 0) is left bare. In a terminal the trained tokens are also coloured by their logprob
(green: likely, red: unlikely) and the context is dimmed; piped, the output is plain text with the same brackets.
`--tokens` adds a table with one row per token: position, mask, logprob, the token as the tokenizer spells it.

Use it to debug rewards and templates: a merged multi-turn sample must show one `[[...]]` span per model turn,
each ending with the end-of-turn token, and nothing the model did not write inside the brackets.

DATA_DIR is a server's data dir (the one holding ledger.sqlite, e.g. runs/<run>/servers/<name>). The tokenizer
comes from `--model`, else the newest checkpoint there, else the model the server was started with.

Agent tags, task ids, metadata and the text of the calls are what lease holders sent: every one is printed through
`safe`, so an escape sequence among them shows as `\x1b` instead of acting on the terminal.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from servers.episodes.ledger import EpisodeRow, Ledger
from servers.episodes.samples import Sample

OPEN, CLOSE = "[[", "]]"

# Every C0 and C1 control, DEL and the bidirectional-text controls, written as escapes (tabs stay). rich's own
# `Console.print` drops BEL, BS, VT, FF and CR only: ESC would reach the terminal. The same table as
# `marl.watching.terminal.safe` (a server imports nothing of marl/ but the protocol): keep the two alike.
_CONTROLS = [*range(0x20), 0x7F, *range(0x80, 0xA0), *range(0x200E, 0x2010), *range(0x202A, 0x202F),
             *range(0x2066, 0x206A)]
_ESCAPES = {cp: f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}" for cp in _CONTROLS if cp != 0x09}
_ESCAPES_KEEPING_NEWLINES = {cp: text for cp, text in _ESCAPES.items() if cp != 0x0A}


def safe(text: object, *, newlines: bool = False) -> str:
    """`text` with control characters written as escapes (ESC as `\\x1b`); `newlines=True` keeps line breaks."""
    return str(text).translate(_ESCAPES_KEEPING_NEWLINES if newlines else _ESCAPES)


class ViewerError(ValueError):
    """Bad arguments: the message says what to pass instead."""


def open_ledger(data_dir: Path) -> Ledger:
    path = data_dir / "ledger.sqlite" if data_dir.is_dir() else data_dir
    if not path.is_file():
        raise ViewerError(f"no ledger at {path}: pass a server's data dir (it holds ledger.sqlite), e.g. "
                          "runs/signalling-cpu/servers/speaker_model")
    return Ledger(path)


def load_tokenizer(data_dir: Path, ledger: Ledger, model: str | None = None) -> Any:
    from transformers import AutoTokenizer

    from servers.model_files import resolve_model
    from servers.training.checkpoint_dirs import CheckpointDir

    if model is None:
        latest = CheckpointDir(data_dir / "checkpoints").latest() if data_dir.is_dir() else None
        model = str(latest) if latest else ledger.get_meta("model")
    if model is None:
        raise ViewerError("this ledger does not say which model wrote it: pass --model (a model dir, an alias or a"
                          " Hugging Face id)")
    return AutoTokenizer.from_pretrained(str(resolve_model(model)))


def spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal mask values: (start, end exclusive, mask)."""
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if out and out[-1][2] == m:
            out[-1] = (out[-1][0], i + 1, m)
        else:
            out.append((i, i + 1, m))
    return out


def render_sample(sample: Sample, tokenizer: Any, index: int, total: int) -> Text:
    trained = sum(sample.loss_mask)
    text = Text()
    text.append(f"--- sample {index}/{total} · agent {safe(sample.agent)} · reward {sample.reward:g} · "
                f"policy v{sample.policy_version} · {sample.num_calls} calls · {len(sample.token_ids)} tokens "
                f"({trained} trained, {sum(1 for *_, m in spans(sample.loss_mask) if m)} spans)\n", style="bold")
    if not sample.num_calls:
        text.append("(its agent made no call this episode: the sample counts in its group, with no token)\n",
                    style="dim")
    elif not sample.token_ids:
        text.append("(its tokens were compacted once trained: train.keep_sample_tokens_steps)\n", style="dim")
    for start, end, m in spans(sample.loss_mask):
        if not m:
            text.append(safe(tokenizer.decode(sample.token_ids[start:end]), newlines=True), style="dim")
            continue
        text.append(OPEN, style="bold magenta")
        for i in range(start, end):  # token by token, coloured by how likely the model found it
            text.append(safe(tokenizer.decode([sample.token_ids[i]]), newlines=True), style=_heat(sample.logprobs[i]))
        text.append(CLOSE, style="bold magenta")
    text.append("\n")
    return text


def token_table(sample: Sample, tokenizer: Any) -> Table:
    table = Table("pos", "mask", "logprob", "token", box=None, header_style="bold")
    for i, (tid, m, lp) in enumerate(zip(sample.token_ids, sample.loss_mask, sample.logprobs, strict=True)):
        table.add_row(str(i), str(m), f"{lp:.4f}" if m else "", Text(repr(tokenizer.convert_ids_to_tokens(tid))),
                      style=None if m else "dim")
    return table


def _heat(logprob: float) -> str:
    p = math.exp(max(logprob, -50.0))
    return "green" if p > 0.5 else "yellow" if p > 0.1 else "red"


def describe(row: EpisodeRow) -> str:
    state = {None: "in pool", -1: "dropped (stale)"}.get(row.consumed_step, f"trained at step {row.consumed_step}")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.ended_at))
    rewards = ", ".join(f"{safe(k)}={v:g}" for k, v in row.agent_rewards.items()) or f"{row.reward:g}"
    return (f"{row.episode_id}  {when}  job {safe(row.job)}  task {safe(row.task_id)}  reward {rewards}  "
            f"{row.num_calls} calls  {row.num_samples} samples  {state}")


def list_episodes(data_dir: Path, limit: int = 20, console: Console | None = None) -> None:
    console = console or Console(highlight=False)
    ledger = open_ledger(data_dir)
    try:
        rows = ledger.episodes(limit)
        if not rows:
            console.print(f"no episodes in {data_dir} yet")
        for row in rows:
            console.print(Text(describe(row)), soft_wrap=True)  # Text: a tag's "[...]" is not rich markup
    finally:
        ledger.close()


def recorded_samples(data_dir: Path) -> list[Sample]:
    """Every sample in the ledger of `data_dir`, oldest episode first: what `marl check-env` tallies per role."""
    ledger = open_ledger(data_dir)
    try:
        rows = ledger.episodes(limit=-1)  # SQLite's LIMIT -1: every row
        return [sample for row in reversed(rows) for sample in ledger.samples_of(row.episode_id)]
    finally:
        ledger.close()


def show_episode(data_dir: Path, episode_id: str | None = None, *, model: str | None = None, tokens: bool = False,
                 console: Console | None = None) -> None:
    """Print one episode (default: the latest ended one); `episode_id` may be a unique prefix."""
    console = console or Console(highlight=False)
    ledger = open_ledger(data_dir)
    try:
        rows = ledger.episodes(limit=2, episode_id=episode_id) if episode_id else ledger.episodes(limit=1)
        if not rows:
            raise ViewerError(f"no episode {episode_id!r} in {data_dir}" if episode_id else
                              f"no episodes in {data_dir} yet")
        if len(rows) > 1:
            raise ViewerError(f"{episode_id!r} matches several episodes ({rows[0].episode_id}, {rows[1].episode_id},"
                              " ...): give more of the id")
        row = rows[0]
        tokenizer = load_tokenizer(data_dir, ledger, model)
        samples = ledger.samples_of(row.episode_id)
    finally:
        ledger.close()
    console.print(Text(describe(row)), soft_wrap=True)  # Text: a tag's "[...]" is not rich markup
    if players := row.metadata.get("co_players"):
        console.print(Text("played with: " + co_players_text(players)), soft_wrap=True)
    for i, sample in enumerate(samples, 1):
        console.print(render_sample(sample, tokenizer, i, len(samples)), soft_wrap=True)
        if tokens:
            console.print(token_table(sample, tokenizer))


def co_players_text(players: dict) -> str:
    """Who played each role of the episode's game (the coordinator's provenance): server, version, snapshot."""
    def one(role: str, p: dict) -> str:
        version = f" v{p['policy_version']}" if p.get("policy_version") is not None else ""
        snapshot = f" (snapshot of {p['snapshot_of']})" if p.get("snapshot_of") else ""
        return f"{role}={p.get('server') or 'scripted'}{version}{snapshot}"

    return safe(", ".join(one(role, p) for role, p in sorted(players.items())))  # the lease holder's metadata
