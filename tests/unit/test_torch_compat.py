"""Private torch APIs are reached only through ``boost_compile/_torch_compat.py``.

Read from the sources' syntax trees (docstrings and comments may name them):
an import of a private torch module (``torch._dynamo``, ``torch.distributed._x``),
an attribute chain from ``torch`` through a private name (``torch._C._nn.linear``,
``torch.ops._c10d_functional``), and the private attributes and metadata keys
the project needs (``_param_name_to_source``, ``meta["grapharg"]``, ...), used
anywhere but the compat module, fail this test with file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from boost_compile import _torch_compat as compat

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("boost_compile", "passes", "benchmarks")
COMPAT = ROOT / "boost_compile" / "_torch_compat.py"
#: private attributes of torch objects, and Dynamo's private metadata keys
PRIVATE_NAMES = {
    "_param_name_to_source", "_compiled_call_impl", "_orig_mod", "_opname", "_schema",
    "_qualified_op_name", "grapharg", "_dynamo", "_inductor", "_functorch",
}


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _chain(node: ast.Attribute) -> tuple[str, list[str]]:
    """(``torch._C._nn.linear``, its attribute names) for an attribute chain; the root
    is "?" when it is not a plain name (a call's result)."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    attrs.reverse()
    root = node.id if isinstance(node, ast.Name) else "?"
    return ".".join([root, *attrs]), attrs


def private_uses(path: Path) -> list[str]:
    """``file:line: what`` for each private torch API a source file reaches."""
    tree = ast.parse(path.read_text(), str(path))
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Import):
            what = next((a.name for a in node.names if _private(a.name)), None)
        elif isinstance(node, ast.ImportFrom) and node.module and _private(node.module):
            what = node.module
        elif isinstance(node, ast.Attribute) and id(node) not in inner:  # the whole chain, once
            chain, attrs = _chain(node)
            if _private(chain) or PRIVATE_NAMES.intersection(attrs):
                what = chain
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_NAMES:
            what = repr(node.value)
        if what is not None:
            name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            found.append((node.lineno, f"{name}:{node.lineno}: {what}"))
    return [text for _line, text in sorted(found)]


def _sources() -> list[Path]:
    return sorted(p for top in SOURCES for p in (ROOT / top).rglob("*.py") if p != COMPAT)


def test_private_torch_apis_only_in_the_compat_module() -> None:
    uses = [u for path in _sources() for u in private_uses(path)]
    assert not uses, "private torch APIs outside boost_compile/_torch_compat.py:\n" + "\n".join(uses)


def test_the_scanner_sees_each_kind(tmp_path: Path) -> None:
    """A scanner that finds nothing proves nothing: each kind of use is reported, once."""
    sample = tmp_path / "probe.py"
    sample.write_text(
        "import torch._dynamo\n"
        "from torch._inductor import config\n"
        "x = torch._C._nn.linear\n"
        "y = gm._param_name_to_source\n"
        "z = node.meta.get('grapharg')\n"
        "w = torch.ops._c10d_functional.wait_tensor.default\n"
        "ok = torch.nn.functional.linear(a, b)\n"
        '"""torch._dynamo in a docstring is not a use"""\n'
    )
    assert [f.split(": ", 1)[1] for f in private_uses(sample)] == [
        "torch._dynamo", "torch._inductor", "torch._C._nn.linear", "gm._param_name_to_source", "'grapharg'",
        "torch.ops._c10d_functional.wait_tensor.default",
    ]


def test_compat_names_resolve_on_this_torch() -> None:
    """Every name the compat module exports exists on the installed torch."""
    assert torch.__version__.startswith(compat.CHECKED_WITH.rsplit(".", 1)[0]), (torch.__version__, compat.CHECKED_WITH)
    assert compat.TORCH_LINEAR is torch.nn.functional.linear or callable(compat.TORCH_LINEAR)
    assert compat.op_namespace_and_name(compat.WAIT_TENSOR) == ("_c10d_functional", "wait_tensor")
    assert compat.op_namespace_and_name(torch.ops.aten.mm.default) == ("aten", "mm")
    assert compat.op_namespace_and_name(torch.add) is None


@pytest.mark.parametrize("limit", [17])
def test_dynamo_limits_are_restored(limit: int) -> None:
    """``dynamo_recompile_limit`` raises the limit inside and puts the old value back."""
    before = compat.dynamo_recompile_limit_value()
    with compat.dynamo_recompile_limit(before + limit):
        assert compat.dynamo_recompile_limit_value() == before + limit
    assert compat.dynamo_recompile_limit_value() == before
    with compat.dynamo_recompile_limit(1):  # never lowers it
        assert compat.dynamo_recompile_limit_value() == before


def test_is_opaque_node_without_the_helper(monkeypatch):
    """A torch without AOT autograd's is_opaque_node (2.11) has no opaque inputs: False, no error."""
    from torch._functorch._aot_autograd import graph_compile

    if hasattr(graph_compile, "is_opaque_node"):
        monkeypatch.delattr(graph_compile, "is_opaque_node")
    graph = torch.fx.Graph()
    assert compat.is_opaque_node(graph.placeholder("x")) is False


def test_the_grouped_gemm_loop_gives_the_kernels_four_forms() -> None:
    """grouped_mm_loop against torch's kernel (float32, where both run): rows, columns and the inner
    dimension grouped by offsets, and the batched form without them."""
    from boost_compile import _torch_compat as compat

    gen = torch.Generator().manual_seed(0)
    offs = torch.tensor([4, 4, 12], dtype=torch.int32)
    cases = [(torch.randn(12, 8, generator=gen), torch.randn(3, 8, 16, generator=gen), offs),   # 2-D x 3-D
             (torch.randn(3, 4, 8, generator=gen), torch.randn(8, 12, generator=gen), offs),    # 3-D x 2-D
             (torch.randn(12, 8, generator=gen).t(), torch.randn(12, 16, generator=gen), offs),  # 2-D x 2-D
             (torch.randn(3, 4, 8, generator=gen), torch.randn(3, 8, 16, generator=gen), None)] # 3-D x 3-D
    for a, b, o in cases:
        torch.testing.assert_close(compat.grouped_mm_loop(a, b, o), compat.grouped_mm(a, b, o))
