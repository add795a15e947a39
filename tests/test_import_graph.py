"""The modules of `anchorkv` import each other without a cycle.

The graph is read from the source with `ast`, not from a running interpreter: every import
statement counts, at module level or inside a function (a deferred import is still a
dependency), relative imports are resolved against the importing module's package, and
`from package import name` counts as an edge to `package.name` when that is a module, else to
the package's `__init__` (whose re-exports then carry the edge further); importing
`a.b.c` also counts as importing the packages `a.b` and `a` whose `__init__` it runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "anchorkv"


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _resolve(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _nearest(name: str, modules: dict[str, Path]) -> str | None:
    """`name` if it is a module of the package, else its closest enclosing one (an attribute
    of a module is a dependency on that module)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _packages_run(target: str, importer: str) -> list[str]:
    """The packages whose `__init__` importing `target` runs first (`import a.b.c` runs
    `a/__init__` and `a/b/__init__`), less the importer's own ancestors (already running) and
    the root `anchorkv` (docstring only)."""
    out = []
    pkg = target.rpartition(".")[0]
    while pkg and pkg != "anchorkv":
        if not (importer == pkg or importer.startswith(pkg + ".")):
            out.append(pkg)
        pkg = pkg.rpartition(".")[0]
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of `anchorkv` it imports (anywhere in its source)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = _package_of(name, path)
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, package)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                if t == "anchorkv" or t.startswith("anchorkv."):
                    mod = _nearest(t, modules)
                    if mod is not None:
                        edges.add(mod)
                        edges.update(_packages_run(mod, name))
        edges.discard(name)
        graph[name] = edges
    return graph


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): the modules that
    import each other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan; the package has far fewer modules than the recursion limit
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A shortest cycle (a closed path) through each module that is part of one; the same
    cycle once."""
    out: list[list[str]] = []
    seen: set[frozenset[tuple[str, str]]] = set()
    for comp in components(graph):
        for start in comp:
            path = _closed_path(graph, comp, start)
            key = frozenset(zip(path, path[1:], strict=False))
            if key not in seen:
                seen.add(key)
                out.append(path)
    return out


def _closed_path(graph: dict[str, set[str]], comp: list[str], start: str) -> list[str]:
    """A shortest cycle through `start` inside its strongly connected component `comp`."""
    members = set(comp)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{comp} is not strongly connected")


def test_the_graph_sees_every_kind_of_import():
    """The scan itself: relative, function-level and `from package import module` imports."""
    graph = import_graph()
    assert "anchorkv.cli" in graph and "anchorkv.store.cli" in graph["anchorkv.cli"]  # inside a function
    assert graph["anchorkv.codec"]  # a package's re-exports are its edges
    assert "anchorkv.codec" in graph["anchorkv.connector.config"]  # `from anchorkv.codec import ...`


def test_cycles_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}) == [["a", "b", "a"], ["c", "a", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(import_graph())
    for c in found:
        print("cycle: " + " -> ".join(c))
    assert not found, f"{len(found)} import cycles in anchorkv:\n" + "\n".join(" -> ".join(c) for c in found)


SCAFFOLDING = ("anchorkv.testing", "anchorkv.demo")


def test_the_library_does_not_import_its_scaffolding():
    """`anchorkv.testing` and the demo use the library, never the other way round."""
    graph = import_graph()
    reach_ins = {m: sorted(t for t in deps if t.startswith(SCAFFOLDING))
                 for m, deps in graph.items() if not m.startswith(SCAFFOLDING)}
    assert not {m: ts for m, ts in reach_ins.items() if ts}


if __name__ == "__main__":  # print the cycles: python tests/test_import_graph.py
    for c in cycles(import_graph()):
        print(" -> ".join(c))
    pytest.main([__file__, "-q"])
