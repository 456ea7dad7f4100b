"""Worker for the two-process tensor-parallel tests (gloo on CPU).

Each rank builds the same unsharded reference model, its float64 copy (the truth)
and a sharded, compiled copy, runs the same optimizer steps on the three, and
measures the sharded run's and the reference's errors against the truth: the loss
and the largest gathered gradient error of every step, the gathered parameters
after the last (conftest.error_pair; the test applies conftest.assert_parity).
Rank 0 writes the measured errors to JSON.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import operator
import time
import traceback
import warnings
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from conftest import error_pair, fp64_copy, grads, params
from torch.distributed.tensor.parallel import loss_parallel

import boost_compile as bc
import boost_compile.backend as boost_backend
from boost_compile.analysis.fx_utils import SPLIT_TARGETS
from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig
from boost_compile.explain import Explanation
from boost_compile.models import Llama, LlamaConfig
from boost_compile.pass_manager import AtenPass, GraphPass, PassContext, PassReport
from boost_compile.process_exit import exit_without_finalizing
from boost_compile.verify import VerifyWarning

SEQ, BATCH = 16, 2


def build(kind: str) -> tuple[torch.nn.Module, Any]:
    """(model, how to call it) for a scenario's model kind."""
    torch.manual_seed(0)
    if kind.startswith("style:"):  # model code written in other styles (tests/models/style_models.py)
        from style_models import STYLES

        return STYLES[kind.removeprefix("style:")]()
    if kind.startswith("hf"):
        from conftest import tiny_hf_llama

        vocab = kind.partition(":vocab")[2]  # "hf:vocab255": a vocabulary the TP degree does not divide
        model = tiny_hf_llama(vocab_size=int(vocab) if vocab else 256)
        bc.factorize_(model, bc.FactorizeConfig(rank_ratio=0.25))
        return model, lambda m, t: m(input_ids=t, labels=t).loss
    preset, _, rest = kind.partition(":")
    kv, _, extra = rest.partition(":")
    overrides = {"n_kv_heads": int(kv)} if kv else {}
    if extra == "tied":
        overrides["tie_embeddings"] = True
    elif extra.startswith("vocab"):  # "vocab255": a vocabulary the TP degree does not divide
        overrides["vocab_size"] = int(extra.removeprefix("vocab"))
    elif extra.startswith("layers"):  # "layers5": deeper than the blocks parallelize_ captures
        overrides["n_layers"] = int(extra.removeprefix("layers"))
    model = Llama(LlamaConfig.preset(preset, **overrides))
    return model, lambda m, t: m(t, t)


def whole_capture_specs(ref: torch.nn.Module, tokens: torch.Tensor, sc: dict[str, Any]) -> dict[str, Any]:
    """parallelize_ on a copy of ``ref`` with every block captured (KEEP_BLOCKS raised past the depth)."""
    import boost_compile.distributed.parallelize as par

    other = copy.deepcopy(ref)
    saved, par.KEEP_BLOCKS = par.KEEP_BLOCKS, 1000
    try:
        report = bc.parallelize_(other, (tokens,), dist.group.WORLD, plan=sc["plan"])
    finally:
        par.KEEP_BLOCKS = saved
    return {"specs": {name: str(spec) for name, spec in report.specs.items()},
            "checked": report.check.details["checked"] if report.check is not None else None}


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    """AdamW divides by sqrt(v), which amplifies the rounding of near-zero gradients into
    lr-sized weight differences; SGD keeps the two runs within rounding of each other."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


class DropOneAllReduce(AtenPass):
    """A planted bug: the first all-reduce of the forward graph removed (its partial sum used as
    if it were the total), to show that the parity rule catches it."""

    name = "planted_drop_all_reduce"

    def __call__(self, graph: torch.fx.Graph) -> PassReport:
        report = PassReport(self.name)
        if "tangents" in " ".join(n.name for n in graph.find_nodes(op="placeholder")):
            return report  # the backward graph
        for node in graph.nodes:
            if node.target is torch.ops._c10d_functional.all_reduce.default:
                (wait,) = node.users
                wait.replace_all_uses_with(node.args[0])
                graph.erase_node(wait)
                graph.erase_node(node)
                report.rewritten.append(node.name)
                break
        return report


class SwapGroupedOutputs(GraphPass):
    """A planted bug between group_linears and tp_collectives: the first grouped GEMM's split hands
    its first member the second member's output (two members of one width)."""

    name = "planted_swap_grouped_outputs"

    def run(self, ctx: PassContext) -> PassReport:
        report = PassReport(self.name)
        for node in ctx.gm.graph.nodes:
            sizes = node.args[1] if node.op == "call_function" and node.target in SPLIT_TARGETS else None
            if isinstance(sizes, (list, tuple)) and len(sizes) > 1 and sizes[0] == sizes[1]:
                first, second = sorted((u for u in node.users if u.target is operator.getitem), key=lambda u: u.args[1])[:2]
                first.args, second.args = (node, 1), (node, 0)
                report.rewritten.append(node.name)
                break
        return report


