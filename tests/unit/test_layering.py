"""The packages' layers, read from the sources' imports: the cost model (hardware files, the scale
model, the formulas) sits below the planner and the benchmarks, and the planner never reaches
up into the benchmarks or the trainer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "boost_compile"

#: package -> the packages it must not import
FORBIDDEN = {
    "costmodel": ("boost_compile.bench", "boost_compile.plan", "boost_compile.train"),
    "plan": ("boost_compile.bench", "boost_compile.train"),
}
#: (file, module) allowed all the same: boost-plan's command line finds boost-train's model configs
ALLOWED = {("plan/cli.py", "boost_compile.train.config")}


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_higher_ones(package: str) -> None:
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
           for path in sorted((PACKAGE / package).glob("*.py"))
           for line, name in _imports(path)
           if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package])
           and not any(str(path.relative_to(PACKAGE)) == file and name.startswith(module) for file, module in ALLOWED)]
    assert not bad, "\n".join(bad)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from boost_compile.bench import scale_model\n")
    assert (2, "boost_compile.bench") in _imports(source)
