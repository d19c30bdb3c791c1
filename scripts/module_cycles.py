#!/usr/bin/env python3
"""Import circles between the files of one crate: each group of files that reach each other
through `crate::`, `super::` and `self::` paths in code (not comments), outside `#[cfg(test)]` modules.

A file is a module (`src/a.rs` or `src/a/mod.rs` is `a`, `src/a/b.rs` is `a::b`); a path names
the deepest module that has a file (`crate::a::b::Item` is `a::b` if `src/a/b.rs` exists,
else `a`). Prints each circle, one per line, largest first, and a count per crate.

    scripts/module_cycles.py               # every crate of the workspace
    scripts/module_cycles.py links worker  # these crates
    scripts/module_cycles.py --check       # exit 1 when any crate has a circle
"""

import argparse
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = re.compile(r"\b(crate|super|self)((?:::[a-z_][a-z0-9_]*)+)")
GROUP_START = re.compile(r"\b(crate|super|self)::\{")
COMMENT = re.compile(r"//.*$", re.M)
TESTS = re.compile(r"^#\[cfg\(test\)\]\s*\n\s*(pub(\(crate\))? )?mod \w+\s*\{", re.M)


def modules(src):
    """Module path (a tuple) -> file, for every .rs file under `src`."""
    found = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(root, f), src)[:-3].split(os.sep)
            if rel[-1] == "mod" or rel == ["lib"] or rel == ["main"]:
                rel = rel[:-1]
            found[tuple(rel)] = os.path.join(root, f)
    return found


def code_of(text):
    """The file's code before its first `#[cfg(test)] mod ... {` (test modules end files),
    without comments: a doc link is not an import."""
    m = TESTS.search(text)
    text = text if m is None else text[: m.start()]
    return COMMENT.sub("", text)


def group_paths(text, i, prefix=()):
    """The module paths of a `{...}` group of a use that starts at `text[i]` (just inside the
    brace), nested groups included (`{a::{X, b}, c}` is a, a::b and c)."""
    paths, item = [], ""
    while i < len(text):
        c = text[i]
        if c == "{":
            inner = prefix + tuple(p for p in item.strip().strip(":").split("::") if p)
            nested, i = group_paths(text, i + 1, inner)
            paths += nested or [list(inner)]
            item = ""
        elif c in ",}":
            parts = [p for p in item.strip().split("::") if p]
            if parts and parts[0][0].islower():
                paths.append(list(prefix) + parts)
            item = ""
            if c == "}":
                return paths, i
        else:
            item += c
        i += 1
    return paths, i


def target(mods, here, base, parts):
    """The deepest module with a file that `base::parts` names, seen from module `here`."""
    if base == "crate":
        path = ()
    elif base == "self":
        path = here
    else:
        path = here[:-1]
    path = path + tuple(parts)
    while path and path not in mods:
        path = path[:-1]
    return path if path in mods else None


def edges(mods):
    graph = {m: set() for m in mods}
    for here, file in mods.items():
        text = code_of(open(file, encoding="utf-8").read())
        refs = [(b, p.strip(":").split("::")) for b, p in PATH.findall(text)]
        for m in GROUP_START.finditer(text):
            paths, _ = group_paths(text, m.end())
            refs += [(m.group(1), path) for path in paths]
        for base, parts in refs:
            to = target(mods, here, base, parts)
            if to is not None and to != here and to != () and here != ():
                graph[here].add(to)
    return graph


def circles(graph):
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = counter[0]
                counter[0] += 1
                stack.append(nxt)
                on.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
    return sorted(out, key=len, reverse=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("crates", nargs="*", help="crate folders (default: every folder with a Cargo.toml and src/)")
    ap.add_argument("--check", action="store_true", help="exit 1 when any crate has a circle")
    args = ap.parse_args()
    crates = args.crates or sorted(
        d for d in os.listdir(REPO)
        if os.path.isfile(os.path.join(REPO, d, "Cargo.toml")) and os.path.isdir(os.path.join(REPO, d, "src"))
    )
    total = 0
    for crate in crates:
        found = circles(edges(modules(os.path.join(REPO, crate, "src"))))
        total += len(found)
        print(f"{crate}: {len(found)} circle{'' if len(found) == 1 else 's'}")
        for comp in found:
            print("  " + " <-> ".join("::".join(m) for m in comp))
    if args.check and total:
        sys.exit(1)


if __name__ == "__main__":
    main()
