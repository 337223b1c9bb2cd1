"""The package's import graph, read from the source with `ast`: layers depend one way and no modules import each
other in a circle.

Every import counts, also those inside functions and under `if TYPE_CHECKING:`: a lazy import still ties the two
modules together (it only moves the failure from import time to call time), and a type-only one ties them for a
reader and for the type checker (two modules that name each other's types are one module split in two).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvprefetch

ROOT = Path(kvprefetch.__file__).resolve().parent
PACKAGE = "kvprefetch"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imported(tree: ast.AST, here: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules this module imports: `from a.b import c` names the module a.b.c where c is one,
    else a.b (a package's own __init__ where a.b is a package)."""
    out: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == PACKAGE}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".") if is_package else here.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] == PACKAGE:
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.add(sub if sub in known else base)
        stack.extend(ast.iter_child_nodes(node))
    out.discard(here)
    return {m for m in out if m in known}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {
        name: _imported(ast.parse(path.read_text()), name, path.name == "__init__.py", known)
        for name, path in mods.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_lazy_imports():
    """The check reads imports inside functions (the CLI registers its subcommands lazily)."""
    assert "kvprefetch.sim.cli" in import_graph()["kvprefetch.cli"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_graph_sees_type_checking_imports():
    """An import under `if TYPE_CHECKING:` is an edge too (the connector's spec names the store API's types only
    that way)."""
    assert "kvprefetch.vllm.store_api" in import_graph()["kvprefetch.vllm.spec"]


def test_sim_does_not_import_bench():
    """The simulator reads a bench run only through `kvprefetch.results` and `kvprefetch.workload`."""
    bad = {
        (m, dep)
        for m, deps in import_graph().items()
        if m.startswith("kvprefetch.sim")
        for dep in deps
        if dep == "kvprefetch.bench" or dep.startswith("kvprefetch.bench.")
    }
    assert bad == set()


CORE = ("kvprefetch.keys", "kvprefetch.tiers", "kvprefetch.io", "kvprefetch.store", "kvprefetch.workload")
ABOVE = (
    "kvprefetch.vllm",
    "kvprefetch.sglang",
    "kvprefetch.testbed",
    "kvprefetch.bench",
    "kvprefetch.sim",
    "kvprefetch.cli",
    "kvprefetch.loader",
)
# What runs in a user's engine or server: the core, the connectors, the weight loader.
PRODUCT = (*CORE, "kvprefetch.vllm", "kvprefetch.sglang", "kvprefetch.loader")


def _under(m: str, prefixes: tuple[str, ...]) -> bool:
    return any(m == p or m.startswith(p + ".") for p in prefixes)


def _crossing(sources: tuple[str, ...], targets: tuple[str, ...]) -> set[tuple[str, str]]:
    """Every import of a module under `targets` by a module under `sources`, as (importer, imported)."""
    return {(m, d) for m, deps in import_graph().items() if _under(m, sources) for d in deps if _under(d, targets)}


def test_core_does_not_import_the_layers_above():
    """keys, tiers, io, store and the workload models never reach up into connectors, bench, sim or the CLI."""
    assert _crossing(CORE, ABOVE) == set()


def test_the_connectors_do_not_import_bench_or_sim_or_each_other():
    """vLLM's connector and SGLang's storage backend run inside their engines, each beside only its own engine:
    neither reaches up into the bench or sim, nor across into the other engine's connector."""
    bad = {
        (m, d)
        for here, other in (("kvprefetch.vllm", "kvprefetch.sglang"), ("kvprefetch.sglang", "kvprefetch.vllm"))
        for m, deps in import_graph().items()
        if _under(m, (here,))
        for d in deps
        if _under(d, ("kvprefetch.bench", "kvprefetch.sim", other))
    }
    assert bad == set()


def test_the_loader_does_not_import_bench():
    """The weight loader runs inside vLLM's workers; its benchmark (bench.micro.loadbench) imports it, not the
    other way round."""
    assert _crossing(("kvprefetch.loader",), ("kvprefetch.bench",)) == set()


def test_the_product_imports_neither_the_testbed_nor_the_bench():
    """The connectors, the loader and the core run in users' engines: what starts and drives engines for the bench
    and the tests (`kvprefetch.testbed`) and the bench itself stay out of them."""
    assert _crossing(PRODUCT, ("kvprefetch.testbed", "kvprefetch.bench")) == set()


def test_the_testbed_imports_nothing_of_the_bench():
    """The bench is built on the testbed (as the tests and `kvprefetch serve` are), never the other way round."""
    assert _crossing(("kvprefetch.testbed",), ("kvprefetch.bench",)) == set()
