"""``explain``: what each pass of the boost backend saw and did on a model.

    print(bc.explain(model, tokens, options={"inner": "aot_eager"}))
    bc.explain(model, tokens).save("explain_out")   # summary.md, summary.json, *.py, *.dot

It compiles the model once with a recording pipeline, runs one forward (and one
backward when the model has trainable parameters, restoring their ``.grad``
afterwards), and reports per captured graph: the analysis (linears, bottlenecks,
sibling groups, RMSNorm sites, the residual stream), each pass's sites found /
rewritten / skipped, op counts before and after, the graph code of every stage,
and a DOT drawing of the bottleneck structure.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from boost_compile import _torch_compat as compat
from boost_compile.analysis import GraphView
from boost_compile.backend import GraphRecord, Recorder, compile_graph
from boost_compile.config import BoostConfig


@dataclass
class Explanation:
    """The recorded compile of one model; ``str()`` is a markdown report."""

    config: BoostConfig
    graphs: list[GraphRecord]
    pipeline: dict[str, Any] | None = None  # a pipeline stage's point-to-point traffic (pipeline_io)
    #: compiled per block (``unit="block"``): each graph's index -> the blocks that run it
    blocks: dict[int, list[str]] | None = None

    # -- data -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out = {
            "config": self.config.to_dict(),
            "graphs": [self._graph_dict(g) for g in self.graphs],
        }
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline
        if self.blocks is not None:
            out["blocks"] = {str(i): names for i, names in self.blocks.items()}
        return out

    def _graph_dict(self, g: GraphRecord) -> dict[str, Any]:
        view = g.view
        out: dict[str, Any] = {
            "index": g.index,
            "stages": [{"name": s.name, "op_counts": s.op_counts} for s in g.stages],
            "passes": [r.to_dict() for r in g.reports],
            "aten": [r.to_dict() for r in g.aten_reports],
            "saved_tensors": [r.to_dict() for r in g.partition_reports],
            "verify": g.verify.to_dict() if g.verify is not None else None,
        }
        if view is not None:
            out["analysis"] = {
                "summary": view.summary(),
                "linears": [
                    {"name": s.name, "form": s.form, "d_in": s.d_in, "d_out": s.d_out, "bias": s.bias is not None}
                    for s in view.linears
                ],
                "bottlenecks": [
                    {"name": c.name, "down": c.down.name, "up": c.up.name, "rank": c.rank, "activation": c.activation,
                     "latent": latent_work(c, view.bottlenecks)}
                    for c in view.bottlenecks
                ],
                "sibling_groups": [[m.name for m in grp.members] for grp in view.sibling_groups],
                "rmsnorms": [
                    {"name": s.name, "form": s.form, "eps": s.eps, "weight_offset": s.weight_offset, "upcast": s.upcast}
                    for s in view.rmsnorms
                ],
                "residual_stream": [n.name for n in view.residual_stream],
            }
        return out

    # -- report ---------------------------------------------------------------------

    def __str__(self) -> str:
        return self.markdown()

    def markdown(self) -> str:
        lines = ["# boost_compile explain", "", f"inner compiler: `{self.config.inner}`, strict: {self.config.strict}", ""]
        if self.pipeline is not None:
            lines += self._pipeline_markdown(self.pipeline)
        for g in self.graphs:
            lines += self._graph_markdown(g)
        return "\n".join(lines)

    @staticmethod
    def _pipeline_markdown(p: dict[str, Any]) -> list[str]:
        lines = [f"## Pipeline stage {p['stage']} of {p['stages']} (blocks {p['blocks']})", "",
                 "Per micro-batch, forward (the activation) and again backward (its gradient):", "",
                 "| tensor | shape | dtype | bytes | of the whole |", "|---|---|---|---:|---:|"]
        for t in p["tensors"]:
            lines.append(f"| {t['what']} | {t['shape']} | {t['dtype']} | {t['bytes']:,} | {t['fraction']:.3g} |")
        return lines + ["", f"- point-to-point bytes per micro-batch, forward + backward: {p['p2p_bytes']:,}", ""]

    def _graph_markdown(self, g: GraphRecord) -> list[str]:
        lines = [f"## Graph {g.index}", ""]
        if self.blocks is not None:
            names = self.blocks.get(g.index, [])
            lines += [f"Compiled once, run by {len(names)} block(s): {', '.join(names) or '-'}", ""]
        view = g.view
        if view is not None:
            s = view.summary()
            lines += [
                "### Analysis",
                "",
                f"- linears: {s['linears']}",
                f"- bottleneck chains: {s['bottlenecks']}",
                f"- sibling groups (shared input): {len(s['sibling_groups'])} (sizes {s['sibling_groups']})",
                f"- RMSNorm sites: {sum(s['rmsnorms'].values())} {s['rmsnorms']}",
                f"- LayerNorm sites: {s['layernorms']}",
                f"- residual stream: {s['residual_adds']} adds",
                "",
            ]
            if view.bottlenecks:
                lines += ["| bottleneck | d_in | r | d_out | activation | on the latent |", "|---|---|---|---|---|---|"]
                lines += [
                    f"| {c.name} | {c.down.d_in} | {c.rank} | {c.up.d_out} | {c.activation or '-'} | "
                    f"{latent_work(c, view.bottlenecks) or '-'} |"
                    for c in view.bottlenecks
                ]
                lines.append("")
            if view.rmsnorms:
                lines += ["RMSNorm sites:", ""]
                lines += [f"- {n.name} ({n.form}, eps {n.eps})" for n in view.rmsnorms]
                lines.append("")
            if view.sibling_groups:
                lines += ["Sibling groups:", ""]
                lines += [f"- {' , '.join(m.name for m in grp.members)}" for grp in view.sibling_groups]
                lines.append("")
        lines += ["### Passes", ""]
        if not g.reports:
            lines += ["(no Torch-IR pass enabled)", ""]
        for r in g.reports:
            lines.append(f"- {r.line()}")
            lines += [f"  - rewrote {site}" for site in r.rewritten]
            lines += [f"  - skipped {site}: {why}" for site, why in r.skipped]
        lines.append("")
        if g.verify is not None:
            lines += ["### Verify", "", "Each rewrite against the captured graph and float64 (the parity rule):", ""]
            lines += [f"- {line}" for line in g.verify.lines()]
            lines.append("")
        lines += ["### Op counts", ""]
        lines += self._op_table(g)
        lines += self._collective_table(g)
        lines += self._saved_tensors(g)
        return lines

    def _saved_tensors(self, g: GraphRecord) -> list[str]:
        """What the forward keeps for the backward, per block (passes/saved_tensors.py)."""
        from boost_compile.passes.saved_tensors import saved_markdown

        unnamed = "each block" if self.blocks is not None and g.index in self.blocks else "-"
        lines = []
        for r in g.partition_reports:
            lines += ["### Saved for backward", "", *saved_markdown(r, unnamed)]
        return lines

    def _collective_table(self, g: GraphRecord) -> list[str]:
        from boost_compile.analysis.fx_utils import in_blocks

        census = [r for r in g.aten_reports if r.name == "collective_census"]
        if not any(r.details["collectives"] for r in census):
            return []
        layers = max(1, (len(g.view.residual_stream) - 1) // 2) if g.view is not None else 1
        # a block compiled on its own (unit="block"): its modules are named from the block, all of it is inside
        block_graph = self.blocks is not None and g.index in self.blocks
        lines = ["### Collectives", "", "| graph | kind | shape | dtype | bytes | from |", "|---|---|---|---|---:|---|"]
        for r in census:
            for c in r.details["collectives"]:
                origin = " / ".join(x for x in (c.get("module") or "(model)", c.get("source")) if x)
                lines.append(f"| {r.details['graph']} | {c['kind']} | {c['shape']} | {c['dtype']} | {c['bytes']:,} | {origin} |")
        lines.append("")
        for r in census:
            reduce_bytes = sum(c["bytes"] or 0 for c in r.details["collectives"] if c["kind"] == "all_reduce")
            outside = [] if block_graph else [c for c in r.details["collectives"] if not in_blocks(c.get("module") or "")]
            lines.append(
                f"- {r.details['graph']}: {len(r.details['collectives'])} collectives, "
                f"{r.details['total_bytes']:,} bytes; all-reduce bytes per layer ({layers} layers): {reduce_bytes // layers:,}"
            )
            if outside:
                what = ", ".join(f"{c['kind']} {c['shape']} {c['bytes']:,} B" + (f" ({c['source']})" if c.get("source") else "")
                                 for c in outside)
                lines.append(f"  - outside the blocks (embedding, final norm, head, loss): {len(outside)} collectives, "
                             f"{sum(c['bytes'] or 0 for c in outside):,} bytes: {what}")
        return lines + [""]

    def _op_table(self, g: GraphRecord) -> list[str]:
        columns = [(s.name, s.op_counts) for s in g.stages]
        columns += [
            (f"aten {r.details.get('graph', '?')}", r.details.get("op_counts", {}))
            for r in g.aten_reports
            if r.name == "op_census"
        ]
        if not columns:
            return ["(none recorded)", ""]
        header = "| stage | ops | top ops |"
        rows = [header, "|---|---|---|"]
        for name, counts in columns:
            top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:6]
            rows.append(f"| {name} | {sum(counts.values())} | {', '.join(f'{k} x{v}' for k, v in top)} |")
        return rows + [""]

    # -- files ----------------------------------------------------------------------

    def save(self, folder: str | Path) -> Path:
        """Write summary.md, summary.json, one .py per stage and a .dot per graph."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.md").write_text(self.markdown())
        (out / "summary.json").write_text(json.dumps(self.to_dict(), indent=2, default=str))
        for g in self.graphs:
            for i, stage in enumerate(g.stages):
                (out / f"graph{g.index}_{i}_{stage.name}.py").write_text(stage.code)
            if g.view is not None:
                (out / f"graph{g.index}_bottlenecks.dot").write_text(bottleneck_dot(g.view))
        return out


