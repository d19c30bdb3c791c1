#!/usr/bin/env python3
"""How the link model's measured constants are chosen, reproducibly.

`ici_efficiency`, `collective_overhead_ns` (TPU7x's and the other generations') and
`dcn_efficiency` (topology/src/hardware.rs) are what no data sheet gives: the fraction of an ICI
link's bandwidth a transfer sustains, the fixed cost of one collective, and the fraction of a
chip's share of its host's NICs a cross-slice transfer sustains. This script sets them against
the published collective timings (`configs/validation/collectives.csv`) with
`podsim compare FILE --json --set hardware.K=V`, by this rule:

1. ICI. For each `ici_efficiency` of a grid, each generation's overhead is the one of its grid
   that makes its own rows' largest |error| smallest (TPU7x: its all-gather sweep, measured with
   the collective offloaded to its SparseCores; every other generation: the one latency floor
   published for them, v5e's 32 KB all-gather, since no data says they differ). The efficiency
   chosen makes the largest |error| over every ICI row smallest (ties: the smaller median).
2. DCN. At those, `dcn_efficiency` makes the largest |error| over the DCN rows smallest.

It prints the choice and, at the choice, the training files (`configs/validation/*.csv` other
than the collectives), which take no part in it: their multislice rows carry DCN traffic and
every row the collectives of FSDP and tensor parallelism.

    python3 scripts/calibrate_links.py [--podsim target/debug/podsim]
"""

import argparse
import csv
import os
import statistics
import sys
import tempfile

from compare_residuals import DEFAULT_FILES, ROOT, predictions

EFFICIENCY = [round(0.80 + 0.01 * i, 2) for i in range(21)]
OVERHEAD_NS = [500.0 * i for i in range(41)]  # 0 to 20 us
DCN_EFFICIENCY = [round(0.20 + 0.01 * i, 2) for i in range(81)]
COLLECTIVES = os.path.join(ROOT, "configs/validation/collectives.csv")


def split_rows(path, folder):
    """The file's rows in three files of the same header: TPU7x's ICI rows, the other
    generations' ICI rows, the DCN rows."""
    with open(path, newline="") as f:
        lines = [line for line in f if not line.startswith("#")]
    rows = list(csv.DictReader(lines))
    groups = {"tpu7x": [], "other": [], "dcn": []}
    for row in rows:
        if "dcn" in row["group"].lower():
            groups["dcn"].append(row)
        elif row["hardware"].strip() == "tpu7x":
            groups["tpu7x"].append(row)
        else:
            groups["other"].append(row)
    paths = {}
    for name, members in groups.items():
        paths[name] = os.path.join(folder, f"{name}.csv")
        with open(paths[name], "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(members)
    return paths


def errors(podsim, path, sets):
    return {k: r["error_pct"] for k, r in predictions(podsim, path, sets).items()}


def best_overhead(podsim, path, efficiency):
    """The overhead of the grid that makes the largest |error| of `path`'s rows smallest, and
    those errors."""
    best = None
    for overhead in OVERHEAD_NS:
        e = errors(podsim, path, [f"hardware.ici_efficiency={efficiency}",
                                  f"hardware.collective_overhead_ns={overhead}"])
        key = max(abs(x) for x in e.values())
        if best is None or key < best[0]:
            best = (key, overhead, e)
    return best[1], best[2]


def summary(errs):
    a = [abs(x) for x in errs]
    return f"median {statistics.median(a):.1f}%, largest {max(a):.1f}%"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--podsim", default=os.path.join(ROOT, "target/debug/podsim"))
    ap.add_argument("--file", default=COLLECTIVES)
    a = ap.parse_args()
    if not os.access(a.podsim, os.X_OK):
        sys.exit(f"no podsim at {a.podsim} (cargo build, or pass --podsim)")
    with tempfile.TemporaryDirectory() as folder:
        paths = split_rows(a.file, folder)
        print(f"{'ici_eff':>7} {'tpu7x overhead':>15} {'other overhead':>15}  ICI rows")
        choices = []
        for eff in EFFICIENCY:
            oh7, e7 = best_overhead(a.podsim, paths["tpu7x"], eff)
            oh, eo = best_overhead(a.podsim, paths["other"], eff)
            ici = list(e7.values()) + list(eo.values())
            largest = max(abs(x) for x in ici)
            median = statistics.median(abs(x) for x in ici)
            print(f"{eff:>7} {oh7 / 1e3:>12.1f} us {oh / 1e3:>12.1f} us  {summary(ici)}")
            choices.append((largest, median, eff, oh7, oh, {**e7, **eo}))
        largest, median, eff, oh7, oh, ici = min(choices, key=lambda c: (c[0], c[1]))
        sets = [f"hardware.ici_efficiency={eff}", f"hardware.collective_overhead_ns={oh}"]
        best = None
        for d in DCN_EFFICIENCY:
            e = errors(a.podsim, paths["dcn"], sets + [f"hardware.dcn_efficiency={d}"])
            key = max(abs(x) for x in e.values())
            if best is None or key < best[0]:
                best = (key, d, e)
        _, dcn, dcn_errors = best
    print(f"\nchosen: ici_efficiency {eff}, collective_overhead_ns {oh7:.0f} (tpu7x) and "
          f"{oh:.0f} (the others), dcn_efficiency {dcn}")
    for k, v in {**ici, **dcn_errors}.items():
        print(f"  {k:<32} {v:+6.1f}%")
    print(f"  all rows: {summary(list(ici.values()) + list(dcn_errors.values()))}")
    print("\nchecks (no part in the choice), at the presets as built:")
    for f in DEFAULT_FILES:
        e = errors(a.podsim, os.path.join(ROOT, f), [])
        print(f"  {f}: {len(e)} rows, {summary(e.values())}")


if __name__ == "__main__":
    main()
