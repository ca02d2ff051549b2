"""docs/ARCHITECTURE.md's file map names every source file of the core, the
binding and the Python package, and nothing that is not there."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
ARCH = REPO / "docs" / "ARCHITECTURE.md"

#: File-map section -> the directory its paths are relative to, and the files there.
SECTIONS = {
    "### The core: `rust/embstore-core/src`": ("rust/embstore-core/src", "**/*.rs"),
    "### The binding: `rust/embstore-py/src`": ("rust/embstore-py/src", "**/*.rs"),
    "### Python: `python/embstore`": ("python/embstore", "**/*.py"),
}


def _section(text: str, heading: str) -> str:
    start = text.index(heading) + len(heading)
    end = text.find("\n### ", start)
    return text[start : end if end >= 0 else len(text)]


def _named(section: str) -> set[str]:
    """The paths in the first column of the section's table."""
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            names.update(re.findall(r"`([^`]+\.(?:rs|py))`", first))
    return names


def test_the_file_map_names_every_source_file_and_only_those() -> None:
    text = ARCH.read_text()
    for heading, (root, pattern) in SECTIONS.items():
        base = REPO / root
        present = {p.relative_to(base).as_posix() for p in base.glob(pattern)}
        named = _named(_section(text, heading))
        assert named, heading
        assert not present - named, f"{heading}: not in the file map: {sorted(present - named)}"
        assert not named - present, (
            f"{heading}: in the map, not in the tree: {sorted(named - present)}"
        )


def test_the_map_reader_sees_a_table_row() -> None:
    section = "| file | concept |\n| --- | --- |\n| `a.rs`, `b/c.rs` | things |\n"
    assert _named(section) == {"a.rs", "b/c.rs"}
