#!/usr/bin/env bash
# The whole test suite: formatting, lints (warnings are errors), then every test.
# Ends with one line totalling the tests of every test binary.
set -euo pipefail
cd "$(dirname "$0")/.."
# Where the time goes: each phase's wall time and the machine's busy CPU seconds over it
# (from /proc/stat, so that rank processes a rank server reaps count too), printed as it ends
# and again at the end. A phase with much less CPU than twice its wall leaves a core idle: it
# mostly waits (watchdogs, heartbeats, ranks starting).
busy_cpu() {
    local _ user nice system idle iowait irq softirq steal
    read -r _ user nice system idle iowait irq softirq steal _ < /proc/stat
    cpu_now=$(((user + nice + system + irq + softirq + steal) / $(getconf CLK_TCK)))
}
phases=""
phase_start=$SECONDS
busy_cpu
phase_cpu=$cpu_now
phase() {
    busy_cpu
    phases+=$(printf '%-24s %4d s wall %5d s CPU\n' "$1" $((SECONDS - phase_start)) $((cpu_now - phase_cpu)))$'\n'
    echo "phase $1: $((SECONDS - phase_start)) s wall, $((cpu_now - phase_cpu)) s CPU"
    phase_start=$SECONDS
    phase_cpu=$cpu_now
}
cargo fmt --all --check
# Cargo.toml's list of build-time crates (compiled unoptimised) against the dependency graph.
python3 scripts/host_only_crates.py --check
# The code's shape (CONTRIBUTING.md): no non-test function over 80 lines, no two files of one
# crate importing each other in a circle.
python3 scripts/long_functions.py --check
python3 scripts/module_cycles.py --check
phase "fmt and shape"
log=$(mktemp)
build_log=$(mktemp)
trap 'rm -f "$log" "$log".* "$build_log"' EXIT
# Clippy with warnings as errors on every target of the workspace - what `cargo clippy
# --workspace --all-targets -- -D warnings` checks - run as the compiler of the test build
# itself, as `cargo clippy` runs it under `cargo check`: the dependencies are then compiled
# once instead of checked and then built again (from a clean clone, 13 minutes of build become
# 8; docs/PERFORMANCE.md). Exported, so that every cargo command below reuses this build.
clippy_driver=$(rustup which clippy-driver 2>/dev/null || command -v clippy-driver) || {
    echo "clippy-driver not found: install the clippy component (rustup component add clippy)" >&2
    exit 1
}
export RUSTC_WORKSPACE_WRAPPER="$clippy_driver"
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
cargo test --workspace --all-targets --no-run 2>&1 | tee "$build_log"
# Belt and braces: should the driver ever stop honouring CLIPPY_ARGS, lints would only warn.
if grep -q '^warning' "$build_log"; then
    echo "the build printed warnings (lints are errors here)" >&2
    exit 1
