"""The package stack of docs/design.md, checked on every import under purine/:
imports point downward only, and neither packages nor modules import each other in a circle.

How the imports are read (with ``ast``; nothing is executed):
- every ``import`` and ``from ... import``: at module level, inside function bodies (deferred)
  and under ``if TYPE_CHECKING:``; relative imports are resolved against the importing module.
  ``from P import name`` points at the module ``P.name`` when that is a module, else at ``P``.
- A TYPE_CHECKING import is no runtime edge, but an annotation that names a class is knowledge
  of its module: such imports count like the others for all three rules, (1) imports point
  down the table, (2) no cycle between packages, (3) no cycle between modules; the failure
  messages name each import's kind (module level, deferred, type_checking).
- Importing ``P.Q.m`` runs ``P/__init__`` and ``P/Q/__init__`` first: for rule (3) it also points
  at those package modules (the ones that are not the importer's own parents). Within a
  package, modules import each other freely, but not in a circle.
- ``converters.X`` (the tools' old top-level name) is read as ``purine.converters.X``.

Today's tree breaks the table in known ways (issue 14): EXCEPTIONS names each offending edge
with its reason and the issue-14 step that removes it. The list may only shrink: an exception
whose import is gone, or that no longer breaks a rule, fails the test.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (folder, the dotted name its modules import under)
SOURCES = ((REPO / "purine", "purine"),)

# The layer table, bottom to top: package -> the packages it may import (besides itself).
# Packages are purine's subpackages and top-level modules; "purine" is purine/__init__.py.
# Each row names only rows listed before it (test_layer_table_is_bottom_up), so the table is
# acyclic. Not transitive: backend stands on graph (Location), ops on backend, yet
# ops "knows nothing of graphs".
BASE = ("purine", "errors", "log")
CORE = (*BASE, "graph", "backend", "ops", "runtime")
CAFFE = (*CORE, "formats", "data", "caffe")
LAYERS: dict[str, tuple[str, ...]] = {
    "purine": (),                          # the version string only
    "errors": ("purine",),
    "log": ("purine", "errors"),
    "zoo": BASE,                           # where the shipped models/ nets live
    "graph": BASE,                         # Blob, Op, Graph, Location; no Caffe, no numpy/cupy
    "backend": (*BASE, "graph"),           # the array module per Location, devices, streams
    "ops": (*BASE, "backend"),             # kernels over arrays; no graphs, no Caffe
    "runtime": (*BASE, "graph", "backend", "ops"),  # dispatcher, memory planner, trace
    "formats": BASE,                       # Caffe's files: caffe_pb2, readers, upgrade, codecs
    "data": (*BASE, "backend", "formats"),  # sources, Datum decoding, transforms; no graphs
    "caffe": (*CORE, "formats", "data"),   # layer registry and builders, Net, Solver
    "parallel": CAFFE,                     # schemes as graph rewrites above the solver
    "converters": CAFFE,                   # offline file tools (installed as purine.converters)
    "draw": CAFFE,                         # draw_net
    "pycaffe": (*CAFFE, "parallel", "draw"),  # the pycaffe-compatible face over purine.caffe
    "timing": CAFFE,                       # the `time` command's per-layer timing
    "datasets": (*BASE, "formats", "data", "zoo", "converters"),  # MNIST, via convert_imageset
    "demo": (*CAFFE, "zoo", "converters", "datasets"),  # `purine-caffe demo`
    "cli": (*CAFFE, "zoo", "parallel", "pycaffe", "converters", "draw", "timing", "datasets",
            "demo"),                       # the purine-caffe command
}
ALLOWED = {pkg: frozenset(may) for pkg, may in LAYERS.items()}

# Modules that a package may not import although their package is below it.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # parallel "knows nothing of Caffe layers": the registry and the builders.
    "parallel": ("purine.caffe.layer", "purine.caffe.layers"),
}


@dataclass(frozen=True)
class KnownEdge:
    """One tolerated edge: every import of ``imported`` by ``importer``."""

    importer: str
    imported: str
    step: int      # the item of issue 14's "What to build" that removes it
    reason: str


# Root causes, named once (issue 14, first section); each entry of EXCEPTIONS cites one.

E = KnownEdge
EXCEPTIONS: tuple[KnownEdge, ...] = (
)


# -- reading the imports ---------------------------------------------------------------------

@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    kind: str      # "module" (runs on import), "deferred" (in a function), "type_checking"
    line: int


def canonical(name: str) -> str:
    if name == "converters" or name.startswith("converters."):
        return "purine." + name
    return name


def discover(sources: Iterable[tuple[Path, str]] = SOURCES) -> dict[str, tuple[Path, bool]]:
    """Every module: dotted name -> (file, is a package's __init__)."""
    modules: dict[str, tuple[Path, bool]] = {}
    for folder, prefix in sources:
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            modules[".".join((prefix, *parts))] = (path, is_pkg)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(nodes: Iterable[ast.AST], kind: str
                ) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, kind
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            inner = "deferred" if kind == "module" else kind
            yield from _statements(ast.iter_child_nodes(node), inner)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _statements(node.body, "type_checking")
            yield from _statements(node.orelse, kind)
        else:
            yield from _statements(ast.iter_child_nodes(node), kind)


def _known(name: str, modules: dict[str, tuple[Path, bool]]) -> str:
    """The longest prefix of ``name`` that is a module of the tree."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or name


def read_imports(modules: dict[str, tuple[Path, bool]]) -> list[Import]:
    """Every import of a project module by a project module, sorted."""
    found: set[Import] = set()
    for importer, (path, is_pkg) in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        here = importer.split(".") if is_pkg else importer.split(".")[:-1]
        for stmt, kind in _statements(tree.body, "module"):
            if isinstance(stmt, ast.Import):
                targets = [canonical(a.name) for a in stmt.names]
            else:
                if stmt.level:
                    base = here[:len(here) - (stmt.level - 1)]
                    source = ".".join(base + ([stmt.module] if stmt.module else []))
                else:
                    source = canonical(stmt.module or "")
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                           for a in stmt.names]
            for target in targets:
                if target.split(".")[0] == "purine":
                    found.add(Import(importer, _known(target, modules), kind, stmt.lineno))
    return sorted(found, key=lambda i: (i.importer, i.imported, i.line, i.kind))


def package(module: str) -> str:
    """The row of LAYERS a module belongs to: purine.X.… -> X; purine itself -> purine."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def breaks_layering(imp: Import) -> bool:
    src, dst = package(imp.importer), package(imp.imported)
    if src == dst:
        return False
    if dst not in ALLOWED.get(src, ()):
        return True
    return any(imp.imported == m or imp.imported.startswith(m + ".")
               for m in FORBIDDEN.get(src, ()))


def module_edges(imports: Iterable[Import]) -> set[tuple[str, str]]:
    """Module edges: each import, and the package __init__s that importing it runs first."""
    edges: set[tuple[str, str]] = set()
    for imp in imports:
        edges.add((imp.importer, imp.imported))
        own = imp.importer.split(".")
        parts = imp.imported.split(".")
        for n in range(1, len(parts)):
            if parts[:n] != own[:n]:
                edges.add((imp.importer, ".".join(parts[:n])))
    return {(a, b) for a, b in edges if a != b}


def cycles(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one node, each sorted (Tarjan)."""
    graph: dict[str, list[str]] = defaultdict(list)
    for a, b in sorted(set(edges)):
        graph[a].append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        # Iterative, so a long chain of imports cannot reach the recursion limit.
        work = [(v, iter(graph[v]))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(graph[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


@functools.cache
def tree() -> tuple[dict[str, tuple[Path, bool]], tuple[Import, ...]]:
    modules = discover()
    return modules, tuple(read_imports(modules))


def fmt(imp: Import) -> str:
    """One import, one line: file:line  importer -> imported  (packages, kind)."""
    path = tree()[0][imp.importer][0].relative_to(REPO)
    return (f"{path}:{imp.line}  {imp.importer} -> {imp.imported}  "
            f"({package(imp.importer)} -> {package(imp.imported)}, {imp.kind})")


def excepted(imp: Import) -> bool:
    return (imp.importer, imp.imported) in {(e.importer, e.imported) for e in EXCEPTIONS}


def _cycle_report(imports: Iterable[Import], comps: list[list[str]]) -> str:
    lines = []
    for comp in comps:
        members = set(comp)
        lines.append(f"cycle of {len(comp)} modules: {', '.join(comp)}")
        lines += ["  " + fmt(i) for i in imports
                  if i.importer in members
                  and any(b in members for _, b in module_edges([i]))]
    return "\n".join(lines)


def test_reader_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The walk on a small tree: relative, deferred, TYPE_CHECKING, submodule and alias forms."""
    files = {
        "purine/__init__.py": "",
        "purine/errors.py": "",
        "purine/caffe/__init__.py": "from . import net\nfrom .net import Net\n",
        "purine/caffe/net.py": (
            "from typing import TYPE_CHECKING\nimport numpy\n"
            "if TYPE_CHECKING:\n    from ..data import db\nelse:\n    import purine.errors\n"
            "def f():\n    from converters import tool\n    from purine import caffe\n"),
        "purine/data/__init__.py": "",
        "purine/data/db.py": "class A:\n    from purine.caffe import Net, net\n",
        "conv/__init__.py": "",
        "conv/tool.py": "from purine.converters import tool as me\nfrom . import tool\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = discover(((tmp_path / "purine", "purine"), (tmp_path / "conv", "purine.converters")))
    got = {(i.importer, i.imported, i.kind) for i in read_imports(modules)}
    assert got == {
        ("purine.caffe", "purine.caffe.net", "module"),
        ("purine.caffe.net", "purine.data.db", "type_checking"),
        ("purine.caffe.net", "purine.errors", "module"),
        ("purine.caffe.net", "purine.converters.tool", "deferred"),
        ("purine.caffe.net", "purine.caffe", "deferred"),
        ("purine.data.db", "purine.caffe", "module"),
        ("purine.data.db", "purine.caffe.net", "module"),
        ("purine.converters.tool", "purine.converters.tool", "module"),
    }
    # Importing purine.caffe.net from purine.data runs purine/caffe/__init__ first.
    edges = module_edges(read_imports(modules))
    assert ("purine.data.db", "purine.caffe") in edges
    assert ("purine.caffe.net", "purine.caffe") in edges
    assert cycles(edges) == [["purine.caffe", "purine.caffe.net", "purine.data.db"]]
    assert cycles([("a", "b"), ("b", "c"), ("c", "d"), ("d", "c")]) == [["c", "d"]]


# -- the rules -------------------------------------------------------------------------------

def test_layer_table_is_bottom_up() -> None:
    seen: set[str] = set()
    for pkg, direct in LAYERS.items():
        assert set(direct) <= seen, f"{pkg} names a package above it: {set(direct) - seen}"
        seen.add(pkg)
    assert set(FORBIDDEN) <= set(LAYERS)
    assert all(pkg not in may for pkg, may in ALLOWED.items())
    assert "graph" not in ALLOWED["ops"] | ALLOWED["data"]
    assert "caffe" not in ALLOWED["data"] | ALLOWED["runtime"]


def test_every_module_has_a_row() -> None:
    modules, imports = tree()
    assert len(modules) > 50 and len(imports) > 200   # the walk found the tree
    stray = sorted(m for m in modules if package(m) not in LAYERS)
    assert not stray, "modules of no package in LAYERS (add a row):\n" + "\n".join(stray)


def test_imports_point_down_the_table() -> None:
    """Rule (1): every import points at the importer's own package or one below it."""
    bad = [fmt(i) for i in tree()[1] if breaks_layering(i) and not excepted(i)]
    assert not bad, (f"{len(bad)} imports point up or sideways against LAYERS:\n"
                     + "\n".join(bad))


def test_no_cycle_between_packages() -> None:
    """Rule (2): the package graph of every import not excepted is acyclic."""
    imports = [i for i in tree()[1] if not excepted(i)]
    edges = {(package(i.importer), package(i.imported)) for i in imports}
    comps = cycles((a, b) for a, b in edges if a != b)
    lines = []
    for comp in comps:
        lines.append(f"packages {' <-> '.join(comp)}:")
        for a, b in sorted((a, b) for a, b in edges if a != b and {a, b} <= set(comp)):
            these = [i for i in imports if (package(i.importer), package(i.imported)) == (a, b)]
            lines.append(f"  {a} -> {b}: {len(these)} imports, first {fmt(these[0])}")
    assert not comps, "import cycles between packages:\n" + "\n".join(lines)


def test_no_cycle_between_modules() -> None:
    """Rule (3): the module graph (deferred and type_checking imports included) is acyclic."""
    imports = [i for i in tree()[1] if not excepted(i)]
    comps = cycles(module_edges(imports))
    assert not comps, "import cycles between modules:\n" + _cycle_report(imports, comps)


def test_exceptions_are_still_real() -> None:
    """The list only shrinks: each exception names imports that exist and break a rule."""
    imports = tree()[1]
    comp_of = {m: tuple(c) for c in cycles(module_edges(imports)) for m in c}
    pairs = [(e.importer, e.imported) for e in EXCEPTIONS]
    stale = [f"{a} -> {b}: listed twice" for a, b in sorted(set(pairs)) if pairs.count((a, b)) > 1]
    for e in EXCEPTIONS:
        these = [i for i in imports if (i.importer, i.imported) == (e.importer, e.imported)]
        if not these:
            stale.append(f"{e.importer} -> {e.imported}: no such import any more (step {e.step})")
        elif not any(breaks_layering(i) for i in these) and not any(
                a in comp_of and comp_of[a] == comp_of.get(b)
                for a, b in module_edges(these)):
            stale.append(f"{e.importer} -> {e.imported}: breaks no rule now (step {e.step})")
    assert not stale, "stale EXCEPTIONS, delete them:\n" + "\n".join(stale)


def test_summary_counts() -> None:
    """Every edge against the table is listed, and every other exception breaks a cycle."""
    modules, imports = tree()
    against = sorted({(i.importer, i.imported) for i in imports if breaks_layering(i)})
    listed = [(e.importer, e.imported) for e in EXCEPTIONS]
    layering = [p for p in listed if p in against]
    pair_breakers = [p for p in listed if p not in against]
    pkg_comps = cycles((package(i.importer), package(i.imported)) for i in imports
                       if package(i.importer) != package(i.imported))
    pkg_cycle_edges = [p for p in against
                       if any({package(p[0]), package(p[1])} <= set(c) for c in pkg_comps)]
    mod_comps = cycles(module_edges(imports))
    unbroken = [c for c in mod_comps
                if not any({a, b} <= set(c) for i in imports if excepted(i)
                           for a, b in module_edges([i]))]
    kinds = {k: sum(i.kind == k for i in imports) for k in ("module", "deferred", "type_checking")}
    steps = sorted({e.step for e in EXCEPTIONS})
    summary = "\n".join([
        f"{len(modules)} modules, {len(imports)} imports {kinds}",
        f"{len(against)} module edges against the table, over package edges "
        + ", ".join(sorted({f"{package(a)}->{package(b)}" for a, b in against})),
        *(f"package cycle: {' <-> '.join(c)}" for c in pkg_comps),
        f"{len(pkg_cycle_edges)} of those edges close a package cycle",
        *(f"module cycle of {len(c)}: {', '.join(c)}" for c in mod_comps),
        f"EXCEPTIONS: {len(EXCEPTIONS)} = {len(layering)} against the table + "
        f"{len(pair_breakers)} breaking a cycle inside a package; by issue-14 step "
        + ", ".join(f"{s}: {sum(e.step == s for e in EXCEPTIONS)}" for s in steps),
    ])
    print(summary)
    assert len(layering) == len(against), summary
    assert set(pkg_cycle_edges) <= set(layering), summary
    assert all(package(a) == package(b) for a, b in pair_breakers), summary
    assert not unbroken, summary


# -- the design page states the same table ----------------------------------------------------

def design_table() -> dict[str, tuple[str, ...]]:
    """The package table of docs/design.md's "## The packages": the rows' first two cells
    (`package` | `a`, `b`, ... or "nothing"), in the page's order."""
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    section = text.split("\n## The packages\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, ...]] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = cells[0].strip("`")
        assert name not in rows, f"docs/design.md names {name} twice"
        rows[name] = () if cells[1] == "nothing" else tuple(
            c.strip().strip("`") for c in cells[1].split(","))
    return rows


def test_design_page_states_the_table() -> None:
    """docs/design.md's table has LAYERS' packages, bottom up, each with the same imports."""
    page = design_table()
    assert list(page) == list(LAYERS), "docs/design.md's packages differ from LAYERS"
    differ = {pkg: (sorted(page[pkg]), sorted(may)) for pkg, may in LAYERS.items()
              if sorted(page[pkg]) != sorted(may) or len(set(page[pkg])) != len(page[pkg])}
    assert not differ, f"docs/design.md (page, LAYERS) disagree: {differ}"
