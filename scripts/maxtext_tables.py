#!/usr/bin/env python3
"""Writes configs/validation/maxtext_tables.csv: every row of MaxText's published v4, v5e and
v5p performance tables as a `podsim compare` row, for checking the kernel model on
measurements it was not set against.

Each table gives TFLOP/s per chip for one model on 1, 2, 4, ... slices. The model and the run
(batch, remat, tensor parallelism) are those of the table's scripts
(`MaxText/configs/{v4,v5e,v5p}/*.sh` as they stood when the tables were published), the model
shapes follow MaxText's `global_parameter_scale` rule, and the step time is the model flops
the table divided by over its TFLOP/s: 6 per weight per token plus attention counted as that
table's MaxText version counted it (v5e: non-causal; v5p: three quarters of non-causal; v4:
none). That conversion is checked here against the rows the tables share with
configs/validation/published.csv (which came from the same tables), so both files say the same.

    python3 scripts/maxtext_tables.py [OUT.csv]      # default: configs/validation/maxtext_tables.csv
"""

import csv
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 32768

# Slice shapes by TPU type name (v4 and v5p names count TensorCores: two per chip).
TOPOLOGY = {
    "v4-128": "4x4x4",
    "v4-384": "4x4x12",
    "v5e-256": "16x16",
    "v5p-128": "4x4x4",
    "v5p-256": "4x4x8",
    "v5p-512": "4x8x8",
    "v5p-1024": "8x8x8",
    "v5p-2048": "8x8x16",
    "v5p-4096": "8x16x16",
}

# (hardware, model, slice type, per-chip batch, remat, ici_tp, seq, attention count,
#  {slices: TFLOP/s per chip}); ici_fsdp is the rest of the slice.
TABLES = [
    ("v5e", 16, "v5e-256", 6, "full", 1, 2048, 1.0, {1: 120, 2: 117, 4: 117, 8: 115, 16: 111, 32: 108}),
    ("v5e", 32, "v5e-256", 4, "full", 1, 2048, 1.0, {1: 132, 2: 128, 4: 126, 8: 125, 16: 123, 32: 119}),
    ("v5e", 64, "v5e-256", 2, "full", 1, 2048, 1.0, {1: 118, 2: 112, 4: 110, 8: 108, 16: 105, 32: 99}),
    ("v5e", 128, "v5e-256", 1, "full", 16, 2048, 1.0, {1: 110, 2: 110, 4: 108, 8: 104, 16: 100, 32: 91}),
    ("v5p", 32, "v5p-128", 8, "minimal", 4, 2048, 0.75, {1: 328, 2: 319}),
    ("v5p", 64, "v5p-128", 4, "minimal", 4, 2048, 0.75, {1: 323, 2: 309}),
    ("v5p", 128, "v5p-256", 2, "minimal", 8, 2048, 0.75, {1: 315, 2: 305}),
    ("v5p", 128, "v5p-512", 2, "minimal", 8, 2048, 0.75, {1: 316, 2: 274}),
    ("v5p", 256, "v5p-1024", 2, "minimal", 8, 2048, 0.75, {1: 308, 2: 289}),
    ("v5p", 512, "v5p-1024", 2, "full", 16, 2048, 0.75, {1: 294, 2: 282}),
    ("v5p", 1024, "v5p-2048", 2, "full", 16, 2048, 0.75, {1: 254, 2: 237}),
    ("v5p", 1024, "v5p-4096", 2, "full", 16, 2048, 0.75, {1: 297, 2: 279}),
    # The v4 scripts set the shape by hand; sequences of 1024 as in published.csv's row C1.
    ("v4", (48, 6144, 24, 24576), "v4-128", 16, "full", 1, 1024, 0.0, {1: 156, 2: 152, 4: 149, 8: 146}),
    ("v4", (32, 12288, 32, 49152), "v4-384", 10, "full", 1, 1024, 0.0, {1: 154, 2: 162}),
]


