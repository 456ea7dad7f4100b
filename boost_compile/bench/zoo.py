"""The zoo: every causal-LM architecture Hugging Face transformers ships, tiny, through boost.

For each entry of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` the zoo builds a two-layer model
from that architecture's own config class (hidden 64, 4 heads, vocabulary 128, 4 experts of
which 2 per token where it has experts; :data:`SHRINK` and, per architecture, :data:`OVERRIDES`),
in float32, in train mode with every dropout probability 0, and runs one forward and backward
(the model's own LM loss on random tokens, labels = inputs) three ways: eager fp32, eager
float64 (the truth) and ``torch.compile(copy, backend="boost", options={"inner": ...})``. The
parity rule (:func:`boost_compile.parity.compare`) judges the loss and every parameter
gradient of the compiled run. torch's own ``backend="aot_eager"`` runs the same way: where it
fails or breaks the rule itself, the architecture is skipped with that reason.

Each architecture ends in one class (:data:`CLASSES`): ``exact``, ``refused`` (boost said no
with a message of its own), ``skipped``, ``topk_flip`` (only a router's gradient or the loss
is off, and eager fp32's own top-k choice of experts differs from float64's), ``WRONG``,
``MISSING_GRAD`` or ``ERROR``.

    python -m boost_compile.bench.zoo [--only a,b] [--inner aot_eager|inductor] [--out DIR] [--timeout S]

Every architecture runs in a child process of its own (one at a time), so a crash or a hang
costs that architecture alone; ``DIR/zoo.md`` and ``DIR/zoo.json`` hold the table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from boost_compile.bench.zoo_models import (
    BATCH,
    SEQ,
    TOKEN_HIGH,
    TOKEN_LOW,
    VOCAB,
    ZooSkip,
    _one_line,
    architectures,
    build,
)
from boost_compile.parity import Float64Program

#: Every class a result can have, in the order the summary lists them.
CLASSES = ("exact", "refused", "skipped", "topk_flip", "WRONG", "MISSING_GRAD", "ERROR")
DEFAULT_TIMEOUT = 300.0
DEFAULT_OUT = "benchmarks/zoo"

# ----------------------------------------------------------------------------- one model


@dataclass
class ZooResult:
    """What one architecture did: its class (:data:`CLASSES`) and the evidence."""

    model_type: str
    arch: str = ""
    cls: str = ""
    #: the one-line message (refused, ERROR), the reason (skipped) or a summary (WRONG ...)
    reason: str = ""
    inner: str = "aot_eager"
    params: int = 0
    #: "lm": the model's own loss on labels = inputs; "logsumexp": the mean logsumexp of its logits
    loss: str = ""
    #: tensors outside the rule, worst first: name, err (compiled), eager (err of eager fp32), bound
    worst: list[dict[str, Any]] = field(default_factory=list)
    #: parameters with a gradient in eager and none in the compiled run
    missing: list[str] = field(default_factory=list)
    #: group_linears: sibling groups rewritten, over all graphs (None: boost did not compile)
    grouped: int | None = None
    grouped_sites: list[str] = field(default_factory=list)
    graphs: int | None = None
    #: router modules whose top-k choice was compared, eager fp32 against float64
    routers: list[str] = field(default_factory=list)
    #: router -> tokens whose chosen experts differ between eager fp32 and float64
    flips: dict[str, int] = field(default_factory=dict)
    #: torch's own aot_eager on the same run: "within the rule", or what it did
    reference: str = ""
    #: boost's own result where the class is decided by something else (skipped)
    boost: str = ""
    #: what boost's ``verify`` undid or could not check: its warnings (a rewrite it dropped)
    verify: list[str] = field(default_factory=list)
    #: ERROR: the innermost frame in boost_compile's code, if any
    frame: str = ""
    #: the last stage reached: build, eager, fp64, reference, boost, judged
    stage: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ZooResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


#: Exceptions that mark a bug wherever they are raised, never a considered refusal.
BUG_TYPES = (AssertionError, AttributeError, IndexError, KeyError, TypeError, NameError, UnboundLocalError)


def _boost_dirs() -> tuple[str, ...]:
    """Where boost_compile's code lives (its package and, in a checkout, the passes folder)."""
    import boost_compile
    import boost_compile.passes

    return tuple(str(Path(m.__file__).resolve().parent) + os.sep for m in (boost_compile, boost_compile.passes))


