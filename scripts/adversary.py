#!/usr/bin/env python3
"""Each way podsim once lost data or said `ok` to a wrong result, tried again as an adversary
would: corrupted checkpoints, a shared output folder, a flood of connections to a worker's
link socket, kills of the coordinator and the worker under ranks that never import podsim,
nonsense config values, a full disk, a config of 16k unknown keys. Each case prints one row:
what was done, what podsim did, and whether that is the safe outcome (`ok`) or not (`FAIL`).

    scripts/adversary.py --podsim target/debug/podsim
    scripts/adversary.py --podsim target/release/podsim --cases checkpoint,folder --keep

Exit 1 if any case failed. Needs Linux; the flood from another uid and the full disk (a small
tmpfs) need root and are skipped, saying so, without it.
"""

import argparse
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAIN = """name = "adversary-{name}"
[topology]
shape = "2x2x2"
hardware = "v5p"
[launch]
workers = {workers}
[job]
kind = "train"
mode = "data"
strategy = "fsdp"
steps = {steps}
batch = 32
check = true
[job.model]
widths = [64, 256, 256, 10]
[job.optimizer]
kind = "adamw"
lr = 0.001
[recovery]
checkpoint_every = {every}
max_restarts = 2
[watchdog]
timeout_ms = {timeout_ms}
{faults}
"""

STALL_AT_7 = """[[faults]]
kind = "stall"
chip = 6
at_step = 7
"""


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def train_config(tmp, name, steps=10, every=2, faults="", workers=4, timeout_ms=3000):
    return write(
        os.path.join(tmp, name + ".toml"),
        TRAIN.format(name=name, steps=steps, every=every, faults=faults, workers=workers,
                     timeout_ms=timeout_ms),
    )


