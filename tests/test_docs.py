"""The docs against the code: every ``swarm``, ``swarm-node`` and ``swarm-coordinator`` command line in
a shell block parses with the real parser, every ``--flag`` quoted inline exists, and every relative
link (and its anchor) resolves."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from swarm.coordinator import cli as coordinator_cli
from swarm.node import cli as node_cli

from bench import scaling as bench_scaling
from swarm import cli as swarm_cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "swarm": swarm_cli.build_parser,
    "swarm-node": node_cli.build_parser,
    "swarm-coordinator": coordinator_cli.build_parser,
}
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
# Placeholders the docs write in capitals, and the sample values a command line gets instead.
PLACEHOLDERS = {
    "COORD": "203.0.113.7",
    "HOST": "203.0.113.8",
    "NODE": "203.0.113.9",
    "NAME": "alice",
    "PATH": "/tmp/swarm-docs/file",
    "DIR": "/tmp/swarm-docs/dir",
    "ID": "3f9c2a",
}
# Benchmarks the docs quote with flags (run as ``python -m bench.NAME``): their flags count as known.
BENCH_PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "bench.scaling": bench_scaling.build_parser,
}
# Flags of other tools that the docs quote inline, with the tool they belong to.
OTHER_TOOLS_FLAGS = {
    "--gpus": "docker run",
    "--full": "systemctl edit",
}
FENCE = re.compile(r"^```(\S*)\n(.*?)^```\s*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)


class Command(NamedTuple):
    where: str  # doc:line
    line: str  # as written
    program: str
    argv: list[str]


def fenced_blocks(text: str) -> Iterator[tuple[str, str, int]]:
    """(language, body, line number of the body's first line) of every fenced block."""
    for m in FENCE.finditer(text):
        yield m.group(1), m.group(2), text.count("\n", 0, m.start(2)) + 1


def prose(text: str) -> str:
    """``text`` without its fenced blocks."""
    return FENCE.sub("", text)


def with_samples(line: str) -> str:
    """``line`` with ``$(...)``, ``$VAR`` and the capitalised placeholders replaced by sample values."""
    line = re.sub(r"\$\([^()]*\)", "sample", line)
    line = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", "sample", line)
    return re.sub(r"\b(" + "|".join(PLACEHOLDERS) + r")\b", lambda m: PLACEHOLDERS[m.group(1)], line)


def commands_in(doc: Path) -> Iterator[Command]:
    """Every command line of ours in the shell blocks of ``doc`` (continuation lines joined)."""
    name = doc.relative_to(ROOT).as_posix()
    for language, body, first in fenced_blocks(doc.read_text()):
        if language not in SHELL_BLOCKS:
            continue
        pending, start = "", 0
        for i, raw in enumerate(body.splitlines()):
            if not pending:
                start = first + i
            pending += raw
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            line, pending = pending.strip(), ""
            words = shlex.split(with_samples(line), comments=True)
            while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value before it
                words.pop(0)
            if words and words[0].rsplit("/", 1)[-1] in PARSERS:
                yield Command(f"{name}:{start}", line, words[0].rsplit("/", 1)[-1], words[1:])


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of ``parser`` and of its subcommands' parsers."""
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= option_strings(sub)
    return found


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """The anchors of ``doc``'s headings (a repeated heading's get ``-1``, ``-2``... as on GitHub)."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for heading in HEADING.findall(prose(doc.read_text())):
        base = slug(heading)
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


COMMANDS = [c for doc in DOCS for c in commands_in(doc)]


def test_the_docs_exist_and_quote_every_program():
    assert all(doc.exists() for doc in DOCS)
    assert {c.program for c in COMMANDS} == set(PARSERS)


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_every_documented_command_line_parses(command: Command):
    parser = PARSERS[command.program]()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(command.argv)
    except SystemExit as e:
        if e.code == 0 and {"-h", "--help"} & set(command.argv):
            return
        pytest.fail(f"{command.where}: {command.line}\n{err.getvalue().strip()}")


def test_every_inline_flag_exists():
    builders = [*PARSERS.values(), *BENCH_PARSERS.values()]
    known = set(OTHER_TOOLS_FLAGS).union(*(option_strings(build()) for build in builders))
    unknown = []
    for doc in DOCS:
        for _, code in INLINE_CODE.findall(prose(doc.read_text())):
            where = f"{doc.relative_to(ROOT)}: `{code}`"
            unknown += [where for flag in FLAG.findall(code) if flag not in known]
    assert not unknown, "flags no parser has:\n" + "\n".join(unknown)


def test_every_relative_link_resolves():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(prose(doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (doc.parent / path).resolve() if path else doc
            if not linked.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_module_map_names_every_package():
    """docs/architecture.md has a row for every package: ``swarm/x/``, ``node/``, ``coordinator/``."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    folders = [p.parent for p in (ROOT / "swarm").glob("*/__init__.py")] + [
        ROOT / "node",
        ROOT / "coordinator",
    ]
    names = [folder.relative_to(ROOT).as_posix() + "/" for folder in folders]
    missing = sorted(name for name in names if f"`{name}`" not in text)
    assert not missing, f"docs/architecture.md lacks: {missing}"