def _bench_file() -> str:
    return str(Path(__file__).resolve())


def _root_cause(exc: BaseException) -> BaseException:
    """The exception Dynamo wrapped (BackendCompilerFailed, InternalTorchDynamoError ...)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if inner is None:
            break
        exc = inner
    return exc


def _boost_frame(exc: BaseException) -> tuple[str, bool]:
    """The innermost frame of ``exc``'s traceback in boost_compile ("" if none), and whether it
    is the frame that raised (the innermost frame of all)."""
    dirs, bench = _boost_dirs(), _bench_file()
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [(i, f) for i, f in enumerate(frames)
            if str(Path(f.filename).resolve()).startswith(dirs) and str(Path(f.filename).resolve()) != bench]
    if not ours:
        return "", False
    i, f = ours[-1]
    where = f"{Path(f.filename).name}:{f.lineno} in {f.name}"
    return where, i == len(frames) - 1


def classify_exception(exc: BaseException) -> tuple[str, str, str]:
    """(class, one-line message, innermost boost_compile frame) of an error boost raised:
    ``refused`` for an error of boost_compile's own (its exception types, or a clear message
    raised in its code), ``ERROR`` for anything else."""
    root = _root_cause(exc)
    frame, raised_here = _boost_frame(root)
    own_type = type(root).__module__.startswith("boost_compile")
    message = _one_line(root)
    if own_type or (raised_here and not isinstance(root, BUG_TYPES) and str(root).strip()):
        return "refused", message, frame
    return "ERROR", message, frame


def _call(model: Any, ids: Any, mode: str) -> Any:
    """The loss of one forward: the model's own (``mode="lm"``) or its logits' mean logsumexp."""
    import torch

    if mode == "lm":
        out = model(input_ids=ids, labels=ids)
        loss = getattr(out, "loss", None)
        if loss is None:
            raise ZooSkip("the model returns no loss for labels")
        return loss
    out = model(input_ids=ids)
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out[0] if isinstance(out, (tuple, list)) else out
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).logsumexp(-1).mean()


def _grads(model: Any) -> dict[str, Any]:
    return {n: p.grad for n, p in model.named_parameters()}


def _step(model: Any, ids: Any, mode: str, seed: int, compiled: Any = None) -> tuple[Any, dict[str, Any]]:
    """One forward and backward (of ``compiled``, a compiled ``model``, when given) from the
    same random state; (loss, the gradients of ``model``'s parameters)."""
    import torch

    torch.manual_seed(seed)
    loss = _call(model if compiled is None else compiled, ids, mode)
    loss.backward()
    return loss.detach(), _grads(model)


def _expert_count(cfg: Any) -> int | None:
    for key in ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 1:
            return value
    return None


def _top_k(cfg: Any) -> int:
    for key in ("num_experts_per_tok", "top_k", "moe_topk", "num_experts_per_token", "top_k_experts", "moe_k"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value >= 1:
            return value
    return 1


class RouterTap:
    """Forward hooks on the modules whose name ends in "gate" or "router" that return one
    score per expert: each call's chosen experts (the indices the router returns, else the
    top-k of its scores)."""

    def __init__(self, model: Any) -> None:
        import torch

        cfg = model.config
        with contextlib.suppress(Exception):  # ambiguous where a config holds two text configs
            cfg = cfg.get_text_config()
        self.experts, self.k = _expert_count(cfg), _top_k(cfg)
        self.chosen: dict[str, list[Any]] = {}
        self.handles = []
        if self.experts is None:
            return
        for name, module in model.named_modules():
            last = name.rsplit(".", 1)[-1].lower()
            if not (last.endswith("gate") or last.endswith("router")) or isinstance(module, torch.nn.ModuleList):
                continue
            self.handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable[..., None]:
        import torch

        def hook(module: Any, args: Any, output: Any) -> None:
            outs = output if isinstance(output, (tuple, list)) else (output,)
            tensors = [o for o in outs if isinstance(o, torch.Tensor)]
            indices = [t for t in tensors if not t.is_floating_point() and t.dim() >= 1 and t.shape[-1] == self.k]
            scores = [t for t in tensors if t.is_floating_point() and t.dim() >= 1 and t.shape[-1] == self.experts]
            if indices:
                chosen = indices[0]
            elif scores:
                chosen = scores[0].detach().topk(self.k, dim=-1).indices
            else:
                return
            self.chosen.setdefault(name, []).append(chosen.detach().reshape(-1, chosen.shape[-1]).sort(-1).values)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def flips(self, other: RouterTap) -> dict[str, int]:
        """Router -> tokens whose chosen experts differ from ``other``'s (the same model in fp64)."""
        out = {}
        for name, calls in self.chosen.items():
            theirs = other.chosen.get(name, [])
            n = 0
            for a, b in zip(calls, theirs, strict=False):
                n += int((a != b).any(-1).sum()) if a.shape == b.shape else a.shape[0]
            out[name] = n
        return out


def _worst(mismatches: Sequence[Any], limit: int = 5) -> list[dict[str, Any]]:
    rows = sorted(mismatches, key=lambda m: -(m.tested / m.bound if m.bound > 0 else math.inf))
    return [{"name": m.name, "err": m.tested, "eager": m.eager, "bound": m.bound} for m in rows[:limit]]


def _describe(worst: Sequence[Mapping[str, Any]]) -> str:
    return "; ".join(f"{w['name']}: err {w['err']:.2e} > bound {w['bound']:.2e}" for w in worst[:3])


def _judge(tested: tuple[Any, dict[str, Any]], eager: tuple[Any, dict[str, Any]],
           truth: tuple[Any, dict[str, Any]]) -> tuple[list[Any], list[str]]:
    """The parity rule on the loss and every gradient; (mismatches, missing gradients)."""
    import torch

    from boost_compile.parity import compare

    def named(run: tuple[Any, dict[str, Any]]) -> dict[str, Any]:
        return {"loss": run[0], **run[1]}

    missing = [n for n, g in eager[1].items() if g is not None and tested[1].get(n) is None]
    return compare(named(tested), named(eager), named(truth), torch.float32), missing


def _router_only(names: Iterable[str], routers: Iterable[str]) -> bool:
    prefixes = tuple(f"{r}." for r in routers)
    return all(n == "loss" or n.startswith(prefixes) for n in names)


@contextlib.contextmanager
def _progress(result: ZooResult, stage: str, report: Callable[[ZooResult], None] | None) -> Any:
    result.stage = stage
    if report is not None:
        report(result)
    yield


def run_one(model_type: str, inner: str = "aot_eager", reference: bool = True, options: Mapping[str, Any] | None = None,
            seed: int = 0, report: Callable[[ZooResult], None] | None = None,
            model: Any = None) -> ZooResult:
    """Build ``model_type`` tiny (or take ``model``), run it eager fp32, eager fp64 and compiled by
    boost (``options``, with ``inner``), and classify the compiled run.

    ``reference``: also run torch's own ``backend="aot_eager"`` (the architecture is skipped
    where that fails or breaks the rule itself). ``report(result)`` is called as each stage
    starts (the child process saves it: a crash or a hang still says where it happened).
    """
    import functools

    import torch

    from boost_compile import _torch_compat as compat
    from boost_compile.backend import Recorder, compile_graph
    from boost_compile.config import BoostConfig

    start = time.perf_counter()
    result = ZooResult(model_type, arch=architectures().get(model_type, ""), inner=inner)
    try:
        with _progress(result, "build", report):
            model = build(model_type, seed) if model is None else model
        result.params = sum(p.numel() for p in model.parameters())
        ids = torch.randint(TOKEN_LOW, TOKEN_HIGH, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed + 1))
        try:
            truth_model = copy.deepcopy(model).double()
            tested_model = copy.deepcopy(model)
            reference_model = copy.deepcopy(model) if reference else None
        except Exception as exc:  # noqa: BLE001
            raise ZooSkip(f"the model cannot be copied: {_one_line(exc)}") from exc

        with _progress(result, "eager", report):
            taps = RouterTap(model), RouterTap(truth_model)
            eager, result.loss = _eager_step(model, ids, seed)
        if not torch.isfinite(eager[0]):
            raise ZooSkip(f"eager fp32 loss is {eager[0].item()}")
        with _progress(result, "fp64", report):
            try:
                with Float64Program():  # the model's own fp32 casts kept in float64 (no fp32 rounding in the truth)
                    truth = _step(truth_model, ids, result.loss, seed)
            except Exception as exc:  # noqa: BLE001
                raise ZooSkip(f"eager float64 fails: {_one_line(exc)}") from exc
        for tap in taps:
            tap.remove()
        result.routers = sorted(taps[0].chosen)
        result.flips = {k: v for k, v in taps[0].flips(taps[1]).items() if v}
        del truth_model

        if reference:
            with _progress(result, "reference", report):
                compat.reset_dynamo()
                try:
                    ref = _step(reference_model, ids, result.loss, seed,
                                torch.compile(reference_model, backend="aot_eager"))
                except Exception as exc:  # noqa: BLE001
                    raise ZooSkip(f"torch's aot_eager fails: {_one_line(_root_cause(exc))}") from exc
                finally:
                    compat.reset_dynamo()
                bad, missing = _judge(ref, eager, truth)
                if missing:
                    result.reference = f"missing gradients: {', '.join(missing[:5])}"
                elif bad:
                    result.reference = f"outside the rule: {_describe(_worst(bad))}"
                else:
                    result.reference = "within the rule"
            del reference_model

        with _progress(result, "boost", report):
            compat.reset_dynamo()
            recorder = Recorder(keep_view=False, keep_partitions=False)
            config = BoostConfig.from_options({**(options or {}), "inner": inner})
            backend = functools.partial(compile_graph, config=config, recorder=recorder)
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    tested = _step(tested_model, ids, result.loss, seed, torch.compile(tested_model, backend=backend))
            except Exception as exc:  # noqa: BLE001
                cls, message, frame = classify_exception(exc)
                result.grouped, result.grouped_sites = _grouped(recorder)
                result.graphs = len(recorder.graphs)
                return _finish(result, cls, message, start, frame=frame)
            finally:
                compat.reset_dynamo()
            result.verify = _verify_notes(caught)
            result.grouped, result.grouped_sites = _grouped(recorder)
            result.graphs = len(recorder.graphs)

        with _progress(result, "judged", report):
            bad, result.missing = _judge(tested, eager, truth)
            result.worst = _worst(bad)
        return _finish(result, *_verdict(result, bad), start)
    except ZooSkip as exc:
        return _finish(result, "skipped", str(exc), start)


def _eager_step(model: Any, ids: Any, seed: int) -> tuple[tuple[Any, dict[str, Any]], str]:
    """Eager fp32's step and the loss every run uses: the model's own LM loss, or where that
    fails (a model whose loss needs inputs beyond text) its logits' logsumexp."""
    try:
        return _step(model, ids, "lm", seed), "lm"
    except Exception as first:  # noqa: BLE001
        model.zero_grad(set_to_none=True)
        try:
            return _step(model, ids, "logsumexp", seed), "logsumexp"
        except Exception as exc:  # noqa: BLE001
            raise ZooSkip(f"eager fails: {_one_line(first)}") from exc


def _verify_notes(caught: Sequence[warnings.WarningMessage]) -> list[str]:
    """The warnings of boost's ``verify`` (a rewrite it undid), each on one line, once."""
    notes: list[str] = []
    for w in caught:
        if type(w.message).__name__ == "VerifyWarning" or w.category.__name__ == "VerifyWarning":
            line = " ".join(str(w.message).split())[:400]
            if line not in notes:
                notes.append(line)
    return notes


def _grouped(recorder: Any) -> tuple[int, list[str]]:
    sites = [s for g in recorder.graphs for r in g.reports if r.name == "group_linears" for s in r.rewritten]
    return len(sites), sites


def _verdict(result: ZooResult, bad: Sequence[Any]) -> tuple[str, str]:
    """The class and reason of a compiled run that finished."""
    reference_fails = result.reference not in ("", "within the rule")
    if result.missing:
        cls, reason = "MISSING_GRAD", f"no gradient for {len(result.missing)}: {', '.join(result.missing[:6])}"
    elif bad:
        names = [m.name for m in bad]
        if result.flips and _router_only(names, result.routers):
            cls = "topk_flip"
            reason = (f"only {', '.join(names[:4])} off; eager fp32 chooses other experts than float64 for "
                      + ", ".join(f"{k}: {v} token(s)" for k, v in result.flips.items()))
        else:
            cls, reason = "WRONG", _describe(result.worst)
    else:
        cls, reason = "exact", ""
    if reference_fails:
        result.boost = f"{cls}: {reason}" if reason else cls
        return "skipped", f"torch's aot_eager is {result.reference}"
    return cls, reason


def _finish(result: ZooResult, cls: str, reason: str, start: float, frame: str = "") -> ZooResult:
    result.cls, result.reason, result.frame = cls, reason, frame
    result.seconds = round(time.perf_counter() - start, 2)
    return result


# ----------------------------------------------------------------------------- child processes


def run_isolated(model_type: str, inner: str = "aot_eager", timeout: float = DEFAULT_TIMEOUT,
                 options: Mapping[str, Any] | None = None) -> ZooResult:
    """:func:`run_one` in a child process of its own (one intra-op thread), killed after
    ``timeout`` seconds: a crash or a hang is that architecture's result alone."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="boost-zoo-") as folder:
        out = Path(folder) / "result.json"
        cmd = [sys.executable, "-m", "boost_compile.bench.zoo", "--child", model_type, "--inner", inner,
               "--result", str(out)]
        if options:
            cmd += ["--options", json.dumps(options)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                                  start_new_session=True)
            failure = None if proc.returncode == 0 else f"the child process exited with {_exit_text(proc.returncode)}"
            tail = _last_line(proc.stderr)
        except subprocess.TimeoutExpired as exc:
            _kill_group(exc)
            failure, tail = f"timed out after {timeout:g} s", ""
        result = ZooResult.from_dict(json.loads(out.read_text())) if out.exists() else ZooResult(model_type, inner=inner)
    if failure is None and result.cls:
        return result
    # the child died or hung: its last saved stage says where
    message = f"{failure} in stage {result.stage or 'start'}" + (f" ({tail})" if tail else "")
    in_boost = result.stage in ("boost", "judged")
    return _finish(result, "ERROR" if in_boost else "skipped", message, start)


def _exit_text(code: int) -> str:
    if code < 0:
        import signal

        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _kill_group(exc: subprocess.TimeoutExpired) -> None:
    """Kill the timed-out child's process group (it started a session of its own)."""
    import signal

    proc = getattr(exc, "process", None)
    pid = getattr(proc, "pid", None)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def _child(model_type: str, inner: str, result_path: str, options: Mapping[str, Any] | None) -> int:
    """The child process: one architecture, its result saved at every stage."""
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    with contextlib.suppress(Exception):
        import transformers

        transformers.logging.set_verbosity_error()
    path = Path(result_path)

    def save(result: ZooResult) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result.to_dict(), default=str))
        tmp.replace(path)

    save(run_one(model_type, inner=inner, options=options, report=save))
    return 0


