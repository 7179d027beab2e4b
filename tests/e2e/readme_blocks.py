"""README.md's fenced blocks and what its comments say they print: parsing and loose matching for
tests/e2e/test_readme.py (pure functions, no network).

A block's expected output is what the README shows beside it: in a shell block, the whole-line
`# ...` comments that follow a command (consecutive ones are one text), each found in the output
after the previous one; in a python block, the trailing `  # ...` comment of each `print(...)`
line: the block prints exactly those lines. Matching is loose the way a reader reads it: `...`
and `<placeholder>` stand for anything, runs of whitespace for any whitespace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FENCE = re.compile(r"^```(\w*)\s*$")
WILDCARD = re.compile(r"(\.\.\.|<[a-z][a-z ]*>)")
PRINT_COMMENT = re.compile(r"^\s*print\(.*\)\s{2,}#\s?(?P<said>.*)$")


@dataclass(frozen=True)
class Block:
    lang: str
    """`bash`, `python`, or "" (a plain block: shown output, a tree)."""
    line: int
    """1-based line of the opening fence."""
    text: str

    @property
    def label(self) -> str:
        return f"L{self.line}-{self.lang or 'text'}"


def readme_blocks(readme: str) -> list[Block]:
    blocks: list[Block] = []
    lang, start, body = None, 0, []
    for number, line in enumerate(readme.splitlines(), 1):
        fence = FENCE.match(line)
        if lang is None:
            if fence:
                lang, start, body = fence.group(1), number, []
        elif line.strip() == "```":
            blocks.append(Block(lang, start, "\n".join(body) + "\n"))
            lang = None
        else:
            body.append(line)
    if lang is not None:
        raise ValueError(f"README.md: the block at line {start} is never closed")
    return blocks


def shown_output(block: Block) -> list[str]:
    """What the README shows the block printing, in order (see the module's docstring)."""
    said: list[str] = []
    if block.lang == "python":
        return [m.group("said") for m in map(PRINT_COMMENT.match, block.text.splitlines()) if m]
    if block.lang != "bash":
        return said
    run: list[str] = []
    for line in block.text.splitlines() + [""]:
        if line.startswith("#"):
            run.append(line[1:].strip())
        elif run:
            said.append("\n".join(run))
            run = []
    return said


def loose(text: str, vary: dict[str, str] | None = None, one_line: bool = False) -> re.Pattern[str]:
    """`text` as a pattern: wildcards for `...` / `<x>`, `\\s+` for whitespace; each `vary` key
    found in `text` is replaced by its value first (wildcards allowed there too)."""
    for shown, real in (vary or {}).items():
        text = text.replace(shown, real)
    anything = ".*?" if one_line else r"[\s\S]*?"
    pieces = [anything if WILDCARD.fullmatch(part) else
              r"\s+".join(re.escape(w) for w in re.split(r"\s+", part))
              for part in WILDCARD.split(text)]
    body = "".join(pieces)
    return re.compile(rf"^\s*{body}\s*$" if one_line else body, re.MULTILINE)


def unmatched(said: list[str], output: str, vary: dict[str, str] | None = None,
              one_line: bool = False) -> str | None:
    """The first text of `said` not found in `output` (after the previous one), or None."""
    at = 0
    for text in said:
        found = loose(text, vary, one_line).search(output, at)
        if found is None:
            return text
        at = found.end()
    return None


def printed_differently(said: list[str], printed: str, vary: dict[str, str] | None = None
                        ) -> str | None:
    """Why a python block's prints are not the lines the README shows (None: they are)."""
    lines = printed.splitlines()
    if not said:
        return None  # the README shows nothing: nothing to compare
    if len(lines) != len(said):
        return f"the README shows {len(said)} printed lines, the block printed {len(lines)}"
    for shown, line in zip(said, lines, strict=True):
        if not loose(shown, vary, one_line=True).fullmatch(line):
            return f"the README shows {shown!r}, the block printed {line!r}"
    return None


def unaccounted(blocks: list[Block], markers: list[str]) -> list[str]:
    """What is wrong with `markers` (one per README block, in order: each found in exactly one
    block's text) as an account of `blocks`; [] when nothing is."""
    problems = []
    owner: list[int] = []
    for block in blocks:
        found = [i for i, marker in enumerate(markers) if marker in block.text]
        if len(found) != 1:
            problems.append(f"README.md block at line {block.line} ({block.lang or 'text'}) "
                            f"matches {len(found)} entries (it must run, or be listed with why "
                            f"not):\n{block.text}")
        else:
            owner.append(found[0])
    for marker in markers:
        hits = [b.line for b in blocks if marker in b.text]
        if len(hits) != 1:
            problems.append(f"entry {marker!r} matches the blocks at lines {hits}")
    if owner != sorted(owner):
        problems.append("the entries are not in the README's order")
    return problems
