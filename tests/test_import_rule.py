"""The import rule of docs/ARCHITECTURE.md, checked on the source (``ast``, every import
statement at any depth: module level, inside functions, under ``TYPE_CHECKING``).

* ``mlscope`` imports none of the other top-level packages;
* ``agent`` and ``broker`` build on ``mlscope`` only (they do not import each other);
* ``analysis`` imports only ``mlscope``; ``dashboard`` imports ``analysis`` and ``mlscope``;
* nothing imports ``cli`` except ``cli``;
* no two modules import each other, directly or around a longer loop;
* a module's ``__all__`` lists only names it defines, so each name is imported from
  the module that defines it (a package's ``__init__`` may list its own submodules'
  names as its API: :data:`PACKAGE_APIS`, and a package of private submodules,
  :data:`PRIVATE_PARTS`, lists every name they define and is the one place they are
  imported from);
* product code checks what it relies on with typed errors, never ``assert`` (which
  ``python -O`` strips and which no boundary translates).

Framework predictors are imported by name (``importlib``) and are not seen here; they
are plain ``agent`` modules, held to the same rule.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mlscope", "agent", "broker", "analysis", "dashboard", "cli")
ALLOWED: Mapping[str, frozenset[str]] = {
    "mlscope": frozenset({"mlscope"}),
    "agent": frozenset({"agent", "mlscope"}),
    "broker": frozenset({"broker", "mlscope"}),
    "analysis": frozenset({"analysis", "mlscope"}),
    "dashboard": frozenset({"dashboard", "analysis", "mlscope"}),
    "cli": frozenset(PACKAGES),
}
"""Top-level package -> the top-level packages of ours it may import."""
PACKAGE_APIS: Mapping[str, frozenset[str]] = {
    "agent.profiling": frozenset({"NULL", "Capture", "FrameworkProfiler"}),
}
"""Package -> the names of its submodules its ``__init__`` lists as the package's API
(``agent.profiling``: :func:`capture` gives a ``Capture``, ``NULL`` when no profiler)."""
PRIVATE_PARTS = frozenset({"mlscope.contracts"})
"""Packages split into private submodules (``_jobs``, ``_control``...): the package is
the one name everything else imports from."""


def module_name(path: Path, root: Path) -> tuple[str, bool]:
    """``broker/db.py`` -> ("broker.db", False); ``agent/__init__.py`` -> ("agent", True)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def imported_names(module: str, is_package: bool, source: str) -> list[tuple[str, list[str]]]:
    """Every import statement of ``source`` as (module named, names imported from it):
    ``import a.b`` -> ("a.b", []), ``from .c import d`` -> ("<package>.c", ["d"])."""
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: None if is_package else -1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            out.append((base, [alias.name for alias in node.names]))
    return out