# How each table's MaxText computed attention. The v4 table (README, 2023-04-27, commit
# 281e04bf3) predates MaxText's flash attention (commit 5b0e28e04, 2023-09-06): its runs
# materialised the score matrices (`dot_product`). The v5e tables (2023-10-24/27, scripts with
# `enable_flash_attention=true` from 5ebcd67fe) and v5p tables (2023-12, `attention='flash'`)
# ran the Pallas flash kernel.
ATTENTION = {"v4": "dot_product", "v5e": "flash", "v5p": "flash"}


def scaled_shape(scale):
    """MaxText's global_parameter_scale: a power of two spread over heads/mlp, width, depth."""
    base, rem = divmod(int(math.log2(scale)), 3)
    heads = base + int(rem > 0)
    width = base + int(rem > 1)
    return 16 << base, 2560 << width, 8 << heads, 8192 << heads


def step_seconds(layers, d_model, heads, ffn, head_dim, seq, batch, attention, tflops):
    weights = layers * (4 * d_model * heads * head_dim + 2 * d_model * ffn + d_model)
    weights += VOCAB * d_model + d_model
    flops = 6 * weights * seq * batch + attention * 12 * heads * layers * head_dim * seq * seq * batch
    return flops / 1e12 / tflops


def rows():
    for hw, model, slice_type, batch, remat, tp, seq, attention, tables in TABLES:
        if isinstance(model, tuple):
            layers, d_model, heads, ffn = model
            name = {48: "22B", 32: "52B"}[layers]
        else:
            layers, d_model, heads, ffn = scaled_shape(model)
            name = f"{model}B"
        topology = TOPOLOGY[slice_type]
        chips = math.prod(int(x) for x in topology.split("x"))
        for slices, tflops in tables.items():
            yield {
                "id": f"{hw}-{name}-{slices}x{slice_type.split('-')[1]}",
                "hardware": hw,
                "topology": topology,
                "wraparound": "true",
                "slices": slices,
                "layers": layers,
                "d_model": d_model,
                "heads": heads,
                "kv_heads": heads,
                "head_dim": 256,
                "ffn": ffn,
                "mlp": "relu",
                "block": "parallel",
                "attention": ATTENTION[hw],
                "vocab": VOCAB,
                "tied_embeddings": "true",
                "seq": seq,
                "batch_per_chip": batch,
                "ici_fsdp": chips // tp,
                "ici_tp": tp,
                "dcn_dp": slices,
                "remat": remat,
                "measured_step_s": f"{step_seconds(layers, d_model, heads, ffn, 256, seq, batch, attention, tflops):.3f}",
                "source": f"maxtext {hw} README {name} {slices}x {slice_type} ({tflops} TFLOP/s/chip)",
            }


def check_against_published(out):
    """Rows of the calibration set that came from these tables must agree to the published figures' last digit."""
    by_source = {r["source"]: r for r in out}
    checked = 0
    with open(os.path.join(ROOT, "configs", "validation", "published.csv")) as f:
        for row in csv.DictReader(f):
            mine = by_source.get(row["source"])
            if mine is None:
                continue
            for column in ("layers", "d_model", "heads", "ffn", "attention", "seq", "batch_per_chip", "ici_fsdp", "ici_tp", "remat"):
                if str(mine[column]) != row[column]:
                    sys.exit(f"{row['id']}: {column} {mine[column]} here, {row[column]} in published.csv")
            if abs(float(mine["measured_step_s"]) - float(row["measured_step_s"])) > 0.005:
                sys.exit(f"{row['id']}: {mine['measured_step_s']} s here, {row['measured_step_s']} s in published.csv")
            checked += 1
    return checked


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "configs", "validation", "maxtext_tables.csv")
    out = list(rows())
    checked = check_against_published(out)
    with open(path, "w", newline="") as f:
        f.write("# Generated by scripts/maxtext_tables.py: MaxText's published v4, v5e and v5p tables, row by row.\n")
        writer = csv.DictWriter(f, fieldnames=list(out[0]))
        writer.writeheader()
        writer.writerows(out)
    print(f"{path}: {len(out)} rows ({checked} agree with the calibration set's rows from the same tables)")


if __name__ == "__main__":
    main()
