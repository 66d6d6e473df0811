"""Every command line the docs quote (README.md, CONTRIBUTING.md, docs/*.md, tutorials, how-tos), as a reader copies it.

A command line is a line of a fenced ``bash`` block (backslash continuations joined), a ``$ `` line of
any other block (the lines under it, up to the next ``$ `` line, are its documented output), or an
inline code span that starts with a program (``moe-lit``, ``make``, ``python``, ...) and is no error
line (``moe-lit fit: error: ...`` is output). A trailing ``# comment`` goes, ``a | b`` and ``a && b``
are two commands, and ``[--flag X]`` counts as given.
"""

import re
import shlex
from dataclasses import dataclass

from tests.helpers.paths import REPO

DOCS = (
    "README.md",
    "CONTRIBUTING.md",
    *sorted(
        p.relative_to(REPO).as_posix()
        for folder in ("", "tutorials/", "howto/")
        for p in (REPO / "docs").glob(f"{folder}*.md")
    ),
)
"""The pages whose commands are checked: the reference pages (docs/reference/, generated) quote none."""
PROGRAMS = ("moe-lit", "make", "python", "pip", "srun", "torchrun", "bash", "lm_eval")
"""First words that make an inline code span a command line (besides ``.venv/bin/...``; a lone
``export`` in running text is the moe-lit command, not the shell's)."""
SEPARATORS = ("|", "&&")
_FENCE = re.compile(r"^\s*```(\w*)")
_SPAN = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class DocCommand:
    """One command line of a doc: where it is, its words, how it was quoted, its documented output."""

    where: str
    """``docs/training.md:12``"""
    argv: tuple[str, ...]
    inline: bool
    """Quoted in running text (often a fragment: ``moe-lit eval``), not in a block."""
    output: tuple[str, ...] = ()
    """The lines a ``$ `` block shows under the command."""

    @property
    def program(self) -> str:
        return self.argv[0]

    @property
    def synopsis(self) -> bool:
        """A usage pattern rather than a command to paste: inline, ``...`` or ``a|b`` alternatives."""
        return (
            self.inline
            or any(word == "..." or word.endswith("...") for word in self.argv)
            or any("|" in word for word in self.argv[:3])
        )

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def doc_commands(docs=DOCS) -> list[DocCommand]:
    """The command lines of ``docs`` (paths relative to the repository), in document order."""
    found = []
    for doc in docs:
        found += _commands_of(doc, (REPO / doc).read_text().splitlines())
    return found


def _commands_of(doc: str, lines: list[str]) -> list[DocCommand]:
    found: list[DocCommand] = []
    fence: str | None = None
    i = 0
    while i < len(lines):
        start, line = i, lines[i]
        opened = _FENCE.match(line)
        if opened:
            fence = None if fence is not None else opened.group(1) or "text"
        elif fence == "bash" and line.strip() and not line.strip().startswith("#"):
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            found += _split(f"{doc}:{start + 1}", line, inline=False)
        elif fence is not None and line.startswith("$ "):
            output = []
            while i + 1 < len(lines) and not lines[i + 1].startswith(("$ ", "```")):
                i += 1
                output.append(lines[i])
            found += _split(f"{doc}:{start + 1}", line[2:], inline=False, output=tuple(output))
        elif fence is None:
            for span in _SPAN.findall(line):
                first = span.split()[0] if span.split() else ""
                if (first in PROGRAMS or first.startswith(".venv/bin/")) and ": error: " not in span:
                    found += _split(f"{doc}:{start + 1}", span, inline=True)
        i += 1
    return found


def _split(where: str, text: str, inline: bool, output: tuple[str, ...] = ()) -> list[DocCommand]:
    """The commands of one line: shell words without the comment and brackets, cut at ``|`` / ``&&``."""
    words = [_unbracketed(word) for word in shlex.split(text, comments=True)]
    commands, current = [], []
    for word in [*words, SEPARATORS[0]]:
        if word in SEPARATORS:
            if current:
                commands.append(DocCommand(where, tuple(current), inline, output if not commands else ()))
            current = []
        elif word:
            current.append(word)
    return commands


def _unbracketed(word: str) -> str:
    """``[--data`` -> ``--data``, ``DIR]`` -> ``DIR``, ``[--force]`` -> ``--force``; ``moe_lit[benchmarks]`` stays."""
    word = word.removeprefix("[")
    return word.removesuffix("]") if word.endswith("]") and "[" not in word else word