def import_graph(sources: Mapping[str, tuple[bool, str]]) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` it imports: ``from a import b`` names the
    module ``a.b`` when there is one, else ``a``; any other name resolves to the nearest
    enclosing module (``broker.db.Database`` -> ``broker.db``)."""

    def nearest(name: str) -> str:
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for module, (is_package, source) in sources.items():
        targets: set[str] = set()
        for base, names in imported_names(module, is_package, source):
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in sources]
            targets.update(subs if len(subs) == len(names) and names else [nearest(base)])
            targets.update(subs)
        graph[module] = targets - {module, ""}
    return graph


def violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Each import that breaks the package rule, as ``a.b -> c.d``."""
    out: list[str] = []
    for module, targets in sorted(graph.items()):
        top = module.split(".")[0]
        allowed = ALLOWED.get(top, frozenset(PACKAGES))
        out.extend(
            f"{module} -> {t}"
            for t in sorted(targets)
            if t.split(".")[0] in PACKAGES and t.split(".")[0] not in allowed
        )
    return out


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def module_level(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node of ``tree`` outside function and class bodies."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            todo.extend(ast.iter_child_nodes(node))


def reexported(source: str) -> list[str]:
    """The names of ``__all__`` that the module binds only by importing them."""
    listed: list[str] = []
    imported: set[str] = set()
    bound: set[str] = set()
    for node in module_level(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            and isinstance(node.value, ast.List | ast.Tuple)
        ):
            listed = [str(e.value) for e in node.value.elts if isinstance(e, ast.Constant)]
    return [name for name in listed if name in imported and name not in bound]


def our_sources() -> dict[str, tuple[bool, str]]:
    sources = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name, is_package = module_name(path, ROOT)
            sources[name] = (is_package, path.read_text(encoding="utf-8"))
    return sources


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(our_sources())


def test_packages_import_one_way(graph: dict[str, set[str]]) -> None:
    assert violations(graph) == []


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def defined_names(source: str) -> set[str]:
    """The names a module binds at its top level by a definition or an assignment."""
    bound: set[str] = set()
    for node in module_level(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    return bound


def private_parts_api(sources: Mapping[str, tuple[bool, str]], package: str) -> set[str]:
    """Every name the private submodules of ``package`` define."""
    prefix = f"{package}._"
    return set().union(*(defined_names(s) for m, (_, s) in sources.items() if m.startswith(prefix)))


def test_names_are_listed_where_they_are_defined() -> None:
    sources = our_sources()
    apis = {**PACKAGE_APIS, **{p: frozenset(private_parts_api(sources, p)) for p in PRIVATE_PARTS}}
    found = {m: set(reexported(source)) for m, (_, source) in sources.items()}
    extra = {m: sorted(names - apis.get(m, frozenset())) for m, names in found.items()}
    assert {m: names for m, names in extra.items() if names} == {}
    assert found["agent.profiling"] == PACKAGE_APIS["agent.profiling"]  # the check sees it


def test_private_parts_are_imported_from_their_package(graph: dict[str, set[str]]) -> None:
    """Only a package's own modules import its private submodules; everything else
    imports the package (``from mlscope.contracts import JobRequest``)."""
    outside = {
        (m, target)
        for m, targets in graph.items()
        for target in targets
        for package in PRIVATE_PARTS
        if target.startswith(f"{package}._") and not (m == package or m.startswith(f"{package}."))
    }
    assert outside == set()
    assert "mlscope.contracts._jobs" in graph["mlscope.contracts"]  # the check sees them
    assert private_parts_api(our_sources(), "mlscope.contracts") >= {"JobRequest", "SCHEMA"}


def asserts(source: str) -> list[int]:
    """Lines of the ``assert`` statements in ``source``."""
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Assert)]


def test_product_code_has_no_assert() -> None:
    found = {m: asserts(source) for m, (_, source) in our_sources().items()}
    assert {m: lines for m, lines in found.items() if lines} == {}
    assert asserts("def f(x):\n    if x:\n        assert x > 1\n") == [3]  # the check sees one


def test_the_graph_sees_our_modules(graph: dict[str, set[str]]) -> None:
    # a checker that parsed nothing would pass the two tests above
    assert len(graph) > 100
    assert "mlscope.contracts" in graph["broker.evaluate"]


SYNTHETIC = {
    "mlscope": (True, ""),
    "mlscope.zoo": (True, ""),
    "mlscope.zoo.build": (False, "def f():\n    from ...agent import operators\n"),
    "agent": (True, ""),
    "agent.operators": (False, "import numpy\nfrom mlscope.zoo import build\n"),
    "dashboard": (True, ""),
    "dashboard.page": (False, "if True:\n    import cli.submit as s\n"),
    "cli": (True, ""),
    "cli.submit": (False, "from cli import helpers\n"),
    "cli.helpers": (False, "from . import submit\n"),
}


def test_the_checker_finds_a_violating_import() -> None:
    graph = import_graph(SYNTHETIC)
    assert violations(graph) == [
        "dashboard.page -> cli.submit",
        "mlscope.zoo.build -> agent.operators",
    ]


def test_the_checker_finds_a_cycle() -> None:
    graph = import_graph(SYNTHETIC)
    assert sorted(cycles(graph)) == [
        ["agent.operators", "mlscope.zoo.build"],
        ["cli.helpers", "cli.submit"],
    ]


def test_the_checker_finds_a_reexport() -> None:
    source = (
        "from a import b, c\nimport d.e\nfrom f import g as h\nc = 1\n"
        "if True:\n    def i(): pass\n__all__ = ['b', 'c', 'd', 'h', 'i']\n"
    )
    assert reexported(source) == ["b", "d", "h"]