def planted(bug: str | None) -> contextlib.AbstractContextManager:
    """The backend with a planted bug (None: as it is): an ATen pass appended (drop_all_reduce), or a
    Torch-IR pass after group_linears (swap_grouped)."""
    if bug is None:
        return contextlib.nullcontext()
    if bug == "swap_grouped":
        passes = boost_backend.graph_passes

        def with_swap(config: BoostConfig) -> list[GraphPass]:
            found = passes(config)
            at = [p.name for p in found].index("group_linears") + 1
            return [*found[:at], SwapGroupedOutputs(config), *found[at:]]

        return mock.patch.object(boost_backend, "graph_passes", with_swap)
    assert bug == "drop_all_reduce", bug
    original = boost_backend.aten_passes
    return mock.patch.object(boost_backend, "aten_passes", lambda config: [*original(config), DropOneAllReduce(config)])


def scenario(sc: dict[str, Any], prepared: dict[str, Prepared] | None = None) -> dict[str, Any]:
    """Run ``sc``; ``prepared`` (shared_key -> Prepared) lets scenarios share their models."""
    with planted(sc.get("plant")):
        return _scenario(sc, prepared)


class Prepared:
    """A scenario's three models (unsharded, its fp64 copy, the sharded copy), its tokens and
    parallelize_'s report, with the state they started from.

    Scenarios that differ only in what acts after the capture (the inner compiler,
    checkpointing, tp options, a planted pass) share one: ``restart`` puts every parameter and
    buffer back (gradients dropped), so each runs from the start it would get from a new build
    and a new parallelize_ (Dynamo is reset between scenarios).
    """

    def __init__(self, sc: dict[str, Any]) -> None:
        ref, self.call = build(sc["model"])
        if sc.get("unit") == "block" and getattr(getattr(ref, "config", None), "use_cache", None):
            ref.config.use_cache = False  # as boost-train trains a Hugging Face model: one graph for its blocks
        self.dtype = getattr(torch, sc.get("dtype", "float32"))
        ref.to(self.dtype)
        truth = fp64_copy(ref)  # the same (rounded) weights in fp64
        model = copy.deepcopy(ref)
        vocab = min(256, getattr(getattr(ref, "config", None), "vocab_size", 256))
        self.tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        self.report = bc.parallelize_(model, (self.tokens,), dist.group.WORLD, plan=sc["plan"], **sc.get("parallelize", {}))
        self.models = (ref, truth, model)
        self.start = [{n: t.detach().clone() for n, t in _tensors(m)} for m in self.models]

    def restart(self) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
        with torch.no_grad():
            for m, start in zip(self.models, self.start, strict=True):
                for name, t in _tensors(m):
                    t.copy_(start[name])
                    t.grad = None
        return self.models


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def shared_key(sc: dict[str, Any]) -> str | None:
    """What a scenario's Prepared is built from (None: a scenario that builds its own)."""
    if sc.get("unit") == "block" or sc.get("whole_capture") or sc.get("explain_block"):
        return None
    return json.dumps([sc["model"], sc["plan"], sc.get("dtype"), sc.get("parallelize", {})], sort_keys=True)


