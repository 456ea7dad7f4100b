"""The planner on BOOST.md section 6's settings: its choice beside the published layout.

BOOST.md trains CoLA 1B on 1, 3B on 2, 7B on 4 and 13B on 8 A100-80GB (batch 4 x
4096, bf16) with the layouts of :data:`boost_compile.costmodel.published.PUBLISHED`.
:func:`published_choices` prices the published layout (btp, no checkpointing, no
ZeRO, one micro-batch through the pipeline, as the scale model reproduces the
published times) and asks the planner for its own choice on the same devices;
:func:`cluster_choice` asks it for cola-7b on 64 H200 (8 per node). Its choices may be FSDP2
or HSDP layouts (``parallel.dp_shard``).
"""

from __future__ import annotations

from dataclasses import dataclass

from boost_compile.costmodel.hardware import load_hardware
from boost_compile.costmodel.published import PUBLISHED
from boost_compile.costmodel.scale_model import SHAPES
from boost_compile.plan.model import ModelSpec, from_preset
from boost_compile.plan.search import Job, Layout, Row, best, price, search, usable_memory

PRECISION = "bf16-mixed"


def paper_spec(name: str) -> ModelSpec:
    """The CoLA model of a BOOST.md shape (r = d / 4, vocabulary 32000)."""
    s = next(s for s in SHAPES if s.name == name)
    return ModelSpec(f"cola-{name}", s.d, s.layers, s.heads, s.heads, s.d_ff, s.vocab, "cola", s.rank, s.rank)


def model_args(spec: ModelSpec) -> tuple[str, ...]:
    """boost-train's model overrides for a paper shape: the cola-7b preset with its widths changed."""
    fields = {"dim": spec.dim, "n_layers": spec.n_layers, "n_heads": spec.n_heads, "n_kv_heads": spec.n_kv_heads,
              "ffn_dim": spec.ffn_dim, "rank_attn": spec.rank_attn, "rank_mlp": spec.rank_mlp}
    base = from_preset("cola-7b")
    changed = [f"+model.overrides.{k}={v}" for k, v in fields.items() if getattr(base, k) != v]
    return ("model.preset=cola-7b", *changed)


@dataclass(frozen=True)
class Choice:
    """The planner's first row on a job, and the published layout priced by the same model."""

    model: str
    devices: int
    published_layout: Layout | None
    published_row: Row | None
    published_s: float | None
    chosen: Row
    layouts: int

    @property
    def gain(self) -> float | None:
        """Predicted speed-up of the choice over the published layout."""
        return None if self.published_row is None else self.published_row.step_s / self.chosen.step_s


def published_choices(batch: int = 4, seq: int = 4096) -> list[Choice]:
    hw = load_hardware("a100-80gb-nvlink")
    out = []
    for row in PUBLISHED:
        spec = paper_spec(row.model)
        job = Job(spec, batch, seq, row.gpus, 8, hw, usable_memory(hw, None), PRECISION, model_args(spec))
        rows = search(job)
        layout = Layout(row.tp, row.pp, 1, 0, 1, "gpipe" if row.pp > 1 else "1f1b", "none", "btp")
        out.append(Choice(spec.name, row.gpus, layout, price(job, layout), row.btp, best(rows, job), len(rows)))
    return out


def cluster_choice(model: str = "7B", devices: int = 64, per_node: int = 8, batch: int = 64, seq: int = 4096) -> Choice:
    hw = load_hardware("h200")
    spec = paper_spec(model)
    job = Job(spec, batch, seq, devices, per_node, hw, usable_memory(hw, None), PRECISION, model_args(spec))
    rows = search(job)
    return Choice(spec.name, devices, None, None, None, best(rows, job), len(rows))


def why(choice: Choice) -> str:
    """What separates the choice from the published layout, term by term of the step."""
    if choice.published_row is None or choice.published_row.layout == choice.chosen.layout:
        return "the published layout"
    a, b = choice.published_row, choice.chosen
    parts = []
    if b.layout.dp_shard > 1:
        parts.append(f"{'HSDP' if b.layout.dp > 1 else 'FSDP2'} over {b.layout.data_ranks} ranks replaces TP/PP collectives "
                     "per layer with a gather and a reduce-scatter per block behind its compute, and steps "
                     f"1/{b.layout.dp_shard} of the optimizer")
    elif b.layout.dp > 1:
        parts.append(f"dp{b.layout.dp} replaces TP/PP collectives per layer with one gradient all-reduce per step")
    if b.layout.pp > 1 and b.layout.microbatches > 1:
        parts.append(f"{b.layout.microbatches} micro-batches shrink the pipeline bubble")
    if b.layout.tp < a.layout.tp:
        parts.append(f"tp{b.layout.tp} keeps larger GEMMs and fewer all-reduces than tp{a.layout.tp}")
    if b.layout.zero:
        parts.append("ZeRO-1 halves the optimizer's work per rank")
    return "; ".join(parts) or "a cheaper mix of the same terms"
