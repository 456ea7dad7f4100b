"""Replace every RMSNorm site with the fused ``boost::rms_norm`` op.

Pattern: any site the analysis finds (``GraphView.rmsnorms``):

    torch.rms_norm(x, (d,), w, eps)                                   # fused / nn.RMSNorm
    x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w              # decomposed
    w * (h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)  # HF, h = x.float()
    (h * rsqrt(...) * (1 + w.float())).type_as(x)                     # Gemma

Rewrite:

    y, rstd = boost.rms_norm(x, w, eps, offset, cast_before_weight)

``offset`` is 1.0 for the ``(1 + w)`` form. ``cast_before_weight`` keeps Hugging
Face's rounding (the normalised value is cast to x's dtype before the weight
multiply); every other form rounds once, from fp32. Statistics are always fp32.
A site whose output dtype differs from its input dtype (a weight wider than the
activations) is skipped with a reason: the op returns x's dtype.

On CUDA the op is one Triton kernel forward and one backward. On CPU it runs
ATen code that Inductor cannot fuse with its neighbours, so by default the pass
rewrites only graphs whose activations live on CUDA (``rmsnorm.devices``);
``devices=["cuda", "cpu"]`` rewrites CPU graphs too (used by the tests).
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from boost_compile.analysis import RMSNormSite, meta_tensor, remove_dead_code, unused_nodes
from boost_compile.pass_manager import GraphPass, PassContext, PassReport


class RMSNormPass(GraphPass):
    name = "rmsnorm"

    def enabled(self) -> bool:
        return self.config.rmsnorm.enabled

    def config_section(self) -> Any:
        return self.config.rmsnorm

    def run(self, ctx: PassContext) -> PassReport:
        unused = unused_nodes(ctx.gm.graph)  # what the captured graph leaves unused stays
        import boost_compile.kernels  # noqa: F401  (registers torch.ops.boost)

        report = PassReport(self.name)
        if ctx.has_dtensor:
            report.not_applicable = "DTensor parameters (PyTorch's own tensor parallelism)"
            return report
        graph = ctx.gm.graph
        devices = set(self.config.rmsnorm.devices)
        sites = ctx.view.rmsnorms
        on = {x.device.type for s in sites if (x := meta_tensor(s.input)) is not None}
        if sites and not on & devices:
            report.not_applicable = f"activations on {sorted(on)}; rmsnorm.devices={sorted(devices)}"
            return report
        for site in sites:
            report.found.append(site.name)
            x = meta_tensor(site.input)
            reason = _why_not(site, x, devices)
            if reason is not None:
                report.skip(site.name, reason)
                continue
            eps = site.eps if site.eps is not None else torch.finfo(x.dtype).eps
            with graph.inserting_before(site.output):
                out = graph.call_function(
                    torch.ops.boost.rms_norm.default,
                    (site.input, site.weight, float(eps), float(site.weight_offset), site.form == "hf_upcast"),
                )
                y = graph.call_function(operator.getitem, (out, 0))
            y.meta.update(site.output.meta)
            site.output.replace_all_uses_with(y)
            report.rewritten.append(site.name)
            report.details[site.name] = {"form": site.form, "eps": eps, "offset": site.weight_offset}
        remove_dead_code(graph, unused)
        return report


def _why_not(site: RMSNormSite, x: torch.Tensor | None, devices: set[str]) -> str | None:
    out = meta_tensor(site.output)
    if x is None or out is None:
        return "no shape/dtype metadata for the input or output"
    if x.device.type not in devices:
        return f"activations on {x.device.type}; rmsnorm.devices={sorted(devices)}"
    if out.dtype != x.dtype:
        return f"output dtype {out.dtype} differs from input dtype {x.dtype} (weight wider than x)"
    if site.form == "fused":
        shape = site.output.args[1] if len(site.output.args) > 1 else site.output.kwargs.get("normalized_shape")
        if not isinstance(shape, (list, tuple)) or len(shape) != 1:
            return f"normalized_shape {shape} is not the last dimension alone"
    w = meta_tensor(site.weight)
    if site.weight is not None and (w is None or w.dim() != 1 or w.shape[0] != x.shape[-1]):
        return "weight is not a vector over the last dimension"
    return None