def _scenario(sc: dict[str, Any], prepared: dict[str, Prepared] | None = None) -> dict[str, Any]:
    key = shared_key(sc)
    if prepared is not None and key is not None and key in prepared:
        setup = prepared[key]
    else:
        setup = Prepared(sc)
        if prepared is not None and key is not None:
            prepared[key] = setup
    ref, truth, model = setup.restart()
    call = ref_call = setup.call
    dtype, tokens, report = setup.dtype, setup.tokens, setup.report
    full_capture = whole_capture_specs(ref, tokens, sc) if sc.get("whole_capture") else None
    rec = Recorder()
    config = BoostConfig.from_options({"inner": sc.get("inner", "aot_eager"), "checkpoint": sc.get("checkpoint", "none"),
                                       **sc.get("options", {})})
    backend = functools.partial(compile_graph, config=config, recorder=rec)
    if sc.get("unit") == "block":  # each block compiled on its own, the code around them eager on the shards
        bc.compile_blocks(model, backend=backend)
        compiled = model
    else:
        compiled = torch.compile(model, backend=backend)
    if sc.get("loss_only"):  # a compiled step that returns the loss alone: no logits leave the graph
        compiled = torch.compile(functools.partial(call, model), backend=functools.partial(compile_graph, config=config, recorder=rec))
        call = lambda m, t: m(t)  # noqa: E731
    # PyTorch's vocabulary-parallel loss for DTensor logits needs its context around forward and backward
    loss_context = loss_parallel if sc["plan"] == "vanilla" and sc.get("parallelize", {}).get("vocab_parallel") else contextlib.nullcontext
    runs = (ref, truth, model)
    opts = [make_optimizer(sc.get("optim", "adamw"), m.parameters()) for m in runs]
    parity: dict[str, list] = {"loss": [], "grad": []}
    out: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "parity": parity}
    with warnings.catch_warnings(record=True) as warned:  # verify's, if it drops a rewrite
        warnings.simplefilter("always", VerifyWarning)
        for _ in range(sc.get("steps", 3)):
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            loss_ref = ref_call(ref, tokens)
            loss_ref.backward()
            loss_truth = ref_call(truth, tokens)
            loss_truth.backward()
            with loss_context():
                loss = call(compiled, tokens)
                loss.backward()
            if hasattr(loss, "full_tensor"):  # vanilla with PyTorch's loss-parallel: a DTensor loss
                loss = loss.full_tensor()
            parity["loss"].append(error_pair({"loss": loss}, {"loss": loss_ref}, {"loss": loss_truth}))
            gathered = bc.gather_full_grads(model)
            out.setdefault("missing_grads", [n for n, g in gathered.items() if g is None])
            parity["grad"].append(error_pair(gathered, grads(ref), grads(truth)))
            for opt in opts:
                opt.step()
    parity["param"] = error_pair(bc.gather_full_state_dict(model), params(ref), params(truth))
    out["graphs"] = len(rec.graphs)
    out["verify"] = [g.verify.lines() if g.verify is not None else None for g in rec.graphs]
    out["verify_warnings"] = [str(w.message) for w in warned if issubclass(w.category, VerifyWarning)]
    out["dropped"] = [r.name for g in rec.graphs for r in g.reports if r.dropped]
    explained = str(Explanation(config, rec.graphs)).splitlines()
    out["explain_check"] = [line for line in explained if "sharding-consistency check" in line]
    out["explain_outside"] = [line.strip() for line in explained if "outside the blocks" in line]
    out["explain_norms"] = [line.strip() for line in explained if "norm " in line and ("(online" in line or "(own statistic" in line)]
    out["tp_collectives"] = [line for g in rec.graphs for r in g.reports if r.name == "tp_collectives" for line in r.rewritten]
    if report.check is not None:  # btp/megatron: the sharding-consistency check, at parallelize_ and at compile
        localize = [r for g in rec.graphs for r in g.reports if r.name == "tp_localize"]
        out["check"] = {"parallelize": report.check.details, "compile": [r.details for r in localize],
                        "repairs": report.check.rewritten}
    out["overlap"] = [r.details for g in rec.graphs for r in g.aten_reports if r.name == "tp_overlap"]
    out["planted"] = [n for g in rec.graphs for r in g.aten_reports if r.name == DropOneAllReduce.name for n in r.rewritten]
    census = [r for g in rec.graphs for r in g.aten_reports if r.name == "collective_census"]
    out["collectives"] = {
        kind: [c for r in census if r.details["graph"] == kind for c in r.details["collectives"]]
        for kind in ("forward", "backward")
    }
    layout = getattr(model, "_boost_block_layout", None)
    if sc.get("unit") == "block" and layout is not None and layout.heads:  # the eager loss: compiled with the blocks' Inductor?
        from boost_compile.distributed.collectives import vocab_parallel_cross_entropy

        head = model.get_submodule(layout.heads[0][0])
        with torch.no_grad():
            loss_fn = head(torch.zeros(1, 1, head.weight.shape[1], dtype=dtype))._boost_loss
        out["loss_compiled"] = loss_fn is not vocab_parallel_cross_entropy and loss_fn.__wrapped__ is vocab_parallel_cross_entropy
    if sc.get("explain_block"):  # explain(unit="block") of the sharded model: each block graph once, with its blocks
        torch._dynamo.reset()
        other = copy.deepcopy(ref)
        bc.parallelize_(other, (tokens,), dist.group.WORLD, plan=sc["plan"])
        shown = bc.explain(other, tokens, tokens, options=config, unit="block")
        out["explain_block"] = {"blocks": {str(i): names for i, names in (shown.blocks or {}).items()},
                                "graphs": len(shown.graphs), "text": str(shown)}
    if full_capture is not None:  # the specs read from the first blocks against a capture of them all
        out["specs"] = {name: str(spec) for name, spec in report.specs.items()}
        out["whole_capture"] = full_capture
        out["checked"] = report.check.details["checked"] if report.check is not None else None
    out["config"] = {k: getattr(getattr(ref, "config", None), k, None)
                     for k in ("dim", "n_layers", "ffn_dim", "rank_attn", "rank_mlp", "vocab_size")}
    return out


