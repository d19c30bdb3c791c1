#!/usr/bin/env python3
"""Crates of the dependency graph that only run at build time, for Cargo.toml's profile.

`[profile.dev.package."*"] opt-level = 2` optimises every dependency, and a package override
outranks `[profile.dev.build-override]`: proc macros, build scripts and the crates only they
use would be optimised too, though nothing of them runs in a test. Cargo.toml names each such
crate with `opt-level = 0`. This script computes the set from `cargo metadata`: a crate is
build-time only when no workspace member reaches it through normal dependencies (and dev
dependencies of the members) without passing a proc macro, while a proc macro or a build
dependency does reach it. Crates only some other platform builds are left out (a profile entry
that matches no package is a warning, and the suite takes warnings for errors).

    python3 scripts/host_only_crates.py           # the Cargo.toml entries
    python3 scripts/host_only_crates.py --check   # exit 1 when Cargo.toml disagrees
"""

import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def metadata():
    out = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--filter-platform",
         host_triple()],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def host_triple():
    out = subprocess.run(["rustc", "-vV"], check=True, capture_output=True, text=True).stdout
    return re.search(r"^host: (\S+)$", out, re.M).group(1)


def build_time_only(meta):
    """Names of the crates that only build scripts and proc macros use."""
    packages = {p["id"]: p for p in meta["packages"]}
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    members = set(meta["workspace_members"])

    def proc_macro(pid):
        return any("proc-macro" in t["kind"] for t in packages[pid]["targets"])

    def kinds(dep):
        return {k["kind"] for k in dep["dep_kinds"]}

    run_time, seeds, todo = set(), [], list(members)
    while todo:
        pid = todo.pop()
        if pid in run_time:
            continue
        run_time.add(pid)
        for dep in nodes[pid]["deps"]:
            k = kinds(dep)
            if None in k or (pid in members and "dev" in k):
                (seeds if proc_macro(dep["pkg"]) else todo).append(dep["pkg"])
            if "build" in k:
                seeds.append(dep["pkg"])
    build_time = set()
    while seeds:
        pid = seeds.pop()
        if pid in build_time:
            continue
        build_time.add(pid)
        seeds += [d["pkg"] for d in nodes[pid]["deps"] if kinds(d) & {None, "build"}]
    run_names = {packages[p]["name"] for p in run_time}
    return sorted({packages[p]["name"] for p in build_time} - run_names)


def listed():
    """The crates Cargo.toml gives `opt-level = 0`."""
    text = open(os.path.join(ROOT, "Cargo.toml")).read()
    return sorted(re.findall(r'^\[profile\.dev\.package\.([A-Za-z0-9_-]+)\]\nopt-level = 0$',
                             text, re.M))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when Cargo.toml's list differs from the graph's")
    args = ap.parse_args()
    meta = metadata()
    want = build_time_only(meta)
    # The workspace's own crates are chosen by hand (the coordinator is unoptimised on purpose).
    own = {p["name"] for p in meta["packages"] if p["id"] in meta["workspace_members"]}
    if not args.check:
        for name in want:
            print(f"[profile.dev.package.{name}]\nopt-level = 0")
        return 0
    have = [name for name in listed() if name not in own]
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    for name in missing:
        print(f"Cargo.toml: build-time crate {name} is not given opt-level = 0", file=sys.stderr)
    for name in extra:
        print(f"Cargo.toml: {name} has opt-level = 0 but runs in the tests (or is gone)",
              file=sys.stderr)
    return 1 if missing or extra else 0


if __name__ == "__main__":
    sys.exit(main())
