#!/usr/bin/env python3
"""Where `podsim compare` misses, grouped so that a modelling question can be read off.

Runs `podsim compare FILE --json` on each validation file and prints:

1. The signed error grouped by hardware, remat policy and one slice or several: a group whose
   rows all miss the same way points at something the model lacks for that group, where
   scattered signs point at noise in the measurements.
2. Multislice growth: for every model measured on 1 and on n slices of the same slice type,
   the measured step at n slices minus the one at 1 slice, beside what podsim predicts for
   the same difference as it runs (collectives overlapped with compute) and with every
   collective exposed (`--set job.eager=strict`: the cross-slice all-reduce's whole time at
   the preset DCN bandwidth, the most that bandwidth can add), and the measured growth per
   decoder layer per doubling of the slices (growth / layers / log2 n). A figure that stays put
   across models and slice counts says the growth is a per-layer cost that grows with the
   depth of a log-depth algorithm, not with the bytes of the gradient (`grad MB/layer/chip` is
   printed beside it to compare). Beside it, what podsim misses of the growth per decoder
   layer and per host of the job (`us/layer/host`: hosts of `CHIPS_PER_HOST` chips over all
   slices): a figure that stays put says a per-layer cost linear in the job's hosts instead.
3. Pairs of rows on the same chips (hardware, slice, slices, sequence, batch per chip), one
   under `full` and one under `minimal`: the ratio of measured step times beside the ratio
   podsim predicts. podsim's ratio follows the work of the two rows (kernels, recomputation,
   exposed communication); a measured ratio well below it says the `minimal` row costs more
   per unit of work than the `full` one on the same chips, which no constant of a model that
   charges time by work can give both rows.

    python3 scripts/compare_residuals.py [--podsim target/release/podsim] [FILE.csv ...]
    (default files: the three of configs/validation/)
"""

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The chips of one host (a TPU VM) of every generation in these files (`chips_per_host`).
CHIPS_PER_HOST = 4
DEFAULT_FILES = [
    "configs/validation/published.csv",
    "configs/validation/maxtext_tables.csv",
    "configs/validation/tpu_recipes.csv",
]


def predictions(podsim, path, sets=()):
    """Row id -> podsim's prediction object for that row (`sets`: `--set` overrides)."""
    args = [podsim, "compare", path, "--json"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, check=False)
    if out.returncode not in (0, 1):
        sys.exit(f"podsim compare {path} failed (exit {out.returncode}):\n{out.stderr}")
    rows = {}
    for line in out.stdout.splitlines():
        obj = json.loads(line)
        if "id" in obj:
            rows[obj["id"]] = obj
    return rows


def read_rows(path):
    with open(path, newline="") as f:
        lines = [line for line in f if not line.startswith("#")]
    return list(csv.DictReader(lines))


def params_per_layer(row):
    d, heads, kv = int(row["d_model"]), int(row["heads"]), int(row["kv_heads"])
    head_dim, ffn = int(row["head_dim"]), int(row["ffn"])
    mlp_mats = 3 if row["mlp"] in ("swiglu", "geglu") else 2
    return d * head_dim * (2 * heads + 2 * kv) + mlp_mats * d * ffn


def grouped_errors(rows, pred):
    groups = defaultdict(list)
    for r in rows:
        p = pred.get(r["id"])
        if p is None:
            continue
        remat = r["remat"] if not r["remat"].startswith("custom:") else "custom"
        slices = "1 slice" if int(r["slices"]) == 1 else "multislice"
        groups[(r["hardware"], remat, slices)].append(p["error_pct"])
    print("## Signed error by hardware, remat and slices")
    print(f"{'hardware':8} {'remat':22} {'slices':10} {'rows':>4} {'median':>7} {'min':>7} {'max':>7}")
    for key in sorted(groups):
        e = groups[key]
        print(f"{key[0]:8} {key[1]:22} {key[2]:10} {len(e):4d} {statistics.median(e):+7.1f} "
              f"{min(e):+7.1f} {max(e):+7.1f}")
    print()