# ----------------------------------------------------------------------------- the drawing


def bottleneck_dot(view: GraphView) -> str:
    """DOT text: norms, linears (clustered per bottleneck) and residual adds, with data flow."""
    sites: dict[fx.Node, str] = {}
    for s in view.rmsnorms:
        sites[s.output] = f"RMSNorm {s.name} ({s.form})"
    for s in view.linears:
        sites[s.node] = f"{s.name}\\n{s.d_in}->{s.d_out}"
    for n in view.residual_stream[1:]:
        sites[n] = f"+ {n.name}"
    ids = {n: f"n{i}" for i, n in enumerate(sites)}
    lines = ["digraph bottlenecks {", "  rankdir=TB; node [shape=box, fontsize=10];"]
    for i, chain in enumerate(view.bottlenecks):
        lines.append(f'  subgraph cluster_b{i} {{ label="{chain.name} r={chain.rank} {chain.activation or ""}"; style=rounded;')
        lines.append(f"    {ids[chain.down.node]}; {ids[chain.up.node]}; }}")
    for node, label in sites.items():
        shape = "ellipse" if label.startswith("+") else ("box3d" if label.startswith("RMSNorm") else "box")
        lines.append(f'  {ids[node]} [label="{label}", shape={shape}];')
    for node in sites:
        for nxt in _next_sites(node, sites):
            lines.append(f"  {ids[node]} -> {ids[nxt]};")
    lines.append("}")
    return "\n".join(lines) + "\n"