# ----------------------------------------------------------------------------- tables


def counts(results: Sequence[ZooResult]) -> dict[str, int]:
    return {c: n for c in CLASSES if (n := sum(r.cls == c for r in results))}


def _cell(text: str, limit: int = 240) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _message(r: ZooResult) -> str:
    parts = [r.reason]
    if r.cls == "ERROR" and r.frame:
        parts.append(f"[innermost boost_compile frame: {r.frame}]")
    if r.verify:
        parts.append(f"[verify undid: {'; '.join(r.verify)}]")
    if r.cls == "skipped" and r.boost:
        parts.append(f"(boost: {r.boost})")
    if r.cls == "topk_flip" or (r.cls == "WRONG" and r.flips):
        parts.append(f"[routers checked: {', '.join(r.routers)}]")
    if r.loss == "logsumexp":
        parts.append("(loss: logits' logsumexp; the LM loss needs more than text)")
    return " ".join(p for p in parts if p)


def markdown(results: Sequence[ZooResult], meta: Mapping[str, Any]) -> str:
    lines = ["# boost zoo: every causal-LM architecture of transformers, tiny", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| class | count |", "|---|---:|"]
    lines += [f"| {c} | {n} |" for c, n in counts(results).items()]
    undone = [r.model_type for r in results if r.verify]
    if undone:
        lines += ["", f"boost's verify undid a rewrite (or the whole compile) in {len(undone)}: {', '.join(undone)}"]
    lines += ["", "| model_type | class | group_linears | message / reason |", "|---|---|---:|---|"]
    for r in results:
        grouped = "-" if r.grouped is None else str(r.grouped)
        lines.append(f"| {r.model_type} | {r.cls} | {grouped} | {_cell(_message(r))} |")
    return "\n".join(lines) + "\n"


def write_tables(results: Sequence[ZooResult], out: Path, meta: Mapping[str, Any], stem: str = "zoo") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(markdown(results, meta))
    payload = {"meta": dict(meta), "counts": counts(results), "results": [r.to_dict() for r in results]}
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")


def _meta(inner: str, timeout: float, wall: float, n: int) -> dict[str, Any]:
    import platform

    import torch
    import transformers

    commit = ""
    with contextlib.suppress(Exception):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
    return {
        "command": "python -m boost_compile.bench.zoo " + " ".join(sys.argv[1:]),
        "inner": inner,
        "architectures": n,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, OMP_NUM_THREADS=1",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "timeout_s": timeout,
        "wall_s": round(wall, 1),
        "model": (f"hidden 64, 2 layers (more where a hybrid needs one layer of each kind), 4 heads, vocabulary "
                  f"{VOCAB}, experts 4 with top-2, float32, train mode with dropout 0, eager experts"),
        "run": f"one forward+backward on random tokens ({BATCH}, {SEQ}), labels = inputs; parity rule "
               "boost_compile.parity.compare against float64 eager",
    }


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m boost_compile.bench.zoo", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated model types (default: every one)")
    p.add_argument("--inner", default="aot_eager", choices=("aot_eager", "inductor"),
                   help="boost's inner compiler (default: %(default)s)")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder of zoo.md and zoo.json (default: %(default)s)")
    p.add_argument("--stem", default="zoo", help="file name of the tables, without suffix (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per architecture (default: %(default)s)")
    p.add_argument("--options", default="", help="more boost options, as JSON (the inner compiler is --inner)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    options = json.loads(args.options) if args.options else None
    if args.child:
        return _child(args.child, args.inner, args.result, options)

    known = architectures()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"unknown model type(s) {unknown}; see transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    start = time.perf_counter()
    results = []
    width = max(len(n) for n in names)
    for i, name in enumerate(names, 1):
        r = run_isolated(name, inner=args.inner, timeout=args.timeout, options=options)
        results.append(r)
        print(f"[{i:3d}/{len(names)}] {name:<{width}} {r.cls:<12} {r.seconds:6.1f}s  {_cell(_message(r), 160)}",
              flush=True)
    wall = time.perf_counter() - start
    write_tables(results, Path(args.out), _meta(args.inner, args.timeout, wall, len(names)), args.stem)
    summary = ", ".join(f"{c} {n}" for c, n in counts(results).items())
    print(f"{len(results)} architectures in {wall:.0f} s: {summary}")
    undone = [r.model_type for r in results if r.verify]
    if undone:
        print(f"verify undid a rewrite in {len(undone)}: {', '.join(undone)}")
    print(f"tables: {Path(args.out) / (args.stem + '.md')}, {Path(args.out) / (args.stem + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