#: what a tiny CoLA Llama's first block does to its d-sharded output, each something btp cannot shard
STREAM_HOOKS = {
    "stream_mean": lambda _m, _i, out: out - out.mean(-1, keepdim=True),
    "stream_view": lambda _m, _i, out: out.view(2, 16, 8, 8).transpose(-1, -2).reshape(2, 16, 64),
    "stream_gram": lambda _m, _i, out: out + (out @ out.transpose(-1, -2)) @ out,
    "stream_cumsum": lambda _m, _i, out: torch.cumsum(out, -1),
}


def hooked_llama(hook: str) -> torch.nn.Module:
    model = Llama(LlamaConfig.preset("tiny"))
    model.layers[0].register_forward_hook(STREAM_HOOKS[hook])
    return model


class ScaledBetweenBlocks(Llama):
    """A root that scales the stream between two blocks: per block that code would run eagerly
    on a d-slice (harmless for a scale, but the construct is refused whatever it is)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[: tokens.shape[1]], self.rope_sin[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, cos, sin)
            h = h.view(-1, h.shape[-1]).view(h.shape)  # a view pair keeps the stream whole to the analysis
        return self.output(self.norm(h))


def block_refusal(model: torch.nn.Module, plan: str, backend: Any = "boost") -> None:
    tokens = torch.zeros(2, 16, dtype=torch.long)
    bc.parallelize_(model, (tokens,), dist.group.WORLD, plan)
    bc.compile_blocks(model, backend=backend)


def bad_inputs() -> dict[str, str]:
    """Each bad case's error message (or 'no error')."""
    import style_models
    from style_models import meta_llama

    tokens = torch.zeros(2, 16, dtype=torch.long)
    cases = {
        "heads": lambda: bc.parallelize_(Llama(LlamaConfig.preset("tiny", n_heads=1, n_kv_heads=1)), (torch.zeros(1, 8, dtype=torch.long),),
                                         dist.group.WORLD, "btp"),
        "megatron_on_lowrank": lambda: bc.parallelize_(Llama(LlamaConfig.preset("tiny")), (torch.zeros(1, 8, dtype=torch.long),),
                                                       dist.group.WORLD, "megatron"),
        "btp_on_dense": lambda: bc.parallelize_(Llama(LlamaConfig.preset("tiny-dense")), (torch.zeros(1, 8, dtype=torch.long),),
                                                dist.group.WORLD, "btp"),
        "hand_layernorm": lambda: bc.parallelize_(style_models.nanogpt(low_rank=True, norm="hand-layer")[0], (tokens,),
                                                  dist.group.WORLD, "btp"),
        **{hook: functools.partial(lambda h: bc.parallelize_(hooked_llama(h), (tokens,), dist.group.WORLD, "btp"), hook)
           for hook in STREAM_HOOKS},
        "kv_heads": lambda: bc.parallelize_(meta_llama(n_kv_heads=1, low_rank=True)[0], (tokens,), dist.group.WORLD, "btp"),
        "plan_name": lambda: bc.parallelize_(Llama(LlamaConfig.preset("tiny")), (torch.zeros(1, 8, dtype=torch.long),),
                                             dist.group.WORLD, "zigzag"),
        "not_a_group": lambda: bc.parallelize_(Llama(LlamaConfig.preset("tiny")), (torch.zeros(1, 8, dtype=torch.long),), 2, "btp"),
        # per block (compile_blocks on a sharded model)
        "block_between": lambda: block_refusal(ScaledBetweenBlocks(LlamaConfig.preset("tiny")), "btp"),
        "block_backend": lambda: block_refusal(Llama(LlamaConfig.preset("tiny")), "btp", "aot_eager"),
        "block_megatron_between": lambda: block_refusal(ScaledBetweenBlocks(LlamaConfig.preset("tiny-dense")), "megatron"),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - the message is what is tested
            out[name] = f"{type(exc).__name__}: {exc}"
    model = Llama(LlamaConfig.preset("tiny"))
    tokens = torch.zeros(1, 8, dtype=torch.long)
    bc.parallelize_(model, (tokens,), dist.group.WORLD, "btp")
    try:
        model(tokens)
        out["eager_run"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["eager_run"] = f"{type(exc).__name__}: {exc}"
    try:
        torch.compile(model, backend="aot_eager")(tokens)
        out["other_backend"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["other_backend"] = f"{type(exc).__name__}: {exc}"
    return out


def vocab_logits_checks() -> dict[str, Any]:
    """VocabShardedLogits against the whole logits: per loss or op, the parity errors of the value
    and of this rank's gradient columns (whole fp32 logits the eager run, fp64 the truth), the
    padding column's gradient, and whether it took the vocabulary-parallel loss or gathered."""
    import torch.nn.functional as F

    import boost_compile.distributed.vocab_logits as vl
    from boost_compile.distributed.collectives import local_size
    from boost_compile.distributed.shard import VocabShard

    group, world, rank = dist.group.WORLD.group_name, dist.get_world_size(), dist.get_rank()
    cases = {
        "reference": lambda t, y, v: F.cross_entropy(t.flatten(0, 1).float(), y.flatten()),
        "hugging_face": lambda t, y, v: F.cross_entropy(t[:, :-1, :].contiguous().view(-1, v).float(),
                                                        y[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"),
        "per_row": lambda t, y, v: (F.cross_entropy(t.reshape(-1, t.size(-1)), y.view(-1), reduction="none")
                                    * torch.arange(10, dtype=t.dtype)).sum(),
        "label_smoothing": lambda t, y, v: F.cross_entropy(t.flatten(0, 1), y.flatten(), label_smoothing=0.1),
        "softmax": lambda t, y, v: (t.softmax(-1) * torch.arange(v, dtype=t.dtype)).sum(),
        "last_token": lambda t, y, v: t[:, -1, :].logsumexp(-1).sum() + t[:, -1].argmax(-1).sum().to(t.dtype),
        # the logits inside a list (torch.cat's argument): gathered like any other op's
        "concatenated": lambda t, y, v: (torch.cat([t, 2 * t[:, :1]], 1).logsumexp(-1) * torch.arange(6, dtype=t.dtype)).sum(),
    }
    out: dict[str, Any] = {}
    calls = {"vocab_parallel": 0, "gather": 0}
    real_loss, real_gather = vl.vocab_parallel_cross_entropy, vl.gather_from_tp

    def counted(name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            calls[name] += 1
            return fn(*a, **k)
        return call

    vl.vocab_parallel_cross_entropy, vl.gather_from_tp = counted("vocab_parallel", real_loss), counted("gather", real_gather)
    try:
        for vocab in (256, 255):
            gen = torch.Generator().manual_seed(3)
            whole = torch.randn(2, 5, vocab, generator=gen)
            targets = torch.randint(0, vocab, (2, 5), generator=gen)
            targets[0, 2] = -100
            local = local_size(vocab, world)
            padded = torch.cat([whole, whole.new_zeros(2, 5, local * world - vocab)], -1)
            for name, loss_of in cases.items():
                calls.update(vocab_parallel=0, gather=0)
                runs = {}
                for kind, dtype in (("eager", torch.float32), ("truth", torch.float64)):  # whole logits
                    logits = whole.detach().to(dtype).clone().requires_grad_()
                    loss = loss_of(logits, targets, vocab)
                    loss.backward()
                    runs[kind] = (loss.detach(), logits.grad[..., rank * local:(rank + 1) * local])
                mine = padded[..., rank * local:(rank + 1) * local].clone().requires_grad_()
                got = loss_of(vl.VocabShardedLogits.wrap(mine, VocabShard(group, world, rank, vocab)), targets, vocab)
                got.backward()
                own = min(local, vocab - rank * local)  # this rank's real columns (the padding has no whole twin)
                tested = {"loss": got.detach(), "grad": mine.grad[..., :own]}
                eager, truth = ({"loss": r[0], "grad": r[1]} for r in (runs["eager"], runs["truth"]))
                out[f"{name}/{vocab}"] = {
                    "parity": {q: error_pair({q: tested[q]}, {q: eager[q]}, {q: truth[q]}) for q in ("loss", "grad")},
                    "padding_grad": float(mine.grad[..., own:].abs().max()) if own < local else 0.0,
                    "plain": type(got) is torch.Tensor, **calls}
    finally:
        vl.vocab_parallel_cross_entropy, vl.gather_from_tp = real_loss, real_gather
    return out


def worker(rank: int, world: int, store: str, scenarios: list[dict[str, Any]], result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch._dynamo.config.cache_size_limit = 64
    results: dict[str, Any] = {}
    prepared: dict[str, Prepared] = {}
    for sc in scenarios:
        key = sc["name"]
        try:
            # the pass reports come from the compile itself: a compile-cache hit would skip them
            with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
                start = time.perf_counter()
                results[key] = (bad_inputs() if sc.get("bad_inputs") else vocab_logits_checks() if sc.get("vocab_logits")
                                else scenario(sc, prepared))
                results[key]["seconds"] = round(time.perf_counter() - start, 2)  # what the fixture spends
        except Exception:  # noqa: BLE001 - reported to the test
            results[key] = {"error": traceback.format_exc()}
        torch._dynamo.reset()
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo's threads outlive the group (boost_compile/process_exit.py)
