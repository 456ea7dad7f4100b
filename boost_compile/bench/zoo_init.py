"""The zoo on the meta device: every causal-LM architecture transformers ships, tiny, built
inside :func:`boost_compile.meta_init.deferred_init` and materialised by its recipe.

For each architecture (the zoo's tiny config, :mod:`boost_compile.bench.zoo_models`): every
parameter must be on meta after the build, the recipe must replay (or refuse, naming the
parameter), and the materialised model must be finite with its two row halves equal to the
whole (the slice a rank of two would compute). ``ok``, ``refused`` (MetaInitError, or a build
that cannot run on meta: what boost-train reports in one line), ``skipped`` (the architecture
does not build here at all) or ``ERROR``.

    python -m boost_compile.bench.zoo_init [--only a,b] [--out DIR]

``DIR/zoo-meta-init.md`` holds the table.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from boost_compile.bench.zoo_models import _config_for, _one_line, architectures, tiny_config
from boost_compile.meta_init import MetaInitError, deferred_init, materialize_


def check(model_type: str) -> tuple[str, str]:
    """(class, detail) of one architecture."""
    import transformers

    try:
        cls = getattr(transformers, architectures()[model_type])
        config = _config_for(cls, tiny_config(model_type))
    except Exception as exc:  # noqa: BLE001
        return "skipped", f"no tiny config: {_one_line(exc)}"
    try:
        with deferred_init(seed=0) as recording:
            model = cls(config)
    except ImportError as exc:
        return "skipped", f"does not build here: {_one_line(exc)}"
    except (RuntimeError, NotImplementedError) as exc:
        return "refused", f"its build computes with a meta parameter: {_one_line(exc)}"
    if not all(p.is_meta for p in model.parameters()):
        return "ERROR", "a parameter holds bytes after the build"
    try:
        recipe = recording.recipe(model)
    except MetaInitError as exc:
        return "refused", str(exc).split(": ", 1)[-1].split("; model.init")[0]
    materialize_(model, recipe, "cpu")
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            return "ERROR", f"{name} is not finite"
        if p.dim() and p.shape[0] > 1:
            half = p.shape[0] // 2
            parts = [recipe.values(name, (slice(0, half),)), recipe.values(name, (slice(half, p.shape[0]),))]
            if not torch.equal(torch.cat(parts), p.detach()):
                return "ERROR", f"{name}: its halves differ from the whole"
    return "ok", f"{sum(1 for _ in model.parameters())} parameters"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m boost_compile.bench.zoo_init", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated model types (default: every one)")
    p.add_argument("--out", default="benchmarks/zoo", help="folder of zoo-meta-init.md (default: %(default)s)")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(architectures())
    rows, counts = [], collections.Counter()
    begin = time.perf_counter()
    for i, name in enumerate(names, 1):
        kind, detail = check(name)
        counts[kind] += 1
        rows.append(f"| {name} | {kind} | {detail.replace('|', '/')} |")
        print(f"[{i:3d}/{len(names)}] {name:28s} {kind:8s} {detail[:110]}", flush=True)
    summary = ", ".join(f"{counts[k]} {k}" for k in ("ok", "refused", "skipped", "ERROR") if counts[k])
    text = (f"# The zoo built on the meta device\n\n`python -m boost_compile.bench.zoo_init` "
            f"({len(names)} architectures, {time.perf_counter() - begin:.0f} s): {summary}.\n\n"
            "| architecture | result | detail |\n|---|---|---|\n" + "\n".join(rows) + "\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "zoo-meta-init.md").write_text(text)
    print(summary)
    return 1 if counts["ERROR"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
