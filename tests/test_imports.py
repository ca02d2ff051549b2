"""The package's import graph: the tiers stack through embstore.protocol,
so no module imports one that (directly or not) imports it back, counting
type-only imports (those under ``if TYPE_CHECKING:``) too."""

from __future__ import annotations

import ast
import pathlib

import embstore

ROOT = pathlib.Path(embstore.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(("embstore", *parts))] = p
    return mods


def _graph(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
        for t in targets:
            if t not in mods:
                continue
            graph[name].add(t)
            # Importing a.b.c runs the packages a.b first (unless the
            # importer is inside that package, which is then importing).
            parts = t.split(".")
            for i in range(2, len(parts)):
                parent = ".".join(parts[:i])
                if parent in mods and not name.startswith(parent + ".") and parent != name:
                    graph[name].add(parent)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if v == u or v == "embstore":
                continue  # the root package is every module's parent
            if state.get(v) == 1:
                found.append([*stack[stack.index(v) :], v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_no_module_of_the_package_is_in_an_import_circle() -> None:
    cycles = _cycles(_graph(_modules()))
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"embstore.a": {"embstore.b"}, "embstore.b": {"embstore.a"}, "embstore.c": set()}
    assert _cycles(graph) == [["embstore.a", "embstore.b", "embstore.a"]]


def test_the_distributed_tier_uses_no_native_module_and_no_private_table_method() -> None:
    mods = _modules()
    for name in [m for m in mods if m.startswith("embstore.distributed")]:
        tree = ast.parse(mods[name].read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert not any(a.name == "_core" for a in node.names), name
                assert node.module != "embstore._core", name
            if isinstance(node, ast.Attribute) and node.attr in ("_adopt", "_inner"):
                raise AssertionError(f"{name} uses Table.{node.attr}")


def test_the_old_name_of_sharded_collection_warns_and_is_the_same_class() -> None:
    import pytest

    from embstore import distributed

    with pytest.warns(DeprecationWarning, match="ShardedCollection"):
        old = distributed.Collection  # type: ignore[attr-defined]
    assert old is distributed.ShardedCollection
    with pytest.raises(AttributeError):
        _ = distributed.NoSuchThing  # type: ignore[attr-defined]


def test_the_old_module_path_of_the_sharded_tier_warns_and_gives_the_same_classes() -> None:
    import pytest

    from embstore import distributed
    from embstore.distributed import mpi

    for name, new in (
        ("ShardedTable", distributed.ShardedTable),
        ("ShardedCollection", distributed.ShardedCollection),
    ):
        with pytest.warns(DeprecationWarning, match=f"embstore.distributed.mpi.{name}"):
            assert getattr(mpi, name) is new
    with pytest.raises(AttributeError):
        _ = mpi.NoSuchThing  # type: ignore[attr-defined]
