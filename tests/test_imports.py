"""The package's modules import each other without circles.

Every ``import`` statement of every module under ``python/hrockmate`` counts, at module level
or inside a function: a lazy import hides a circle from the interpreter, not from a reader,
and it becomes an import error the day someone hoists it. Imports of another package's
modules are ignored; ``from hrockmate.x import y`` counts as an import of ``hrockmate.x.y``
when that is a module, else of ``hrockmate.x``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "hrockmate"


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> its file, for every ``.py`` file of the package."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules that module ``name`` (file ``path``) imports anywhere in its code."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.split(".")[0] == PACKAGE.name:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif target in known:
                    out.add(target)
    out.discard(name)
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    files = module_files(root)
    known = set(files)
    return {name: imported_modules(name, path, known) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_checker_finds_a_circle_through_a_lazy_import(tmp_path: Path) -> None:
    pkg = tmp_path / "hrockmate"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from hrockmate.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("import hrockmate.a\n")
    (pkg / "d.py").write_text("from hrockmate.a import x\nimport json\n")
    graph = import_graph(pkg)
    assert graph["hrockmate.sub.b"] == {"hrockmate.c"}
    assert graph["hrockmate.d"] == {"hrockmate.a"}
    assert cycles(graph) == [["hrockmate.a", "hrockmate.c", "hrockmate.sub.b"]]


def test_no_import_circles_in_the_package() -> None:
    graph = import_graph()
    assert "hrockmate.capture.costs" in graph  # (the package was found)
    found = cycles(graph)
    assert not found, "import circles among hrockmate modules: " + "; ".join(
        " <-> ".join(c) for c in found)
