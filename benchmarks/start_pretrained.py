"""A pretrained Hugging Face folder started under TP x FSDP2: what each rank holds at the start.

The issue "Models larger than one device" asks that a pretrained folder of about 1 GB (saved from
a Llama config) start under TP2 x FSDP2 2, dense and with ``factorize=svd25``, with each rank's
peak bytes at the start within its share of the weights + one parameter + a constant.

    python benchmarks/start_pretrained.py [--layers 16] [--hidden 1024] [--tp 2] [--dp-shard 2]

Writes the folder (fp32 safetensors in shards of 256 MB, with their index), then for each of
``factorize=none`` (megatron) and ``factorize=svd25`` (btp) runs boost-train twice, each row
printed as it lands: ``model.init=per_parameter`` (built on meta, each rank reads its slices and
factorizes one layer at a time) and ``model.init=global_rng`` (``from_pretrained`` whole on every
rank, ``factorize_`` of the whole model: the start this replaces). Per run: the largest rank's
RSS growth over the start (``start.growth_mib``: build, load, factorize, shard, bind), its share
of the weights (``state_mib.params``: its parameters' bytes once sharded), the largest parameter
a rank reads whole, what is left (the constant), and the two steps' losses.
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

from start_memory import ENV, MIB, ROOT, _port  # noqa: E402


def save_folder(folder: Path, layers: int, hidden: int, vocab: int) -> tuple[int, dict[str, int]]:
    """A randomly initialised Llama saved as a pretrained folder; its parameter count and the
    element count of each parameter."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, max_position_embeddings=2048,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    model.save_pretrained(folder, max_shard_size="256MB")
    return sum(sizes.values()), sizes


def train(nproc: int, args: list[str], out: Path) -> tuple[dict | None, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(_port()), "-m", "boost_compile.train", *args,
           f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **ENV}, timeout=3600)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "error" in line.lower()]
    summary = out / "summary.json"
    return (json.loads(summary.read_text()) if proc.returncode == 0 and summary.exists() else None,
            (lines[-1] if lines else f"exit {proc.returncode}")[:400])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp-shard", type=int, default=2)
    p.add_argument("--factorize", nargs="+", default=["none", "svd25"])
    p.add_argument("--inits", nargs="+", default=["per_parameter", "global_rng"])
    args = p.parse_args()
    nproc = args.tp * args.dp_shard
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        total, sizes = save_folder(folder, args.layers, args.hidden, args.vocab)
        on_disk = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / MIB
        print(f"Llama, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {total:,} parameters, "
              f"{on_disk:,.0f} MiB of safetensors; TP{args.tp} x FSDP2 {args.dp_shard} ({nproc} processes)")
        block = max(v for n, v in sizes.items() if ".layers." in n)
        print("| factorize | model.init | weights (MiB, ranks x share) | share (MiB) | largest read whole (MiB) | start growth (MiB) "
              "| growth - share - largest (MiB) | start peak RSS (MiB) | losses |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---|")
        common = ["model=hf-tiny", "model.hf_config=null", f"model.hf_path={folder}", "model.pretrained=true",
                  "trainer.steps=2", "trainer.batch=8", "trainer.seq=64", "trainer.eval_every=0",
                  "trainer.eval_batches=1", "checkpoint.enabled=false", "trainer.plot=false", "trainer.progress=none",
                  "trainer.threads=1", "passes=boost_aot_eager", f"parallel.tp={args.tp}",
                  f"parallel.dp_shard={args.dp_shard}"]
        for factorize in args.factorize:
            plan = "megatron" if factorize == "none" else "btp"
            losses = {}
            for init in args.inits:
                s, line = train(nproc, [*common, f"factorize={factorize}", f"parallel.plan={plan}",
                                        f"model.init={init}"], Path(tmp) / f"{factorize}-{init}")
                if s is None:
                    print(f"| {factorize} | {init} | | | | | | | failed: {line} |", flush=True)
                    continue
                share = s["state_mib"]["params"]  # the largest rank's parameters, in MiB
                weights = share * nproc
                # per_parameter reads one parameter whole at most: a dense block weight for its SVD
                # (the embedding and head are read by slice); global_rng reads the whole model
                largest = (block * 4 / MIB if factorize != "none" else 0.0) if init == "per_parameter" else total * 4 / MIB
                st = s["start"]
                losses[init] = s["losses"]
                same = "" if len(losses) < 2 else (" (equal)" if losses[init] == next(iter(losses.values())) else " (DIFFER)")
                print(f"| {factorize} | {init} | {weights:,.0f} | {share:,.0f} | {largest:,.0f} | {st['growth_mib']:,.0f} | "
                      f"{st['growth_mib'] - share - largest:,.0f} | {st['peak_mib']:,.0f} | "
                      f"{[round(x, 4) for x in s['losses']]}{same} |", flush=True)


if __name__ == "__main__":
    main()