_LATENT_SYMBOLS = {"add": "+", "iadd": "+", "mul": "*", "imul": "*", "sub": "-", "truediv": "/", "div": "/"}


def latent_work(chain: Any, chains: list[Any]) -> str:
    """The elementwise work between a chain's activation and its up factor, in words:
    ``+ latent of layers.0.attn.q`` (LaX's crossing), ``* 0.5``, ``* sigmoid_1``; "" when none."""
    latents = {c.latent: c.name for c in chains}
    words = []
    for op in chain.latent_ops:
        target = op.target if isinstance(op.target, str) else getattr(op.target, "__name__", str(op.target))
        symbol = _LATENT_SYMBOLS.get(target, target)
        inputs = [a for a in op.args if a not in (chain.latent, *chain.latent_ops)]
        words += [f"{symbol} {_operand(other, latents)}" for other in inputs]
    return ", ".join(words)


def _operand(node: Any, latents: dict[fx.Node, str]) -> str:
    """An operand of latent work: another chain's latent, a scalar times one, a constant or a node."""
    if not isinstance(node, fx.Node):
        return str(node)
    if node in latents:
        return f"latent of {latents[node]}"
    if node.op == "call_function" and len(node.args) == 2 and getattr(node.target, "__name__", "") == "mul":
        a, b = node.args
        scalar, tensor = (a, b) if isinstance(a, (int, float)) else (b, a)
        if isinstance(scalar, (int, float)) and isinstance(tensor, fx.Node) and tensor in latents:
            return f"{scalar:g} * latent of {latents[tensor]}"
    return node.name


