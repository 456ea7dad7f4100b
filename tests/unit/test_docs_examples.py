"""Every code example in README.md and docs/*.md runs, and every link between them resolves.

What runs, one test per fenced block (parametrized by file and block index):

- every ```python block of README.md and docs/*.md, as a script (``__main__``) in a fresh
  temporary folder, in this process: torch is imported once, conftest has set one intra-op
  thread and resets Dynamo around each test, and a block can import the helpers of
  ``tests/conftest.py`` (``from conftest import ...``) as the tests do;
- every ```bash / ```sh block of README.md (its command-line tour): the lines together as one
  ``bash -euo pipefail`` script in a fresh temporary folder, the venv's ``bin`` first on PATH.
  Such a block may hold only ``boost-*`` and ``python -m boost_compile...`` lines (and comments).

A block preceded by ``<!-- not-run: reason -->`` is skipped with that reason; a marker without a
reason fails. Skips are for blocks that need more than this process can give (a process group of
several ranks, a GPU, a download) or that run the whole suite. The shell blocks of docs/ are
reference command lines at real sizes (training runs of minutes to hours, torchrun launches) and
are not run; the README's tour runs a tiny version of each CLI.

The shell runs get ``OMP_NUM_THREADS=1`` (a shared 2-core machine) and a timeout; the whole
file takes about a minute of CPU (the examples use the tiny presets and ``aot_eager``).
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 250
TIMEOUT_S = 300

PYTHON_LANGS = {"python", "py"}
SHELL_LANGS = {"bash", "sh", "shell"}
FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not-run\b:?\s*(.*?)\s*-->$")
CLI_LINE = re.compile(r"^(boost-(train|bench|explain|export|generate|plan)\b|python -m boost_compile\b)")


@dataclass
class Block:
    page: Path
    index: int  # the block's place among the page's fenced blocks, from 0
    lang: str
    line: int  # the line of its opening fence, from 1
    code: str
    not_run: str | None  # the marker's reason ("" for a marker without one); None: no marker

    @property
    def id(self) -> str:
        return f"{self.page.name}:{self.index}:{self.lang}"

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}, line {self.line}"


def fenced_blocks(page: Path) -> list[Block]:
    """The page's fenced code blocks, with the ``not-run`` marker just above each, if any."""
    blocks: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1).lower()
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        assert j < len(lines), f"{page.name}, line {start + 1}: a code block that never closes"
        above = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        marker = NOT_RUN.match(above)
        blocks.append(Block(page, len(blocks), lang, start + 1, "\n".join(lines[start + 1:j]) + "\n",
                            marker.group(1) if marker else None))
        i = j + 1
    return blocks


