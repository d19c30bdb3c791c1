#!/usr/bin/env python3
"""How the kernel model's two measured constants are chosen, reproducibly.

`matmul_efficiency` and `attention_efficiency` (topology/src/hardware.rs) are what a matmul and
the flash-attention kernel sustain inside a training step; no data sheet rates them, so they
are set against the published step times of the calibration file, one value each for every
chip and model. This script runs `podsim compare FILE --json --set hardware.K=V` over a grid
of the two (through `compare_residuals.predictions`) and picks, among the points that meet the calibration's aims on the file (every
row within --row-aim, the median within --median-aim, none out of memory), the one with the
smallest mean error: the aims are the constraints, and the mean weighs every row where the
median reads the middle ones and the largest only one. It prints the grid, the choice, and at the choice the error on
the check files, which take no part in it.

    python3 scripts/calibrate.py [--podsim target/release/podsim]
        [--file configs/validation/published.csv] [--check FILE.csv ...]
"""

import argparse
import os
import statistics
import sys

from compare_residuals import DEFAULT_FILES, ROOT, predictions

MATMUL = [round(0.74 + 0.01 * i, 2) for i in range(9)]
ATTENTION = [round(0.45 + 0.05 * i, 2) for i in range(7)]


def errors(podsim, path, matmul, attention):
    """|error| in percent of every row of `path` at the two constants, and whether every row
    fits in HBM."""
    sets = [f"hardware.matmul_efficiency={matmul}", f"hardware.attention_efficiency={attention}"]
    rows = predictions(podsim, path, sets).values()
    return [abs(r["error_pct"]) for r in rows], all(r["fits"] for r in rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--podsim", default=os.path.join(ROOT, "target/release/podsim"))
    # The validation files: the calibration rows first, then the two that check the choice.
    calibration, *checks = [os.path.join(ROOT, f) for f in DEFAULT_FILES]
    ap.add_argument("--file", default=calibration)
    ap.add_argument("--check", nargs="*", default=checks)
    ap.add_argument("--row-aim", type=float, default=10.0)
    ap.add_argument("--median-aim", type=float, default=5.0)
    a = ap.parse_args()
    if not os.access(a.podsim, os.X_OK):
        sys.exit(f"no podsim at {a.podsim} (cargo build --release, or pass --podsim)")

    print(f"{'matmul':>6} {'attn':>5} {'mean':>6} {'median':>7} {'largest':>8}  meets aims")
    candidates = []
    for m in MATMUL:
        for att in ATTENTION:
            e, fits = errors(a.podsim, a.file, m, att)
            mean, median, largest = statistics.mean(e), statistics.median(e), max(e)
            meets = largest <= a.row_aim and median <= a.median_aim and fits
            print(f"{m:>6} {att:>5} {mean:>5.2f}% {median:>6.1f}% {largest:>7.1f}%  "
                  f"{'yes' if meets else ''}")
            if meets:
                candidates.append((mean, median, largest, m, att))
    if not candidates:
        print("no point of the grid meets the aims", file=sys.stderr)
        return 1
    mean, median, largest, m, att = min(candidates)
    print(f"\nchosen: matmul_efficiency {m}, attention_efficiency {att} (mean {mean:.2f}%, "
          f"median {median:.1f}%, largest {largest:.1f}% on {a.file})")
    for path in a.check:
        e, _ = errors(a.podsim, path, m, att)
        within = sum(x <= a.row_aim for x in e)
        print(f"check {path}: median {statistics.median(e):.1f}%, largest {max(e):.1f}%, "
              f"{within} of {len(e)} rows within {a.row_aim:g}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
