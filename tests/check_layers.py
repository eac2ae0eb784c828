#!/usr/bin/env python3
"""check_layers.py - fails when a source file includes a header from a layer above its own.

The layers, bottom to top (docs/architecture.md):

    base  <-  hal  <-  models  <-  core  <-  server  <-  tools

A file may include headers of its own layer and of the layers below it. The plugins
(backends/*, plugins/*) are separate binaries: they may include only the ABI headers
(kiln/hal*.h) and files of their own tree (backends/ for Kiln's backends, which share
sources: the ROCm plugin is the CUDA plugin's sources built by hipcc; their own folder for
plugins/*). tests/ may include anything.

An include is resolved the way the build resolves it: relative to the including file first,
then from the source root (the one include directory the libraries use), then from
hal/include and include/ (the ABI and public headers, <kiln/...>). System headers in angle
brackets are not checked. A quoted include that resolves nowhere is an error too: the check
must see every project header.

usage: check_layers.py [SOURCE_ROOT]     exit 0 = clean, 1 = violations (listed), 2 = usage
"""
import os
import re
import sys

RANK = {"base": 0, "hal": 1, "models": 2, "core": 3, "server": 4, "tools": 5}
EXTS = (".c", ".h", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]')


def layer_of(rel):
    """The layer of a file given its path relative to the root, or None when unchecked."""
    parts = rel.split("/")
    top = parts[0]
    if top == "include":  # include/kiln/kiln.h: the engine's public API
        return "core"
    if top in RANK:
        return top
    if top in ("backends", "plugins"):
        return top
    return None  # tests/, cmake/, build trees, ...


def resolve(root, src_rel, quote, name):
    """The include's path relative to root, or None (a system header, or unresolved)."""
    cands = []
    if quote == '"':
        cands.append(os.path.join(os.path.dirname(src_rel), name))
        cands.append(name)
        if src_rel.startswith("backends/rocm/"):  # its build adds backends/cuda to the path
            cands.append(os.path.join("backends/cuda", name))
    cands.append(os.path.join("hal/include", name))
    cands.append(os.path.join("include", name))
    for c in cands:
        c = os.path.normpath(c)
        if not c.startswith("..") and os.path.isfile(os.path.join(root, c)):
            return c
    return None


def allowed(src_rel, src_layer, dst_rel):
    dst_layer = layer_of(dst_rel)
    if src_layer in ("backends", "plugins"):
        if re.fullmatch(r"hal/include/kiln/hal[a-z_]*\.h", dst_rel):
            return True
        if src_layer == "backends":
            return dst_rel.startswith("backends/")
        own = "/".join(src_rel.split("/")[:2]) + "/"
        return dst_rel.startswith(own)
    if dst_layer is None or dst_layer in ("backends", "plugins"):
        return False  # a library including a plugin's or a test's file
    return RANK[dst_layer] <= RANK[src_layer]


def main(argv):
    if len(argv) > 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    root = os.path.abspath(argv[1] if len(argv) == 2 else
                           os.path.join(os.path.dirname(__file__), ".."))
    bad, files = [], 0
    for top in sorted(set(RANK) | {"include", "backends", "plugins"}):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "build")))
            for fn in sorted(filenames):
                if not fn.endswith(EXTS):
                    continue
                src_rel = os.path.relpath(os.path.join(dirpath, fn), root)
                src_layer = layer_of(src_rel)
                files += 1
                with open(os.path.join(root, src_rel), encoding="utf-8", errors="replace") as f:
                    for lineno, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        quote, name = m.group(1), m.group(2)
                        dst = resolve(root, src_rel, quote, name)
                        if dst is None:
                            if quote == '"':
                                bad.append(f"{src_rel}:{lineno}: \"{name}\" resolves to no file")
                            continue
                        if not allowed(src_rel, src_layer, dst):
                            dl = layer_of(dst) or "tests"
                            bad.append(f"{src_rel}:{lineno}: {src_layer} includes {dst} ({dl})")
    for b in bad:
        print(b)
    print(f"check_layers: {files} files, {len(bad)} upward or foreign includes")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