def prose(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks."""
    out, inside = [], False
    for line in page.read_text().splitlines():
        if inside:
            inside = line.strip() != "```"
        elif FENCE.match(line):
            inside = True
        else:
            out.append(line)
    return out


def runnable(page: Path) -> list[Block]:
    """The blocks this file runs (or skips, with the marker's reason)."""
    langs = PYTHON_LANGS | (SHELL_LANGS if page == README else set())
    return [b for b in fenced_blocks(page) if b.lang in langs]


BLOCKS = [b for page in PAGES for b in runnable(page)]


def run_env() -> dict[str, str]:
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def shell_commands(code: str) -> list[str]:
    """The block's commands: comments and blank lines dropped, ``\\`` continuations joined."""
    commands, current = [], ""
    for raw in code.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current = f"{current} {line}".strip()
        if current.endswith("\\"):
            current = current[:-1].rstrip()
            continue
        commands.append(current)
        current = ""
    if current:
        commands.append(current)
    return commands


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_example_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.not_run is not None:
        assert block.not_run, f"{block.where}: a not-run marker needs a reason: <!-- not-run: why -->"
        pytest.skip(f"{block.where}: {block.not_run}")
    if block.lang in PYTHON_LANGS:
        # in this process (torch is imported once; conftest already gives one thread and resets
        # Dynamo around each test), as a script named __main__ in the temporary folder
        script = tmp_path / "example.py"
        script.write_text(block.code)
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", [str(script)])
        try:
            runpy.run_path(str(script), run_name="__main__")
        except Exception as exc:
            raise AssertionError(f"{block.where} failed: {type(exc).__name__}: {exc}") from exc
        return
    commands = shell_commands(block.code)
    assert commands, f"{block.where}: an empty shell block"
    other = [c for c in commands if not CLI_LINE.match(c)]
    assert not other, f"{block.where}: only boost-* and python -m boost_compile lines run here: {other}"
    script = tmp_path / "example.sh"
    script.write_text("set -euo pipefail\n" + "\n".join(f"echo {shlex.quote('+ ' + c)}\n{c}" for c in commands) + "\n")
    cmd = ["bash", str(script)]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=run_env(), capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.where}: still running after {TIMEOUT_S} s\n{exc.stdout or ''}{exc.stderr or ''}")
    assert proc.returncode == 0, (
        f"{block.where} failed (exit {proc.returncode})\n--- code\n{block.code}"
        f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )


def test_some_examples_run() -> None:
    """The convention keeps working: the README's quickstart and tour are found and not skipped."""
    langs = {b.lang for b in BLOCKS if b.page == README and b.not_run is None}
    assert "python" in langs and "bash" in langs, langs


# ----------------------------------------------------------------------------- the pages


def test_readme_is_a_page() -> None:
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail into docs/ (at most {README_MAX_LINES})"
    assert "make test" in README.read_text() and "make train" in README.read_text()


@pytest.mark.parametrize("page", PAGES[1:], ids=[p.name for p in PAGES[1:]])
def test_doc_page_is_linked_and_summarised(page: Path) -> None:
    assert f"](docs/{page.name}" in README.read_text(), f"README.md does not link docs/{page.name}"
    lines = [line for line in page.read_text().splitlines() if line.strip()]
    assert lines[0].startswith("# "), f"docs/{page.name}: the first line is the title"
    summary = lines[1]
    assert not summary.startswith(("#", "```", "|", "-", "<!--")), (
        f"docs/{page.name}: a one-line summary follows the title, got {summary!r}")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_links_resolve(page: Path) -> None:
    broken = []
    for line in prose(page):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{target} (no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


# ----------------------------------------------------------------------------- docs/ command lines


def train_lines() -> list[tuple[str, str]]:
    """(where, command) for every boost-train launch in the shell blocks of docs/ (also under torchrun)."""
    out = []
    for page in PAGES[1:]:
        for block in fenced_blocks(page):
            if block.lang in SHELL_LANGS:
                out += [(f"{block.where}: {c}", c) for c in shell_commands(block.code)
                        if c.startswith("boost-train") or "-m boost_compile.train" in c]
    return out


TRAIN_LINES = train_lines()


def train_overrides(command: str) -> list[str]:
    """The Hydra overrides of a ``boost-train`` / ``torchrun ... -m boost_compile.train`` line:
    its words after the program, without flags (``--cfg job``), hydra's own keys and comments."""
    words = shlex.split(command, comments=True)
    start = words.index("boost_compile.train") + 1 if "boost_compile.train" in words else words.index("boost-train") + 1
    rest = words[start:]
    flags_with_values = {"--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-path", "-cp"}
    out, skip = [], False
    for word in rest:
        if skip:
            skip = False
        elif word in flags_with_values:
            skip = True
        elif not word.startswith("-") and not word.startswith("hydra."):
            out.append(word)
    return out


@pytest.mark.parametrize("where,command", TRAIN_LINES, ids=[w.split(": ", 1)[0] for w, _c in TRAIN_LINES])
def test_docs_train_lines_compose(where: str, command: str) -> None:
    """A training command of docs/ (minutes to hours of work, or several ranks) is not run, but its
    overrides must compose into a valid typed config: every key exists, every value has its type
    and is one of the field's choices."""
    from conftest import cfg_of

    from boost_compile.train.validate import to_train_config

    for overrides in sweep_jobs(train_overrides(command)):
        to_train_config(cfg_of(*overrides))


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The jobs a ``-m`` line sweeps, enough to check every value: ``key=a,b`` gives one job per
    value (the other swept keys at their first value); a line without a sweep is one job."""
    swept = [i for i, o in enumerate(overrides) if re.fullmatch(r"[\w./+~]+=[^()\[\]{}]*,[^()\[\]{}]*", o)]
    if not swept:
        return [overrides]
    first = [o.split(",")[0] if i in swept else o for i, o in enumerate(overrides)]
    jobs = []
    for i in swept:
        key, values = overrides[i].split("=", 1)
        jobs += [[*first[:i], f"{key}={v}", *first[i + 1:]] for v in values.split(",")]
    return jobs


def test_docs_hold_train_lines() -> None:
    assert len(TRAIN_LINES) >= 10, TRAIN_LINES
