#!/usr/bin/env python3
"""The two halves of podsim on one model: `examples/torch/llama.py` under `podsim run --mode
meta` (the program, counted at the dispatcher) against the config of the same shape, strategy,
remat and batch under `podsim launch` (podsim's own trainer), with their step times and peak
HBM side by side.

llama.py is written as torchtitan writes a Llama: FSDP2 per block with bf16 parameters and f32
gradient reduction, each block under `torch.utils.checkpoint`, no biases, AdamW. As a config
(configs/gpt2_fsdp_meta.toml with `--set`s): `strategy = "fsdp"`, `grad_reduce = "per_unit"`,
`reduce_dtype = "f32"`, `remat = "checkpoint"`, `[job.model] bias = false`, `upcast = true`
(its RMSNorm computes in f32), `mlp = "swiglu"`, bf16 with f32 weights.

    python3 scripts/program_vs_config.py --podsim target/debug/podsim \
        --python ~/.cache/podsim/torch-venv/bin/python --model 7b --topology 16x16x16

Prints one line per half and the program's step and HBM as a ratio of the config's; `--json`
prints them as JSON. Exits 1 if either half fails.
"""

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "torch", "llama.py")


def llama_shapes():
    """llama.py's MODELS, read from its source (importing it would import torch)."""
    with open(LLAMA) as f:
        tree = ast.parse(f.read(), LLAMA)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODELS"
                                                for t in node.targets):
            shapes = {}
            for key, call in zip(node.value.keys, node.value.values):
                shapes[key.value] = {kw.arg: kw.value.value for kw in call.keywords}
            return shapes
    sys.exit(f"no MODELS in {LLAMA}")


def config_sets(shape, args):
    """`podsim launch` overrides making configs/gpt2_fsdp_meta.toml (FSDP, meta mode, AdamW,
    bf16) llama.py's model and strategy on `shape`."""
    keys = {
        "topology.shape": f'"{args.topology}"', "topology.hardware": f'"{args.hardware}"',
        "job.steps": args.steps, "job.batch": args.batch, "job.symmetric": "true",
        "job.remat": '"checkpoint"', "job.grad_reduce": '"per_unit"',
        "job.reduce_dtype": '"f32"',
        "job.model.layers": shape["n_layers"], "job.model.d_model": shape["dim"],
        "job.model.heads": shape["n_heads"], "job.model.kv_heads": shape["n_kv_heads"],
        "job.model.ffn": shape["ffn"], "job.model.vocab": shape["vocab"],
        "job.model.seq": args.seq, "job.model.mlp": '"swiglu"',
        "job.model.weight_dtype": '"f32"', "job.model.bias": "false",
        "job.model.upcast": "true",
    }
    return [a for k, v in keys.items() for a in ("--set", f"{k}={v}")]


def run(cmd):
    start = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True)
    return p, time.monotonic() - start


def program(args, out):
    cmd = [args.podsim, "run", "--mode", "meta", "--topology", args.topology,
           "--hardware", args.hardware, "--out", out, "--", args.python, LLAMA,
           "--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq),
           "--steps", str(args.steps)]
    p, wall = run(cmd)
    if p.returncode != 0:
        sys.exit(f"podsim run exited {p.returncode}:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    with open(os.path.join(out, "report.json")) as f:
        steps = json.load(f)["torch"]["steps"]
    last = steps[-1]
    # The run's peak, as the config reports its own.
    peak = max(s["peak_hbm_bytes"] for s in steps)
    return {"step_ms": last["virtual_ms"], "compute_ms": last["compute_ms"],
            "exposed_comm_ms": last["exposed_comm_ms"], "peak_hbm_bytes": peak,
            "wall_s": wall}


def config(args, out, shape):
    base = os.path.join(ROOT, "configs", "gpt2_fsdp_meta.toml")
    p, wall = run([args.podsim, "launch", base, *config_sets(shape, args),
                   "--set", f'output.dir="{out}"'])
    if p.returncode != 0:
        sys.exit(f"podsim launch exited {p.returncode}:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    with open(os.path.join(out, "report.json")) as f:
        t = json.load(f)["training"]
    last = t["steps"][-1]
    return {"step_ms": last["virtual_ms"], "compute_ms": last["compute_ms"],
            "exposed_comm_ms": last["exposed_comm_ms"], "peak_hbm_bytes": t["peak_hbm_bytes"],
            "wall_s": wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--podsim", default=os.path.join(ROOT, "target", "debug", "podsim"))
    ap.add_argument("--python", default=sys.executable, help="the interpreter with torch")
    ap.add_argument("--model", default="7b")
    ap.add_argument("--topology", default="16x16x16")
    ap.add_argument("--hardware", default="v5p")
    ap.add_argument("--batch", type=int, default=4, help="sequences per chip")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    shapes = llama_shapes()
    if args.model not in shapes:
        sys.exit(f"--model {args.model}: llama.py has {', '.join(sorted(shapes))}")
    with tempfile.TemporaryDirectory(prefix="podsim-pvc-") as tmp:
        ours = {"program": program(args, os.path.join(tmp, "program")),
                "config": config(args, os.path.join(tmp, "config"), shapes[args.model])}
    ratios = {k: ours["program"][k] / ours["config"][k] - 1
              for k in ("step_ms", "peak_hbm_bytes")}
    if args.json:
        print(json.dumps({**ours, "program_over_config": ratios}))
        return
    gib = 2.0 ** 30
    for name, r in ours.items():
        print(f"{name:8} step {r['step_ms']:9.1f} ms (compute {r['compute_ms']:.1f}, exposed "
              f"communication {r['exposed_comm_ms']:.1f}), peak HBM "
              f"{r['peak_hbm_bytes'] / gib:.2f} GiB, wall {r['wall_s']:.1f} s")
    print(f"program against config: step {ratios['step_ms']:+.1%}, "
          f"peak HBM {ratios['peak_hbm_bytes']:+.1%}")


if __name__ == "__main__":
    main()