def _next_sites(start: fx.Node, sites: dict[fx.Node, str]) -> list[fx.Node]:
    """The first site nodes reached from ``start`` along data-flow edges."""
    found, seen, stack = [], {start}, list(start.users)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in sites:
            found.append(node)
        else:
            stack.extend(node.users)
    return sorted(found, key=lambda n: n.name)


# ----------------------------------------------------------------------------- the entry points


def explain(
    model: torch.nn.Module,
    *example_inputs: Any,
    options: BoostConfig | dict[str, Any] | None = None,
    backward: bool | None = None,
    unit: str = "model",
) -> Explanation:
    """Compile ``model`` with the boost pipeline, run it once, and report what happened.

    ``backward``: also run a backward pass (default: when grad is enabled and the
    model has trainable parameters), so the backward graph is compiled and shown.
    Parameter ``.grad`` values are restored afterwards. ``unit="block"``: compile a copy of the
    model block by block (``compile_blocks``) and show each block graph once, with the blocks
    that run it.
    """
    if unit not in ("model", "block"):
        raise ValueError(f"unit must be 'model' or 'block', got {unit!r}")
    config = BoostConfig.from_options(options)
    recorder = Recorder()
    backend = functools.partial(compile_graph, config=config, recorder=recorder)
    shared: dict[int, list[str]] | None = None
    if unit == "block":
        model = _copy_keeping_attributes(model)  # compiled in place: leave the user's model as it was
        shared = _attribute_blocks(model, recorder, backend)
        compiled = model
    else:
        compiled = torch.compile(model, backend=backend)
    params = [p for p in model.parameters() if p.requires_grad]
    if backward is None:
        backward = torch.is_grad_enabled() and bool(params)
    saved_grads = [p.grad for p in params]
    for p in params:  # backward accumulates in place: keep the user's tensors out of reach
        p.grad = None
    # Caches would skip the ATen passes whose reports we show.
    with compat.compile_settings(**compat.NO_COMPILE_CACHES):
        out = compiled(*example_inputs)
        if backward:
            loss = _scalar(out)
            if loss is not None and loss.requires_grad:
                loss.backward()
    for p, g in zip(params, saved_grads, strict=True):
        p.grad = g
    return Explanation(config, recorder.graphs, pipeline_io(model, example_inputs, out), shared)


