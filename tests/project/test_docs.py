"""The README and docs/ as a reader meets them: the README stays short and maps every doc page, every link resolves,
every file a page names exists, and every command a page shows parses (the `marl` command line, its topology and
overrides; a bench's or example's flags; `make` targets). Imports are checked in test_public_api.py."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from marl.cli import parse
from marl.topology import Topology

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: A repository file named in prose or code: a known top folder, a file name with one of these endings.
REPO_PATH = re.compile(r"(?<![\w./<>-])((?:bench|topologies|examples|docs|tests|servers|marl|envs)/[\w./-]*?"
                       r"\.(?:py|yaml|md|png|json))\b")
SCRIPT_FLAGS = re.compile(r"((?:bench|examples)/\w+\.py)((?:\s+[^`\n#|]*)?)")


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _shell_lines(text: str) -> list[str]:
    """The command lines of a page's shell blocks (```bash, ```sh or bare), continuations joined, comments kept."""
    lines = []
    for language, body in FENCE.findall(text):
        if language not in ("", "bash", "sh", "shell"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                lines.append(line.strip())
    return lines


def _marl_argv(line: str) -> list[str] | None:
    """The arguments after `marl` (or `.venv/bin/marl`, after any VAR=value prefixes), or None for another command.
    Optional parts written `[--flag VALUE]` count as given."""
    if not re.match(r"(?:[A-Z_]+=\S*\s+)*(?:\.venv/bin/)?marl\s", line):
        return None
    words = shlex.split(line.replace("[", " ").replace("]", " ") if "'" not in line else line, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    if not words or words[0] not in ("marl", ".venv/bin/marl"):
        return None
    return words[1:]


def _commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for line in _shell_lines(page.read_text()):
            argv = _marl_argv(line)
            if argv is not None:
                found.append((f"{_id(page)}: {line}", argv))
    return found


def test_readme_is_at_most_100_lines():
    """The README is the front door: what marl is, how to start, what it has shown (one line each), the map. Run
    tables and their stories live in docs/results.md."""
    assert len(README.read_text().splitlines()) <= 100


def test_the_readme_links_every_doc_page():
    targets = set(LINK.findall(INLINE_CODE.sub("", README.read_text())))
    missing = [_id(page) for page in DOCS if _id(page) not in targets]
    assert not missing, f"not linked from README.md: {missing}"


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_relative_link_resolves(page):
    text = FENCE.sub("", page.read_text())
    broken = []
    for target in LINK.findall(INLINE_CODE.sub("", text)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", FENCE.sub("", file.read_text()), re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{_id(page)}: links to nothing: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_repository_file_a_page_names_exists(page):
    missing = sorted({path for path in REPO_PATH.findall(page.read_text()) if not (ROOT / path).exists()})
    assert not missing, f"{_id(page)} names files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_bench_or_example_flag_a_page_shows_exists(page):
    """`bench/x.py --flag` in a code block or a code span: x.py defines "--flag"."""
    text = page.read_text()
    snippets = [body for _, body in FENCE.findall(text)] + [span.replace("\n", " ")
                                                            for span in INLINE_CODE.findall(FENCE.sub("", text))]
    unknown = []
    for snippet in snippets:
        for script, rest in SCRIPT_FLAGS.findall(snippet):
            source = (ROOT / script).read_text() if (ROOT / script).exists() else ""
            unknown += [f"{script} {flag}" for flag in re.findall(r"(?<![\w-])--[\w-]+", rest)
                        if f'"{flag}"' not in source]
    assert not unknown, f"{_id(page)}: flags the scripts do not define: {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_make_target_a_page_shows_exists(page):
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    shown = set(re.findall(r"`make ([\w-]+)`", page.read_text()))
    for line in _shell_lines(page.read_text()):
        shown |= set(re.findall(r"^make ([\w-]+)", line))
    assert shown <= targets, f"{_id(page)}: no such make target: {sorted(shown - targets)}"


def test_the_docs_show_marl_commands():
    assert len(_commands()) > 30  # the scan found the commands


@pytest.mark.parametrize(("where", "argv"), _commands(), ids=[where for where, _ in _commands()])
def test_every_marl_command_a_page_shows_parses(where, argv):
    """The command line parses as `marl` would parse it; a shipped topology it names loads with its overrides."""
    args = parse(argv)
    file = getattr(args, "file", None)
    if file and (ROOT / file).is_file() and hasattr(args, "overrides"):
        Topology.load(ROOT / file, args.overrides)
