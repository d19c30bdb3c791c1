#!/usr/bin/env python3
"""Lists the workspace's non-test Rust functions longer than a bound (80 lines by default), by
brace matching: from the line of `fn name` to the line of its closing brace. Test code is left
out: `tests/` and `benches/` folders and `#[cfg(test)]` modules.

    python3 scripts/long_functions.py [--max 80] [--check]

`--check` exits 1 when any function is over the bound.
"""

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def crates():
    """The workspace's members, as the top-level Cargo.toml lists them."""
    text = (ROOT / "Cargo.toml").read_text()
    members = re.search(r"^members\s*=\s*\[([^\]]*)\]", text, re.M).group(1)
    return re.findall(r'"([^"]+)"', members)
FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)")


def strip(line):
    """The line without its string and char literals and `//` comment (braces in them do not
    count)."""
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])'", "''", line)
    return line.split("//", 1)[0]


def functions(path):
    """(name, first line, line count) of each function with a body, outside test modules."""
    depth = 0
    test_depth = None  # depth of the `#[cfg(test)]` item being skipped
    test_next = False  # a `#[cfg(test)]` was seen: the next item opening a brace is a test one
    waiting = None  # (name, line, depth): a `fn` seen, its body's brace not yet
    open_fns = []  # (name, line, depth outside its body)
    found = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = strip(raw)
        if "#[cfg(test)]" in line:
            test_next = True
        match = FN.match(line)
        if match and test_depth is None and not test_next:
            waiting = (match.group(6), number, depth)
        for ch in line:
            if ch == "{":
                if test_next and test_depth is None:
                    test_depth, test_next = depth, False
                if waiting is not None and depth == waiting[2]:
                    open_fns.append(waiting)
                    waiting = None
                depth += 1
            elif ch == "}":
                depth -= 1
                if test_depth is not None and depth == test_depth:
                    test_depth = None
                if open_fns and depth == open_fns[-1][2]:
                    name, start, _ = open_fns.pop()
                    found.append((name, start, number - start + 1))
            elif ch == ";":
                if waiting is not None and depth == waiting[2]:
                    waiting = None  # a declaration without a body
                if test_next and test_depth is None:
                    test_next = False  # the test-only item was a `use` or a declaration
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=80)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    long = []
    for crate in crates():
        for path in sorted((ROOT / crate).rglob("*.rs")):
            parts = path.relative_to(ROOT / crate).parts
            if parts[0] in ("tests", "benches", "target"):
                continue
            for name, start, count in functions(path):
                if count > args.max:
                    long.append((count, f"{path.relative_to(ROOT)}:{start}", name))
    for count, where, name in sorted(long, reverse=True):
        print(f"{count:5d}  {where}  {name}")
    print(f"{len(long)} non-test functions over {args.max} lines")
    return 1 if args.check and long else 0


if __name__ == "__main__":
    sys.exit(main())