def _copy_keeping_attributes(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose parameters keep their Python attributes: ``copy.deepcopy``
    of an ``nn.Parameter`` drops them, and ``parallelize_`` keeps each shard's spec there."""
    import copy

    copied = copy.deepcopy(model)
    theirs = dict(copied.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters(remove_duplicate=False):
        theirs[name].__dict__.update(vars(param))
    return copied


def _attribute_blocks(model: torch.nn.Module, recorder: Recorder, backend: Any) -> dict[int, list[str]]:
    """Compile ``model``'s blocks with ``backend``; the returned map fills in as they run: a block
    whose call compiled a graph runs that graph, one that compiled nothing reuses the graph last
    compiled for a block of its class (Dynamo's cache of the block's code)."""
    from boost_compile.blocks import compile_blocks

    shared: dict[int, list[str]] = {}
    last_of_class: dict[type, int] = {}
    names = compile_blocks(model, backend=backend)
    for name in names:
        block = model.get_submodule(name)
        before: list[int] = []

        def pre(_m, _args, before=before):
            before.append(len(recorder.graphs))

        def post(m, _args, _out, name=name, before=before):
            start = before.pop()
            if len(recorder.graphs) > start:
                last_of_class[type(m)] = start
            index = last_of_class.get(type(m))
            if index is not None and name not in shared.setdefault(index, []):
                shared[index].append(name)

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)
    return shared


def pipeline_io(model: torch.nn.Module, example_inputs: Sequence[Any], out: Any) -> dict[str, Any] | None:
    """What a pipeline stage (``boost_compile.distributed.pipeline``) receives and sends, from one
    run: its input (unless it is the first stage) and output (unless it is the last) with their
    bytes, against the whole stream's, and the logits it gives the loss. None for other models."""
    from boost_compile.distributed.pipeline import PipelineError, stage_module

    try:
        stage = stage_module(model)
    except PipelineError:
        return None
    first, last = stage.stage_index == 0, stage.stage_index == stage.num_stages - 1

    def row(what: str, t: torch.Tensor, whole: int) -> dict[str, Any]:
        nbytes = t.numel() * t.element_size()
        return {"what": what, "shape": list(t.shape), "dtype": str(t.dtype), "bytes": nbytes,
                "fraction": t.shape[-1] / whole}

    tensors = []
    if not first:
        tensors.append(row("received: the stream", example_inputs[0], stage.hidden_size))
    if not last:
        tensors.append(row("sent: the stream", out, stage.hidden_size))
    else:
        tensors.append(row("to the loss: the logits", out, stage.vocab_size))
    p2p = 2 * sum(t["bytes"] for t in tensors if not t["what"].startswith("to the loss"))
    return {"stage": stage.stage_index, "stages": stage.num_stages,
            "blocks": f"{stage.layer_range.start}-{stage.layer_range.stop - 1}", "tensors": tensors,
            "p2p_bytes": p2p}


def _scalar(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out.float().sum()
    if isinstance(out, (tuple, list)) and out:
        return _scalar(out[0])
    if isinstance(out, dict) and out:
        return _scalar(out.get("loss", next(iter(out.values()))))
    logits = getattr(out, "loss", None)
    if logits is None:
        logits = getattr(out, "logits", None)
    return _scalar(logits) if logits is not None else None


def main(argv: Sequence[str] | None = None) -> int:
    """``boost-explain``: explain a reference preset and write the report folder."""
    from boost_compile.models import Llama, LlamaConfig

    parser = argparse.ArgumentParser(prog="boost-explain", description=main.__doc__)
    parser.add_argument("--preset", default="tiny", help=f"one of {', '.join(LlamaConfig.presets())}")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--options", default="{}", help='JSON for options=, e.g. \'{"inner": "aot_eager"}\'')
    parser.add_argument("--inner", default=None, help="inner compiler (overrides --options)")
    parser.add_argument("--out", default="explain_out", help="folder for summary.md/json, code and drawings")
    parser.add_argument("--no-backward", action="store_true", help="explain the forward graph only")
    parser.add_argument("--unit", default="model", choices=["model", "block"],
                        help="compile the whole model as one graph, or each block (one graph per kind of block)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    options = json.loads(args.options)
    if args.inner:
        options["inner"] = args.inner
    options.setdefault("inner", "aot_eager")
    torch.manual_seed(args.seed)
    cfg = LlamaConfig.preset(args.preset)
    model = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    report = explain(model, tokens, options=options, backward=not args.no_backward, unit=args.unit)
    folder = report.save(args.out)
    print(report)
    print(f"wrote {folder}/summary.md, summary.json, per-stage .py and .dot files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
