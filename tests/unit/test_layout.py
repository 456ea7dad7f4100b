"""The source tree keeps its shape: no import cycle, no module past 700 lines, each says its job.

Read from the files' syntax trees (nothing is imported): an edge A -> B for every
``import`` of a project module, at module level or inside a function (a cycle
through a deferred import is still a cycle a reader has to untangle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
#: ``passes/`` is installed as ``boost_compile.passes`` (pyproject package-dir).
PACKAGES = {"boost_compile": ROOT / "boost_compile", "boost_compile.passes": ROOT / "passes"}
MAX_LINES = 700
#: Modules allowed past MAX_LINES, with the reason (one job that needs the room).
LONG_MODULES = {
    "boost_compile.passes.tp_localize": (
        "one walk placing every op kind of a parallelized graph, with its checks and messages; "
        "the op rules it applies are in tp_op_rules"
    ),
    "boost_compile.bench.zoo_layouts": (
        "one benchmark: a rank's run of an architecture under a layout, the parent that watches the ranks' "
        "group and restarts it, and the tables; the rank and the parent share its result type and layouts"
    ),
}


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The project module an import names (``a.b.c`` may be the module ``a.b`` and its name ``c``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> nx.DiGraph:
    known = modules()
    graph = nx.DiGraph()
    for module, path in known.items():
        graph.add_node(module)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            for name in names:
                target = _resolve(name, known)
                # a package's __init__ re-exporting its own modules is the package's face, not a cycle
                if target is not None and target != module and not target.startswith(module + "."):
                    graph.add_edge(module, target)
    return graph


def test_the_import_graph_sees_the_project() -> None:
    graph = import_graph()
    assert graph.has_edge("boost_compile.backend", "boost_compile.passes")
    assert graph.has_edge("boost_compile.passes.tp_localize", "boost_compile.analysis.fx_utils")
    assert len(graph) > 60


def test_no_import_cycles() -> None:
    graph = import_graph()
    # the package faces (boost_compile/__init__ importing everything) are left out: importing a
    # submodule runs them first, but no module of the project imports one back from below
    faces = [m for m, p in modules().items() if p.name == "__init__.py"]
    cycles = list(nx.simple_cycles(graph.subgraph(set(graph) - set(faces))))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in cycles)


def test_no_module_past_the_line_limit() -> None:
    sizes = {m: len(p.read_text().splitlines()) for m, p in modules().items()}
    long = {m: n for m, n in sizes.items() if n > MAX_LINES and m not in LONG_MODULES}
    assert not long, f"modules over {MAX_LINES} lines (split by job, or say why in LONG_MODULES): {long}"
    stale = [m for m in LONG_MODULES if sizes.get(m, 0) <= MAX_LINES]
    assert not stale, f"LONG_MODULES entries that no longer need the exception: {stale}"


def test_every_module_says_what_it_is_for() -> None:
    missing = [m for m, p in modules().items() if p.stat().st_size and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"modules without a docstring saying their job: {missing}"


def test_every_package_is_installed() -> None:
    """pyproject lists its packages by hand: a package left out works in the checkout, not in a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {m for m, p in modules().items() if p.name == "__init__.py"}
    assert packages <= listed, f"packages missing from pyproject's [tool.setuptools] packages: {sorted(packages - listed)}"


#: FX predicates with one home (``boost_compile/analysis/fx_utils.py``): a second definition
#: drifts from the first (three collective tests once disagreed on what a collective is).
SHARED_PREDICATES = (
    "is_full_view", "module_path", "is_collective", "collective_kind", "forward_bodies", "node_target_name",
    "graph_kind", "meta_tensor", "source_to_fqn", "module_block", "in_blocks",
)
SHARED_TARGET_SETS = ("LINEAR", "LINEAR_TARGETS", "COLLECTIVE_NAMESPACES")


def test_shared_predicates_are_defined_once() -> None:
    home = "boost_compile.analysis.fx_utils"
    again = []
    for module, path in modules().items():
        if module in (home, "boost_compile._torch_compat"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in SHARED_PREDICATES:
                again.append(f"{module}.{node.name}")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            again += [f"{module}.{t.id}" for t in targets if isinstance(t, ast.Name) and t.id.lstrip("_") in SHARED_TARGET_SETS]
    assert not again, f"defined again outside {home}: {again}"
