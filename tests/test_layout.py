"""The house's rules, kept true by a test: no import circle among the core
crate's files (the package's: tests/test_imports.py), no core file over 500 lines of code
or 600 physical lines before its tests, no package file over 900 lines, the format and mapped
modules name no table code, reading and stepping import nothing of each
other, rows reached only through the storage's API, a core Table of at most 90
methods (a facade; each concern's helpers on a view), and front ends that
branch on no tier's class."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
CORE = REPO / "rust" / "embstore-core" / "src"
PKG = REPO / "python" / "embstore"


def _code(path: pathlib.Path) -> str:
    """A Rust file's text before its `mod tests`, without comment lines."""
    text = path.read_text().split("#[cfg(test)]\nmod tests")[0]
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("//"))


def _rust_modules() -> dict[str, pathlib.Path]:
    return {p.relative_to(CORE).as_posix(): p for p in CORE.rglob("*.rs")}


def _module_path(rel: str) -> list[str]:
    parts = rel[:-3].split("/")
    return parts[:-1] if parts[-1] in ("mod", "lib") else parts


def _file_of(parts: list[str], files: dict[str, pathlib.Path]) -> str | None:
    """The file that defines the longest prefix of the path `parts`."""
    for n in range(len(parts), -1, -1):
        pre = parts[:n]
        for cand in ("/".join(pre) + ".rs", "/".join([*pre, "mod.rs"]) if pre else "lib.rs"):
            if cand in files:
                return cand
    return None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def rust_import_graph() -> dict[str, set[str]]:
    """File -> files it names (`crate::...`, `super::...`), leaving out a
    file's own ancestors' `mod.rs` (the module tree, not an import)."""
    files = _rust_modules()
    graph: dict[str, set[str]] = {}
    for rel, path in files.items():
        me = _module_path(rel)
        code = _code(path)
        deps: set[str] = set()
        for m in re.finditer(r"\bcrate((?:::\w+)+)", code):
            deps.add(_file_of(m.group(1).strip(":").split("::"), files) or rel)
        for m in re.finditer(r"\bsuper((?:::\w+)+)", code):
            deps.add(_file_of([*me[:-1], *m.group(1).strip(":").split("::")], files) or rel)
        graph[rel] = {
            d
            for d in deps
            if d != rel
            and not (
                len(_module_path(d)) < len(me) and me[: len(_module_path(d))] == _module_path(d)
            )
        }
    return graph


def test_no_import_circle_among_the_core_crates_files() -> None:
    assert _cycles(rust_import_graph()) == []


def test_the_circle_check_finds_a_circle() -> None:
    graph = rust_import_graph()
    graph["format/files.rs"] = graph["format/files.rs"] | {"format/manifest.rs"}
    assert ["format/files.rs", "format/manifest.rs"] in _cycles(graph)


def test_no_core_file_over_500_lines_of_code_before_its_tests() -> None:
    sizes = {
        rel: sum(1 for line in _code(p).splitlines() if line.strip())
        for rel, p in _rust_modules().items()
    }
    assert {rel: n for rel, n in sizes.items() if n > 500} == {}


def test_no_core_file_over_600_physical_lines_before_its_tests() -> None:
    """Every line counts here (comments and blank lines too): a file that
    must be read whole to change stays short enough to read."""
    sizes = {
        rel: len(p.read_text().split("#[cfg(test)]\nmod tests")[0].splitlines())
        for rel, p in _rust_modules().items()
    }
    assert {rel: n for rel, n in sizes.items() if n > 600} == {}


def test_no_package_file_over_900_lines() -> None:
    sizes = {
        p.relative_to(PKG).as_posix(): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")
    }
    assert {rel: n for rel, n in sizes.items() if n > 900} == {}


def test_the_format_and_mapped_modules_name_no_table_code() -> None:
    for sub in ("format", "mapped"):
        for p in (CORE / sub).rglob("*.rs"):
            assert "crate::table" not in p.read_text(), p


def test_reading_and_stepping_import_nothing_of_each_other() -> None:
    for a, b in (("read", "step"), ("step", "read")):
        for p in (CORE / "table" / a).rglob("*.rs"):
            assert f"crate::table::{b}" not in _code(p), p


def test_rows_are_reached_only_through_the_storage() -> None:
    for p in (CORE / "table").rglob("*.rs"):
        if "storage" not in p.relative_to(CORE / "table").parts:
            assert not re.search(r"\.arena\b", p.read_text()), p


_FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(unsafe\s+)?fn\s+(\w+)")


def table_methods(files: dict[str, pathlib.Path] | None = None) -> dict[str, list[str]]:
    """File -> the methods of its `impl Table { ... }` blocks (before its
    tests): the core Table's methods wherever they are defined."""
    out: dict[str, list[str]] = {}
    for rel, path in (files or _rust_modules()).items():
        text = path.read_text().split("#[cfg(test)]\nmod tests")[0]
        depth, at = 0, None
        for line in text.splitlines():
            if at is None and re.match(r"^impl(<[^>]*>)?\s+Table\s*\{", line.strip()):
                at = depth
            elif at is not None and depth == at + 1 and (m := _FN.match(line)):
                out.setdefault(rel, []).append(m.group(5))
            depth += line.count("{") - line.count("}")
            if at is not None and depth <= at:
                at = None
    return out


def test_the_core_table_is_a_facade_of_at_most_90_methods() -> None:
    """Each concern's helpers are methods of a view (table/views.rs), not
    of the Table."""
    methods = table_methods()
    assert sum(len(v) for v in methods.values()) <= 90, methods


def test_the_method_count_sees_a_method_added(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "x.rs"
    src.write_text(
        "impl Table {\n    pub fn a(&self) {\n        if x { }\n    }\n"
        "    pub(crate) fn b(&self) {}\n}\nimpl Other {\n    fn c() {}\n}\n"
    )
    assert table_methods({"x.rs": src}) == {"x.rs": ["a", "b"]}
