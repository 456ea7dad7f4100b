"""What the forward saved for the backward, and what the backward recomputes, from a partition.

``saved_tensors_report`` reads one forward/backward pair (the partitioner
records it when asked); ``activation_bytes`` and ``saved_markdown`` turn it into
the figures ``boost-explain`` and the memory benchmark print.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from boost_compile import _torch_compat as compat
from boost_compile.analysis.fx_utils import is_collective, module_block, module_path, weight_only_nodes
from boost_compile.pass_manager import PassReport
from boost_compile.passes.activation_checkpoint import META_KEY


def _meta_block(node: fx.Node) -> tuple[bool, str | None]:
    """(known, block) from the checkpoint pass's tag, else from ``nn_module_stack``."""
    info = (node.meta.get("custom") or {}).get(META_KEY)
    if info:
        block = info.get("block")
        return True, None if block in (None, "-") else block
    if node.meta.get("nn_module_stack"):
        return True, module_block(node.meta)
    return False, None


def _find_block(node: fx.Node, depth: int = 6) -> str | None:
    """The block of a node, or of its nearest neighbour that knows (nodes a pass created)."""
    seen, frontier = {node}, [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            known, block = _meta_block(n)
            if known:
                return block
            for m in (*n.all_input_nodes, *n.users):
                if m not in seen:
                    seen.add(m)
                    nxt.append(m)
        frontier = nxt
    return None


def _nbytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return int(val.numel()) * val.element_size()
    return 0


def _returns_alias(target: Any) -> bool:
    """An ATen op whose first output aliases its first input (a view, detach, split, ...)."""
    schema = compat.op_schema(target)
    if schema is None or not schema.returns or not schema.arguments:
        return False
    out, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return out is not None and first is not None and not out.is_write and out.before_set == first.before_set


def storage_base(node: fx.Node) -> fx.Node:
    """The node that owns the memory ``node`` lives in (follows views and split getitems)."""
    while node.op == "call_function":
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            parent = node.args[0]
            if parent.op == "call_function" and _returns_alias(parent.target):
                node = parent.args[0]
                continue
            return node
        if _returns_alias(node.target) and isinstance(node.args[0], fx.Node):
            node = node.args[0]
            continue
        return node
    return node


def saved_tensors_report(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    *,
    num_fwd_outputs: int | None = None,
    static_inputs: set[str] | None = None,
    mode: str = "",
) -> PassReport:
    """What the forward hands to the backward, and what the backward recomputes.

    ``details["saved"]``: one entry per saved value (the backward's non-tangent
    placeholders, in order): name, shape, dtype, bytes, the ``storage`` it lives
    in (itself, or the base of a view) and that storage's bytes, kind, block, role
    (the checkpoint pass's, else "partitioner") and module path. Kinds:

    - "input": a primal (parameter, buffer, data input) or a view of one; ``static`` for a
      parameter or buffer (``static_inputs``);
    - "weight": computed from parameters and buffers alone (``static_inputs``),
      e.g. the concatenated weights of a group: no per-token memory;
    - "rng_state": generator state kept to recompute a random op (SDPA on CPU);
    - "symint": a saved size;
    - "activation": everything else.

    ``details["recomputed"]``: per block, the forward ops the backward runs again.
    ``details["collectives"]``: functional collectives in the forward and backward.
    """
    report = PassReport("saved_tensors")
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    fw_calls = {n.name: n for n in fw.graph.nodes if n.op == "call_function"}
    static = static_inputs or set()
    weight_only = weight_only_nodes(fw.graph, static)

    def block_of(node: fx.Node) -> str:
        src = fw_nodes.get(node.name)
        return (_find_block(src) if src is not None else None) or _find_block(node) or "-"

    saved = []
    for node in bw.graph.find_nodes(op="placeholder"):
        if node.name.startswith(("tangents", "bwd_seed", "bwd_base_offset")):
            continue
        val = node.meta.get("val")
        info = (node.meta.get("custom") or {}).get(META_KEY) or {}
        src = fw_nodes.get(node.name)
        base = storage_base(src) if src is not None else node
        if node.name.startswith("rng_state"):
            kind = "rng_state"
        elif not isinstance(val, torch.Tensor):
            kind = "symint"
        elif base.op == "placeholder":
            kind = "input"
        elif base in weight_only:
            kind = "weight"
        else:
            kind = "activation"
        base_val = base.meta.get("val") if base is not node else val
        saved.append({
            "name": node.name,
            "shape": list(val.shape) if isinstance(val, torch.Tensor) else [],
            "dtype": str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else type(val).__name__,
            "bytes": _nbytes(val),
            "storage": base.name,
            "storage_bytes": _nbytes(base_val),
            "kind": kind,
            # an input of static lifetime (a parameter or buffer), or one another graph made (a block's input)
            "static": kind == "input" and base.name in static,
            "block": block_of(node),
            "role": info.get("role") or "partitioner",
            "module": module_path(node) or "-",
        })
    recomputed: dict[str, dict[str, int]] = {}
    for node in bw.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        src = fw_calls.get(node.name)
        if getattr(node.target, "__name__", "") == "run_with_rng_state":
            # a random op replayed from its saved generator state (new name in backward)
            target, block = node.args[1], _find_block(node) or "-"
        elif src is not None:
            target, block = node.target, _find_block(src) or "-"
        else:
            continue
        op = str(getattr(target, "overloadpacket", target))
        per = recomputed.setdefault(block, {})
        per[op] = per.get(op, 0) + 1
    fw_out = fw.graph.find_nodes(op="output")[0].args[0]
    report.details = {
        "mode": mode,
        "saved": saved,
        "recomputed": {b: dict(sorted(c.items())) for b, c in recomputed.items()},
        "collectives": {
            "forward": sum(1 for n in fw.graph.nodes if is_collective(n, bodies=False)),
            "backward": sum(1 for n in bw.graph.nodes if is_collective(n, bodies=False)),
        },
        "num_fwd_outputs": num_fwd_outputs,
        "fw_output_names": [getattr(o, "name", None) for o in fw_out],
    }
    report.found = [s["name"] for s in saved]
    return report


def activation_bytes(report: PassReport) -> dict[str, int]:
    """Saved bytes per block ("-": outside the blocks), parameters and inputs excluded.

    Counts each storage once (a saved view holds its whole base alive), for the
    kinds "activation" and "rng_state" (the generator states kept to recompute
    random ops).
    """
    out: dict[str, int] = {}
    seen: set[str] = set()
    for s in report.details.get("saved", []):
        if s["kind"] in ("activation", "rng_state") and s["storage"] not in seen:
            seen.add(s["storage"])
            out[s["block"]] = out.get(s["block"], 0) + s["storage_bytes"]
    return out


def saved_input_bytes(report: PassReport) -> int:
    """Saved bytes of the graph's inputs that are not parameters or buffers, each storage once: what
    another graph or eager code made, e.g. a block's input when the blocks are compiled one by one."""
    seen = {s["storage"] for s in report.details.get("saved", []) if s["kind"] == "input" and not s.get("static", True)}
    sizes = {s["storage"]: s["storage_bytes"] for s in report.details.get("saved", [])}
    return sum(sizes[name] for name in seen)


def saved_markdown(report: PassReport, unnamed: str = "-") -> list[str]:
    """Markdown lines for ``explain``: per block, what is kept (name, shape, bytes) and recomputed.

    ``unnamed``: the block column of what no numbered block made ("-"; "each block" for a block
    compiled on its own, whose modules are named from the block)."""
    details = report.details
    saved = [s for s in details.get("saved", []) if s["kind"] not in ("input", "symint")]
    per_block = activation_bytes(report)
    inputs = sum(1 for s in details.get("saved", []) if s["kind"] == "input")
    lines = [
        f"checkpoint: `{details.get('mode') or 'none'}`; kept for backward: "
        f"{sum(per_block.values()):,} bytes of activations in {len(saved)} tensors "
        f"(and {inputs} parameters/inputs, not counted); "
        f"collectives forward/backward: {details['collectives']['forward']}/{details['collectives']['backward']}",
        "",
        "| block | tensor | shape | dtype | bytes | kind | kept as |",
        "|---|---|---|---|---:|---|---|",
    ]
    for s in saved:
        alias = f" (view of {s['storage']})" if s["storage"] != s["name"] else ""
        lines.append(
            f"| {unnamed if s['block'] == '-' else s['block']} | {s['name']}{alias} | {s['shape']} | {s['dtype']} | {s['bytes']:,} "
            f"| {s['kind']} | {s['role']} |"
        )
    lines += ["", "| block | bytes kept | recomputed in backward |", "|---|---:|---|"]
    recomputed = details.get("recomputed", {})
    for block in sorted(set(per_block) | set(recomputed), key=_block_order):
        ops = recomputed.get(block, {})
        top = ", ".join(f"{k.removeprefix('aten.')} x{v}" for k, v in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))
        lines.append(f"| {unnamed if block == '-' else block} | {per_block.get(block, 0):,} | {top or '-'} |")
    return lines + [""]


def _block_order(block: str) -> tuple[int, str, int]:
    """Blocks in layer order (``layers.2`` before ``layers.10``), "-" last."""
    if block == "-":
        return (1, "", 0)
    head, _, tail = block.rpartition(".")
    return (0, head, int(tail)) if tail.isdigit() else (0, block, 0)
