"""The documentation holds together: every relative link in README.md and docs/*.md resolves (a `#anchor` into a
Markdown file names one of its headings), the README's command table shows only commands that `zerokl` has, and all
of them, and every test file the pages name exists. No engine starts: the command tree is read from the argparse parser
`zerokl.cli.build_parser` builds."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
EXTERNAL = ("http://", "https://", "mailto:")


def _prose(text: str) -> str:
    """The page without its fenced code blocks (links and headings there are not Markdown)."""
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(_prose(page.read_text(encoding="utf-8"))):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    return LINK.findall(_prose(page.read_text(encoding="utf-8")))


def test_every_relative_link_resolves() -> None:
    broken = []
    checked = 0
    for page in PAGES:
        for target in _links(page):
            if target.startswith(EXTERNAL) or target.startswith("#"):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve()
            checked += 1
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not resolved.exists():
                shown = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved
                broken.append(f"{where}: no such file or folder {shown}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{where}: no heading with anchor #{anchor} in {resolved.relative_to(ROOT)}")
    assert checked > 50, f"only {checked} relative links found in {len(PAGES)} pages: is the link pattern wrong?"
    assert not broken, "broken links:\n" + "\n".join(broken)


def _command_table() -> list[list[str]]:
    """The first cell of each row of the table under README.md's `## Commands`, as the words after `zerokl`."""
    section = re.search(r"^## Commands\s*$(.*?)(?=^## )", README.read_text(encoding="utf-8"), re.M | re.S)
    assert section, "README.md has no '## Commands' section"
    rows = []
    for line in section.group(1).splitlines():
        if not line.startswith("|"):
            continue
        first = line.strip("|").split("|")[0].strip()
        if first == "command" or set(first) <= set("-: "):
            continue  # header and separator rows
        m = re.fullmatch(r"`zerokl ([a-z][a-z0-9-]*(?: [a-z][a-z0-9-]*)*)`", first)
        assert m, f"README.md command table: first cell {first!r} is not `zerokl <command> [<subcommand>]`"
        rows.append(m.group(1).split())
    return rows


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _leaf_commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    subs = _subcommands(parser)
    if not subs:
        return {prefix}
    return {leaf for name, sub in subs.items() for leaf in _leaf_commands(sub, (*prefix, name))}


def test_command_table_matches_the_command_line() -> None:
    from zerokl.cli import build_parser

    parser = build_parser()
    rows = _command_table()
    assert rows, "README.md's command table has no rows"
    missing = []
    for words in rows:
        node = parser
        for i, word in enumerate(words):
            subs = _subcommands(node)
            if word not in subs:
                have = ", ".join(sorted(subs)) or "no subcommands"
                missing.append(f"zerokl {' '.join(words)}: `zerokl {' '.join(words[:i])}` has no {word!r} ({have})")
                break
            node = subs[word]
        else:
            if _subcommands(node):
                missing.append(f"zerokl {' '.join(words)}: names a command group; list its subcommands instead")
    assert not missing, "README.md's command table shows commands zerokl does not have:\n" + "\n".join(missing)

    shown = {tuple(words) for words in rows}
    unlisted = sorted(" ".join(("zerokl", *leaf)) for leaf in _leaf_commands(parser) - shown)
    assert not unlisted, "commands zerokl has that README.md's command table does not show:\n" + "\n".join(unlisted)


def test_every_test_file_named_exists() -> None:
    """Pages name tests by file (`test_quant.py`, `test_rollout*.py`), wherever under tests/ the file lives."""
    named = {name for page in PAGES for name in re.findall(r"`(test_[\w*]+\.py)", page.read_text(encoding="utf-8"))}
    assert named, "no test files named in README.md or docs/"
    missing = sorted(name for name in named if not any((ROOT / "tests").rglob(name)))
    assert not missing, "test files named in README.md or docs/ that are not under tests/:\n" + "\n".join(missing)