def report_of(out):
    try:
        with open(os.path.join(out, "report.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def launch(args, config, out, *extra, timeout=180):
    """Runs `podsim launch` to its end: (exit code, output, report or None)."""
    p = subprocess.run([args.podsim, "launch", config, "--out", out, *extra],
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, report_of(out)


# --- 1. checkpoints -------------------------------------------------------------------

def data_offset(path):
    """Where a safetensors file's data starts: 8 bytes of header length, then the header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n, header


def tensor_span(path, want):
    """(offset, length) in bytes of the first tensor whose name ends with `want`."""
    start, header = data_offset(path)
    for name, meta in header.items():
        if name != "__metadata__" and name.endswith(want):
            a, b = meta["data_offsets"]
            return start + a, b - a
    raise KeyError(want)


def flip_bit(path, tensor, element, bit):
    off, _ = tensor_span(path, tensor)
    with open(path, "r+b") as f:
        f.seek(off + 4 * element + bit // 8)
        byte = f.read(1)[0]
        f.seek(off + 4 * element + bit // 8)
        f.write(bytes([byte ^ (1 << (bit % 8))]))


def set_nan(path, tensor):
    off, _ = tensor_span(path, tensor)
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(struct.pack("<f", float("nan")))


DAMAGE = {
    # A flipped exponent bit: a value scaled by 2^64 (the job once trained on to 2.6e35).
    "exponent bit": lambda d: flip_bit(f"{d}/step-6/chip-0.safetensors", "weight", 0, 30),
    "low mantissa bit": lambda d: flip_bit(f"{d}/step-6/chip-3.safetensors", "weight", 5, 0),
    "NaN in a bias": lambda d: set_nan(f"{d}/step-6/chip-2.safetensors", "bias"),
    "chip 1's file over chip 0's": lambda d: os.replace(
        f"{d}/step-6/chip-1.safetensors", f"{d}/step-6/chip-0.safetensors"),
}


def wait_for(pred, timeout, every=0.02):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(every)
    return False


def damaged_run(args, tmp, label, damage, everything=False):
    """A job that checkpoints after steps 2, 4 and 6 and stalls at step 7: while the watchdog
    waits out the stall, `damage` changes the newest checkpoint (or every one)."""
    config = train_config(tmp, "ckpt", faults=STALL_AT_7)
    out = os.path.join(tmp, "ckpt-" + re.sub(r"\W+", "-", label))
    ckpt = os.path.join(out, "checkpoints")
    p = subprocess.Popen([args.podsim, "launch", config, "--out", out],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    whole = lambda s: all(os.path.exists(f"{ckpt}/step-{s}/chip-{c}.safetensors") for c in range(8))
    if not wait_for(lambda: whole(6), 60):
        p.kill()
        return None, "no checkpoint after step 6 appeared", None
    time.sleep(0.2)  # the renames of all eight are done; the stall holds the job
    if everything:
        for s in (2, 4, 6):
            flip_bit(f"{ckpt}/step-{s}/chip-5.safetensors", "weight", 1, 30)
    else:
        damage(ckpt)
    text, _ = p.communicate(timeout=180)
    return p.returncode, text, report_of(out)


def case_checkpoint(args, tmp):
    rows = []
    code, text, clean = launch(args, train_config(tmp, "clean"), os.path.join(tmp, "clean"))
    want = clean and clean["correctness"].get("final_params_hash")
    for label, damage in DAMAGE.items():
        code, text, r = damaged_run(args, tmp, label, damage)
        if r is None:
            rows.append((f"checkpoint: {label}", f"no report (exit {code}): {text[-300:]}", False))
            continue
        restarts = (r.get("recovery") or {}).get("restarts") or []
        skipped = restarts[0].get("checkpoints_skipped", []) if restarts else []
        resumed = restarts[0]["resumed_from_step"] if restarts else None
        same = r["correctness"].get("final_params_hash") == want
        ok = r["status"] == "ok" and resumed == 4 and len(skipped) == 1 and same
        why = skipped[0]["reason"] if skipped else "nothing skipped"
        rows.append((f"checkpoint: {label} (step 6)",
                     f"status {r['status']}, skipped step 6 ({why}), resumed from {resumed}, "
                     f"final parameters {'bit-identical to' if same else 'DIFFERENT from'} a clean run",
                     ok))
    code, text, r = damaged_run(args, tmp, "every", None, everything=True)
    refused = r and ((r.get("recovery") or {}).get("refused") or "")
    ok = code not in (0, None) and r is not None and r["status"] != "ok" and "chip-5" in refused
    rows.append(("checkpoint: every step damaged", f"exit {code}, status {r and r['status']}: {refused}", ok))
    return rows


STRATEGIES = {
    "ddp": "",
    "fsdp": "",
    "hsdp": "replicas = 2\n",
    "tp": "tp = 8\n",
    "fsdp+tp": "tp = 2\n",
    "ddp, AdamW, 2 micro-batches": "grad_accum = 2\n",
}
FAULTS_AT_7 = {
    "crash": '[[faults]]\nkind = "crash"\nchip = 6\nat_step = 7\n',
    "stall": STALL_AT_7,
    "freeze": '[[faults]]\nkind = "freeze"\nworker = 1\nat_step = 7\n',
}


def case_recovery(args, tmp):
    """Every strategy recovers from each failure to the bits of a run without it."""
    rows = []
    for label, extra in STRATEGIES.items():
        strategy = label.split(",")[0]
        hashes = {}
        for fault in ("none", *FAULTS_AT_7):
            name = re.sub(r"\W+", "-", f"rec-{label}-{fault}")
            text = open(train_config(tmp, name, faults=FAULTS_AT_7.get(fault, ""))).read()
            text = text.replace('strategy = "fsdp"', f'strategy = "{strategy}"\n{extra}')
            config = write(os.path.join(tmp, name + ".toml"), text)
            code, out, r = launch(args, config, os.path.join(tmp, name))
            restarts = len(((r or {}).get("recovery") or {}).get("restarts") or [])
            hashes[fault] = (r or {}).get("correctness", {}).get("final_params_hash")
            if fault == "none":
                continue
            ok = code == 0 and r["status"] == "ok" and restarts == 1 and hashes[fault] == hashes["none"]
            rows.append((f"recovery: {label}, {fault} at step 7",
                         f"exit {code}, {restarts} restart(s), final parameters "
                         f"{'bit-identical' if hashes[fault] == hashes['none'] else 'DIFFERENT'}", ok))
    return rows


# --- 2. one owner per folder ------------------------------------------------------------

def case_folder(args, tmp):
    out = os.path.join(tmp, "shared-folder")
    first = subprocess.Popen(
        [args.podsim, "launch", train_config(tmp, "long", steps=10, faults=STALL_AT_7, timeout_ms=4000),
         "--out", out], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: os.path.exists(os.path.join(out, ".podsim.lock")), 30)
    time.sleep(0.5)
    t0 = time.time()
    second = subprocess.run([args.podsim, "launch", train_config(tmp, "other", steps=34), "--out", out],
                            capture_output=True, text=True, timeout=60)
    took = time.time() - t0
    text, _ = first.communicate(timeout=180)
    r = report_of(out)
    named = f"pid {first.pid}" in second.stderr
    ok = second.returncode == 2 and named and took < 5 and r is not None and r["status"] == "ok" \
        and r["job"]["name"] == "adversary-long"
    msg = second.stderr.strip().splitlines()[-1] if second.stderr.strip() else "(nothing)"
    return [("second job on a busy folder",
             f"refused in {took:.1f} s, exit {second.returncode}: {msg[:160]}; the first ended "
             f"{r and r['status']}", ok)]


# --- 3. a flood of connections ----------------------------------------------------------

def unix_sockets_of(pid):
    """The abstract or path names of Unix sockets process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        m = re.match(r"socket:\[(\d+)\]", target)
        if m:
            inodes.add(m.group(1))
    names = []
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            # Flags 00010000: listening.
            if len(parts) >= 8 and parts[6] in inodes and parts[3] == "00010000":
                names.append(parts[7])
    return names


def children_of(pid):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(p))
    return out


def flood(name, count, uid):
    """Opens `count` connections to the Unix socket `name` (as user `uid` when given) in a
    child process and holds them 20 s; returns the child."""
    pid = os.fork()
    if pid == 0:
        try:
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)
            held = []
            addr = "\0" + name[1:] if name.startswith("@") else name
            for _ in range(count):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    s.connect(addr)
                except (BlockingIOError, OSError):
                    pass
                held.append(s)
            time.sleep(20)
        finally:
            os._exit(0)
    return pid


def case_flood(args, tmp):
    rows = []
    for who, uid in (("another uid", 65534), ("the same uid", None)):
        if uid is not None and os.geteuid() != 0:
            rows.append((f"1,100 connections from {who}", "skipped: needs root to change uid", True))
            continue
        out = os.path.join(tmp, f"flood-{uid}")
        job = subprocess.Popen([args.podsim, "launch",
                                train_config(tmp, "flood", steps=30, every=5, workers=2,
                                             faults="", timeout_ms=5000),
                                "--out", out, "--set", "job.steps=400"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        names = []
        if wait_for(lambda: any(unix_sockets_of(w) for w in children_of(job.pid)), 30):
            for w in children_of(job.pid):
                names += unix_sockets_of(w)
        floods = [flood(n, 1100, uid) for n in names]
        text, _ = job.communicate(timeout=300)
        for f in floods:
            os.kill(f, signal.SIGKILL)
            os.waitpid(f, 0)
        r = report_of(out)
        ok = bool(names) and r is not None and r["status"] == "ok" and job.returncode == 0
        rows.append((f"1,100 connections from {who} to each worker's link socket",
                     f"{len(names)} sockets flooded; job exit {job.returncode}, status "
                     f"{r and r['status']}", ok))
    return rows


# --- 4. ranks that never import podsim -------------------------------------------------

def ranks_alive(marker):
    alive = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        alive.append(int(p))
            except OSError:
                pass
    return alive


def case_ranks(args, tmp):
    rows = []
    python = os.environ.get("PODSIM_PYTHON", sys.executable)
    for victim, sig in (("coordinator", signal.SIGKILL), ("worker", signal.SIGKILL),
                        ("coordinator", signal.SIGTERM), ("coordinator", signal.SIGINT)):
        marker = f"adversary-sleeper-{victim}-{int(sig)}-{os.getpid()}"
        script = write(os.path.join(tmp, marker + ".py"), "import time\ntime.sleep(600)\n")
        out = os.path.join(tmp, marker)
        env = dict(os.environ, PODSIM_PYTHON=python)
        coord = subprocess.Popen([args.podsim, "run", "--topology", "2x2", "--out", out, "--",
                                  "python", script], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        started = wait_for(lambda: len(ranks_alive(marker)) >= 4, 30)
        target = coord.pid if victim == "coordinator" else (children_of(coord.pid) or [coord.pid])[0]
        os.kill(target, sig)
        gone = wait_for(lambda: not ranks_alive(marker), 10, every=0.1)
        left = ranks_alive(marker)
        for p in left:
            os.kill(p, signal.SIGKILL)
        try:
            os.killpg(coord.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        coord.wait()
        rows.append((f"{signal.Signals(sig).name} to the {victim} under ranks that never import podsim",
                     f"{'every rank gone' if gone else f'{len(left)} ranks LEFT RUNNING'}"
                     + ("" if started else " (the ranks never started)"), started and gone))
    # A rank that never connects: the job ends within the stated bound, naming the rank.
    script = write(os.path.join(tmp, "never.py"), "import time\ntime.sleep(600)\n")
    out = os.path.join(tmp, "never-connects")
    t0 = time.time()
    p = subprocess.run([args.podsim, "run", "--topology", "2", "--out", out,
                        "--set", "job.connect_timeout_s=5", "--", "python", script],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PODSIM_PYTHON=python))
    took = time.time() - t0
    said = (p.stdout + p.stderr)
    ok = p.returncode != 0 and "rank" in said and took < 60
    line = next((l for l in said.splitlines() if "rank" in l and "connect" in l), said.strip()[-200:])
    rows.append(("ranks that never connect", f"exit {p.returncode} after {took:.0f} s: {line[:200]}", ok))
    return rows


# --- 5. nonsense values -----------------------------------------------------------------

NONSENSE = {
    "slow factor 1e300": ('[[faults]]\nkind = "slow"\nchip = 1\nfactor = 1e300\n', {}),
    "a layer 2^63 - 1 wide": ("", {"job.model.widths": "[64, 9223372036854775807, 10]"}),
    "lr = nan": ("", {"job.optimizer.lr": "nan"}),
    "lr = inf": ("", {"job.optimizer.lr": "inf"}),
    "sizes beyond the host's memory": ("", {"job.model.widths": "[65536, 65536, 65536, 65536]",
                                             "job.batch": "65536"}),
    "a 30 s delay fault": ('[[faults]]\nkind = "delay"\nlink = "1:+x"\ndelay_ms = 30000\n', {}),
    "a 1e11 ms delay fault": ('[[faults]]\nkind = "delay"\nlink = "1:+x"\ndelay_ms = 1e11\n', {}),
}


def case_values(args, tmp):
    rows = []
    for label, (faults, sets) in NONSENSE.items():
        config = train_config(tmp, "nonsense", faults=faults)
        extra = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        p = subprocess.run([args.podsim, "validate", config, *extra], capture_output=True,
                           text=True, timeout=60)
        said = (p.stdout + p.stderr).strip()
        panicked = "panicked" in said
        ok = p.returncode == 2 and not panicked
        rows.append((f"config: {label}", f"exit {p.returncode}: {said.splitlines()[-1][:200] if said else ''}", ok))
    return rows


# --- 6. smaller ------------------------------------------------------------------------

def tree_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def on_tmpfs(mnt, size, run):
    """`run(mnt)` with a tmpfs of `size` bytes mounted at `mnt`; None if none can be had."""
    os.makedirs(mnt, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mnt]).returncode != 0:
        return None
    try:
        return run(mnt)
    finally:
        subprocess.run(["umount", "-l", mnt])


def case_disk(args, tmp):
    if os.geteuid() != 0:
        return [("a full disk", "skipped: mounting a small tmpfs needs root", True)]
    rows = []
    config = train_config(tmp, "disk", steps=10, every=2)
    # The checkpoints folder on a tmpfs where two steps' files fit and the third's do not (the
    # size of a step measured on a disk with room); the report beside it has room.
    free = os.path.join(tmp, "disk-free")
    launch(args, config, free)
    step = tree_bytes(os.path.join(free, "checkpoints", "step-2"))
    size = (2 * step + step // 2) // 4096 * 4096
    out = os.path.join(tmp, "disk-ckpt")

    def checkpoints_do_not_fit(mnt):
        code, _, r = launch(args, config, out)
        leftovers = [f for _, _, fs in os.walk(mnt) for f in fs if f.endswith(("tmp", "tmp~"))]
        failures = ((r or {}).get("recovery") or {}).get("write_failures") or []
        ok = code == 0 and r is not None and r["status"] == "ok" and failures and not leftovers
        return ("checkpoints on a full disk",
                f"exit {code}, status {r and r['status']}, {len(failures)} checkpoint writes failed "
                f"and training went on ({(failures or [''])[0][-60:]}); {len(leftovers)} temporary files left",
                ok)

    def report_does_not_fit(mnt):
        out = mnt
        code, text, _ = launch(args, config, out, "--set", "recovery.checkpoint_every=1000000")
        report = os.path.join(out, "report.json")
        torn = os.path.exists(report) and report_of(out) is None
        leftovers = [f for _, _, fs in os.walk(mnt) for f in fs if f.endswith(("tmp", "tmp~"))]
        said = [l for l in text.splitlines() if "cannot write" in l][-1:] or ["(nothing said)"]
        ok = code != 0 and not torn and not leftovers and "No space left" in said[0]
        return ("a report on a full disk",
                f"exit {code}; report.json {'TORN' if torn else 'whole or absent'}; "
                f"{len(leftovers)} temporary files left; {said[0][:120]}", ok)

    for where, size_, run in ((os.path.join(out, "checkpoints"), size, checkpoints_do_not_fit),
                              (os.path.join(tmp, "tiny-report"), 8192, report_does_not_fit)):
        row = on_tmpfs(where, size_, run)
        rows.append(row or (where, "skipped: could not mount a tmpfs here", True))
    return rows


def case_keys(args, tmp):
    rows = []
    base = open(train_config(tmp, "keys")).read()
    many = base + "".join(f"unknown_key_{i} = {i}\n" for i in range(16000))
    path = write(os.path.join(tmp, "keys-16k.toml"), many)
    t0 = time.time()
    p = subprocess.run([args.podsim, "validate", path], capture_output=True, text=True, timeout=300)
    took = time.time() - t0
    problems = (p.stdout + p.stderr).count("unknown_key_")
    rows.append(("16,000 unknown keys", f"exit {p.returncode}, {problems} named, in {took:.1f} s",
                 p.returncode == 2 and problems >= 16000 and took < 10))
    slices = base.replace('shape = "2x2x2"', 'shape = "2x2x2"\nslices = 100000')
    path = write(os.path.join(tmp, "slices.toml"), slices)
    t0 = time.time()
    p = subprocess.run([args.podsim, "validate", path, "--set", "job.mode=\"meta\""],
                       capture_output=True, text=True, timeout=300)
    took = time.time() - t0
    rows.append(("100,000 slices", f"exit {p.returncode} in {took:.1f} s", took < 10))
    return rows


def case_token(args, tmp):
    env = dict(os.environ, PODSIM_TOKEN="adversary-secret-token")
    p = subprocess.Popen([args.podsim, "coordinator", train_config(tmp, "token"), "--listen",
                          "127.0.0.1:0", "--out", os.path.join(tmp, "token"), "--join-timeout", "3"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    text, _ = p.communicate(timeout=60)
    leaked = "adversary-secret-token" in text
    line = next((l for l in text.splitlines() if "waiting for" in l), "")
    return [("PODSIM_TOKEN set", f"{'TOKEN PRINTED' if leaked else 'not printed'}: {line[:160]}",
             not leaked and bool(line))]


def case_load(args, tmp):
    """A healthy torch job on a host running 40 busy processes (load ~40 on 2 cores) once
    ended as frozen_worker after 10 s: the worker's heartbeat waited for a CPU."""
    python = os.environ.get("PODSIM_PYTHON", sys.executable)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(40)]
    try:
        out = os.path.join(tmp, "loaded")
        t0 = time.time()
        # A program ending in .py runs under $PODSIM_PYTHON (torch's environment).
        p = subprocess.run([args.podsim, "run", "--topology", "2x2", "--out", out, "--",
                            os.path.join(ROOT, "examples", "torch", "ddp.py"), "--steps", "10"],
                           capture_output=True, text=True, timeout=900,
                           env=dict(os.environ, PODSIM_PYTHON=python))
        took = time.time() - t0
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    r = report_of(out)
    hang = (r or {}).get("hang") or {}
    return [("a torch job beside 40 busy processes",
             f"exit {p.returncode} after {took:.0f} s, status {r and r['status']}"
             + (f" ({hang.get('kind')})" if hang else ""),
             p.returncode == 0 and r is not None and r["status"] == "ok")]


CASES = {
    "checkpoint": case_checkpoint,
    "recovery": case_recovery,
    "folder": case_folder,
    "flood": case_flood,
    "ranks": case_ranks,
    "values": case_values,
    "disk": case_disk,
    "keys": case_keys,
    "token": case_token,
    "load": case_load,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--podsim", default=os.path.join(ROOT, "target", "debug", "podsim"))
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ",".join(CASES))
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = ap.parse_args()
    args.podsim = os.path.abspath(args.podsim)
    tmp = tempfile.mkdtemp(prefix="podsim-adversary-")
    failed = 0
    try:
        for name in args.cases.split(","):
            for what, outcome, ok in CASES[name](args, tmp):
                failed += not ok
                print(f"{'ok  ' if ok else 'FAIL'}  {what}: {outcome}", flush=True)
    finally:
        if args.keep:
            print(f"scratch: {tmp}")
        else:
            subprocess.run(["rm", "-rf", tmp])
    print(f"adversary: {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