def slice_key(r):
    """Rows alike but for the number of slices."""
    skip = {"id", "slices", "dcn_dp", "measured_step_s", "source"}
    return tuple((k, v) for k, v in sorted(r.items()) if k not in skip)


def multislice_growth(rows, pred, exposed):
    families = defaultdict(dict)
    for r in rows:
        if r["id"] in pred:
            families[slice_key(r)][int(r["slices"])] = r
    print("## Multislice growth (step at n slices minus at 1 slice)")
    print(f"{'row at n slices':34} {'n':>3} {'measured s':>10} {'podsim s':>9} "
          f"{'all exposed s':>13} {'ms/layer/doubling':>17} {'grad MB/layer/chip':>18} "
          f"{'us/layer/host':>13}")
    per_doubling, per_host = [], []
    for fam in families.values():
        if 1 not in fam or len(fam) < 2:
            continue
        one = fam[1]
        for n in sorted(k for k in fam if k > 1):
            r = fam[n]
            grown = float(r["measured_step_s"]) - float(one["measured_step_s"])
            def growth(p):
                return p[r["id"]]["predicted_step_s"] - p[one["id"]]["predicted_step_s"]

            layers = int(r["layers"])
            ms = grown / layers / math.log2(n) * 1e3
            per_doubling.append(ms)
            chips = int(r["ici_fsdp"]) * int(r["ici_tp"])
            # f32 gradients of one layer, this chip's shard.
            grad_mb = params_per_layer(r) * 4 / chips / 1e6
            hosts = n * chips / CHIPS_PER_HOST
            missed = (grown - growth(pred)) / layers / hosts * 1e6
            per_host.append(missed)
            print(f"{r['id'][:34]:34} {n:3d} {grown:+10.2f} {growth(pred):+9.2f} "
                  f"{growth(exposed):+13.2f} {ms:17.1f} {grad_mb:18.1f} {missed:13.1f}")
    if per_doubling:
        print(f"median {statistics.median(per_doubling):.1f} ms per layer per doubling, "
              f"{statistics.median(per_host):.1f} us missed per layer per host, "
              f"over {len(per_doubling)} rows")
    print()


def full_minimal_pairs(rows, pred):
    """Rows on the same chips (hardware, topology, slices, batch) with `full` and `minimal`."""
    by_chips = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["id"] in pred and r["remat"] in ("full", "minimal"):
            key = (r["hardware"], r["topology"], r["slices"], r["seq"], r["batch_per_chip"])
            by_chips[key][r["remat"]].append(r)
    print("## Same chips, a `full` row against a `minimal` row")
    print(f"{'full row':22} {'minimal row':22} {'measured ratio':>14} {'podsim ratio':>12}")
    for groups in by_chips.values():
        for f in groups.get("full", []):
            for m in groups.get("minimal", []):
                measured = float(f["measured_step_s"]) / float(m["measured_step_s"])
                predicted = pred[f["id"]]["predicted_step_s"] / pred[m["id"]]["predicted_step_s"]
                print(f"{f['id'][:22]:22} {m['id'][:22]:22} {measured:14.2f} {predicted:12.2f}")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--podsim", default=os.path.join(ROOT, "target/release/podsim"))
    ap.add_argument("files", nargs="*", default=[os.path.join(ROOT, f) for f in DEFAULT_FILES])
    args = ap.parse_args()
    if not os.access(args.podsim, os.X_OK):
        sys.exit(f"no podsim at {args.podsim} (cargo build --release, or pass --podsim)")
    rows, pred, exposed = [], {}, {}
    seen = set()
    for path in args.files:
        for r in read_rows(path):
            # A row in two files (the calibration set shares rows with the tables) counts once.
            key = slice_key(r) + (("slices", r["slices"]),)
            if key not in seen:
                seen.add(key)
                rows.append(r)
        pred.update(predictions(args.podsim, path))
        exposed.update(predictions(args.podsim, path, ["job.eager=strict"]))
    print(f"{len(rows)} rows from {len(args.files)} files (a row in two files counted once)\n")
    grouped_errors(rows, pred)
    multislice_growth(rows, pred, exposed)
    full_minimal_pairs(rows, pred)


if __name__ == "__main__":
    main()
