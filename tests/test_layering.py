"""The package's layering: no import cycle between modules, and the KV cache imports nothing
above it (ARCHITECTURE.md: `kvcache` imports nothing from the others; `cli` talks only to the
control API). An import under `if TYPE_CHECKING:` is a dependency too: a circle of types is
one the code must be read around, so it counts as a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "cli":
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    """Project modules `module` imports, at run time or for types only (any depth of the
    file: inside functions and under `if TYPE_CHECKING:` as well)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return {m for m in out if m.split(".")[0] in ("kvagentd", "kvctl")}


def _graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = list((root / "kvagentd").rglob("*.py")) + list((root / "cli" / "kvctl").rglob("*.py"))
    modules = {_module_name(p, root): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for imp in _imports(path, name):
            # `from pkg import mod` names a module when one exists, else a member of pkg
            while imp and imp not in modules:
                imp = imp.rpartition(".")[0]
            if imp and imp != name and not name.startswith(imp + "."):
                deps.add(imp)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if d.startswith(n + "."):
                continue  # a package importing its own modules
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)) is not None:
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)) is not None:
            return c
    return None


def _module_cycle(root: Path = ROOT) -> list[str] | None:
    graph = {n: {d for d in deps if not n.startswith(d + ".")} for n, deps in _graph(root).items()}
    return _cycle(graph)


def test_no_import_cycle() -> None:
    cycle = _module_cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_type_only_circle_is_a_cycle(tmp_path: Path) -> None:
    """The checker itself: two modules that import each other, one of them only for its
    types, form a cycle (a checker blind to `TYPE_CHECKING` would pass this tree)."""
    pkg = tmp_path / "kvagentd"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from kvagentd.b import B\n")
    (pkg / "b.py").write_text("from kvagentd import a\n")
    assert _module_cycle(tmp_path) == ["kvagentd.a", "kvagentd.b", "kvagentd.a"]
    (pkg / "a.py").write_text("")
    assert _module_cycle(tmp_path) is None


def test_kvcache_imports_nothing_above_it() -> None:
    bad = {n: sorted(d for d in deps if not d.startswith("kvagentd.kvcache"))
           for n, deps in _graph().items() if n.startswith("kvagentd.kvcache")}
    assert {n: d for n, d in bad.items() if d} == {}


def test_kvctl_talks_only_to_the_control_api() -> None:
    bad = {n: sorted(d for d in deps if d.startswith("kvagentd"))
           for n, deps in _graph().items() if n.startswith("kvctl")}
    assert {n: d for n, d in bad.items() if d} == {}
