"""The package's layering: no import cycle between modules, and the KV cache imports nothing
above it (ARCHITECTURE.md: `kvcache` imports nothing from the others; `cli` talks only to the
control API). Imports under `if TYPE_CHECKING:` are annotations, not dependencies."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "cli":
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: Path, module: str) -> set[str]:
    """Project modules `module` imports at run time (any depth of the file)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for sub in ast.walk(node):
                skip.add(id(sub))
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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


def _graph() -> dict[str, set[str]]:
    files = list((ROOT / "kvagentd").rglob("*.py")) + list((ROOT / "cli" / "kvctl").rglob("*.py"))
    modules = {_module_name(p): p for p in files}
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


def test_no_import_cycle() -> None:
    graph = {n: {d for d in deps if not n.startswith(d + ".")} for n, deps in _graph().items()}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_kvcache_imports_nothing_above_it() -> None:
    bad = {n: sorted(d for d in deps if not d.startswith("kvagentd.kvcache"))
           for n, deps in _graph().items() if n.startswith("kvagentd.kvcache")}
    assert {n: d for n, d in bad.items() if d} == {}


def test_kvctl_talks_only_to_the_control_api() -> None:
    bad = {n: sorted(d for d in deps if d.startswith("kvagentd"))
           for n, deps in _graph().items() if n.startswith("kvctl")}
    assert {n: d for n, d in bad.items() if d} == {}