fi
phase "clippy and test build"
# Every test once, in two streams side by side, four tests at a time in each: the end-to-end
# and fault tests mostly wait on the processes they start (heartbeats, watchdogs), and cargo
# runs test binaries one after another, so one stream left a core idle (docs/PERFORMANCE.md).
# One stream runs the end-to-end binary, the other every other test target of the workspace
# (read from `cargo metadata`, so that a new test binary is never left out), then the doc
# tests.
other_tests=$(cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
names = {t["name"] for p in json.load(sys.stdin)["packages"] for t in p["targets"]
         if "test" in t["kind"] and t["name"] != "end_to_end"}
print(" ".join(f"--test {n}" for n in sorted(names)))')
export RUST_TEST_THREADS=4
cargo test --workspace --test end_to_end > "$log.e2e" 2>&1 &
e2e=$!
# shellcheck disable=SC2086 # one word per flag and name
{ cargo test --workspace --lib --bins $other_tests && cargo test --workspace --doc; } \
    > "$log.rest" 2>&1 || failed_rest=1
wait $e2e || failed_e2e=1
unset RUST_TEST_THREADS
for part in rest e2e; do
    cat "$log.$part"
    cat "$log.$part" >> "$log"
done
[ -z "${failed_rest:-}${failed_e2e:-}" ] || { echo "a test failed (its log is above)" >&2; exit 1; }
phase "tests"
# The transport passes: every test whose chips talk across worker processes again, with the
# links between workers forced over records on TCP, then over gRPC (the run above takes the
# default: Unix sockets with large payloads in shared memory between workers on this host).
# Unix sockets alone get no pass of their own: such a link is the default's socket with TCP's
# records (every byte in the stream, no shared region), and `each_transport_...` moves and
# checks values over it. Each pass runs the fault tests whole, and of the tests end to end those of
# launching, orphans and training. Left out, as the run above covers them whatever the
# transport: the tests of one worker (torch ranks), of config errors, of one property of
# training (memory, speed, a falling loss), and `each_transport_...` (every transport in one
# test). `--workspace`, as above, so that cargo builds nothing again (`-p` alone resolves
# other features and rebuilt the worker and the coordinator, a minute).
transport_pass() {
    export PODSIM_TRANSPORT=$1
    cargo test --workspace --test faults --test stragglers &&
        cargo test --workspace --test end_to_end -- launch:: orphans:: training:: \
            --skip rank --skip connect_bound --skip each_transport --skip tls_files \
            --skip eighth --skip fused_ddp --skip quickstart --skip hbm_budget
}
# The watchdog's fault matrix, bounded: every kind at three places on 8x8x8 over 2 workers
# (kind and culprit checked; detection times are printed, not enforced on a shared machine),
# two cases at a time.
fault_matrix() {
    python3 scripts/fault_matrix.py --podsim target/debug/podsim --shape 8x8x8 --workers 2 \
        --deadline 120 --jobs 2 --check
}
# The two passes and the matrix run side by side: they mostly wait for watchdogs and
# heartbeats, and each picks its own ports and folders. Each writes its own log, printed whole once
# all have ended. (Under their load a cut's links are confirmed lost a heartbeat apart; the
# watchdog waits for the others before it judges.)
pids=()
for transport in tcp grpc; do
    transport_pass $transport > "$log.$transport" 2>&1 &
    pids+=($!)
done
fault_matrix > "$log.matrix" 2>&1 &
pids+=($!)
failed=0
for pid in "${pids[@]}"; do
    wait "$pid" || failed=1
done
for part in tcp grpc matrix; do
    if [ $part = matrix ]; then echo "--- fault matrix"; else echo "--- transport pass: $part"; fi
    cat "$log.$part"
    cat "$log.$part" >> "$log"
done
[ $failed = 0 ] || { echo "a transport pass or the fault matrix failed (its log is above)" >&2; exit 1; }
phase "transport passes, fault matrix"
# The PyTorch backend against torchrun + gloo, and fault tests with Python ranks, in a virtual
# environment outside the working tree (created once: torch from PyPI, ~3 GB; reused after).
# torchrun's results are kept outside the tree too (~/.cache/podsim/torch-refs, keyed by the
# example scripts and torch's version); `--fresh-references` runs torchrun again.
py=$(bash scripts/python_env.sh)
phase "python environment"
# The Python package's own unit tests (wire framing, local reductions, fused kernels, the
# rank server): no podsim binary; beside the torch cases, which leave a core idle at times
# (their ranks wait on watchdogs and stores).
(cd python && "$py" -m unittest discover -s tests > "$log.python" 2>&1) &
unit=$!
PYTHONPATH="$PWD/python" PODSIM_PYTHON="$py" "$py" scripts/torch_tests.py --podsim target/debug/podsim --jobs 2 2>&1 | tee -a "$log" ||
    failed_torch=1
wait $unit || failed_unit=1
cat "$log.python"
cat "$log.python" >> "$log"
if [ -n "${failed_torch:-}${failed_unit:-}" ]; then
    # The failed cases once more, last, where a log's tail shows them.
    grep -a '^torch test FAILED' "$log" | cut -c1-1500 >&2 || true
    echo "a torch case or a unit test of the Python package failed (above)" >&2
    exit 1
fi
phase "python and torch tests"
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1) } }
     /^torch tests:/ { p += $3; f += $5 }
     /^Ran [0-9]+ tests? in/ { ran = $2 } /^OK/ { p += ran; ran = 0 } /^FAILED \(/ { f += ran; ran = 0 }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
printf 'wall time by phase:\n%s' "$phases"
