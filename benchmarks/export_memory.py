"""boost-export's peak host memory: streamed from the checkpoint against the model loaded whole.

The issue "Models larger than one device" asks that exporting never hold more than one whole
parameter. This trains one step of a preset in one process (``passes=none``, a checkpoint at the
end), then exports that checkpoint twice, each in a fresh process whose peak RSS growth over its
imports is measured (``VmHWM`` - ``VmRSS`` after the imports, ``/proc/self/status``):

- ``stream``: ``boost-export`` (the model on meta, tensors read by DCP a group of at most 64 MiB at
  a time and written into safetensors as they come);
- ``whole`` (the baseline, the export before streaming): ``load_trained`` builds the model and
  loads the whole checkpoint, then ``Llama.save_pretrained``.

    python benchmarks/export_memory.py [--preset llama-350m]

Prints the model's fp32 bytes, its largest parameter, each export's growth and the ratio, and
checks the two folders hold the same tensors bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from start_memory import ENV, MIB, ROOT  # noqa: E402

CHILD = """
import json, sys
def status(key):
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(key + ':')) * 1024
import torch
from boost_compile.export import export, load_trained
base = status('VmRSS')
run, out, how = sys.argv[1:4]
if how == 'stream':
    export(run, out)
else:
    model, _ = load_trained(run)
    model.save_pretrained(out)
print(json.dumps({'growth': status('VmHWM') - base}))
"""


def exported(how: str, run: Path, out: Path) -> int:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(run), str(out), how], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **ENV}, timeout=3600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["growth"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-350m")
    args = parser.parse_args()
    import torch
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "boost_compile.train", f"model.preset={args.preset}", "trainer=quick",
                        "trainer.steps=1", "trainer.eval_every=0", "trainer.plot=false", "trainer.progress=none",
                        "data.max_bytes=200000", "passes=none", f"hydra.run.dir={run}"],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, **ENV}, timeout=3600, check=True)
        growth = {how: exported(how, run, Path(tmp) / how) for how in ("stream", "whole")}
        stream = load_file(str(Path(tmp) / "stream" / "model.safetensors"))
        whole = load_file(str(Path(tmp) / "whole" / "model.safetensors"))
        assert stream.keys() == whole.keys() and all(torch.equal(stream[k], whole[k]) for k in stream)
        total = sum(t.numel() * 4 for t in stream.values())
        largest = max(t.numel() * 4 for t in stream.values())
    print(f"preset {args.preset}: {total / MIB:,.0f} MiB of fp32 weights, largest parameter {largest / MIB:,.0f} MiB")
    print("| export | peak RSS growth (MiB) | / whole model | / largest parameter |")
    print("|---|---:|---:|---:|")
    for how, g in growth.items():
        print(f"| {how} | {g / MIB:,.0f} | {g / total:.2f} | {g / largest:.2f} |")
    print(f"stream / whole: {growth['stream'] / growth['whole']:.3f}; the two folders are bitwise equal")
    print(json.dumps({"preset": args.preset, "total": total, "largest": largest, **growth}))


if __name__ == "__main__":
    main()
