#!/usr/bin/env python3
"""Clang's thread-safety analysis over the source files of the release build.

CONVENTIONS.md: protected fields carry GUARDED_BY / REQUIRES annotations and a
clang build with -Wthread-safety -Werror checks them (g++ ignores them). The
sanitizer flavours are clang builds that already compile with
-Werror=thread-safety; this runs clang++ -fsyntax-only, with each file's flags
from BUILD_DIR/compile_commands.json, over the files those builds left out (the
CLI, the benchmarks, the examples), or over all of them when no clang build is
named, and fails on any thread-safety diagnostic.
Usage: scripts/check_thread_safety.py [BUILD_DIR] [--skip-built-by CLANG_BUILD_DIR ...]
       (default build/release)
"""
import concurrent.futures
import json
import os
import shlex
import subprocess
import sys


def clang_args(entry):
    args = shlex.split(entry["command"])[1:]
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "-o":
            skip = True
            continue
        if a == "-c":
            continue
        out.append(a)
    return ["clang++", "-fsyntax-only", "-Wno-unused-command-line-argument",
            "-Wthread-safety", "-Werror=thread-safety"] + out


def load_entries(db):
    """The compile commands of BUILD_DIR, one per source file: a unity batch (CMake's
    Unity/unity_N_cxx.cxx, which #includes its sources by absolute path) stands for each of
    its sources, compiled alone with the batch's flags; such an entry keeps the batch's own
    entry under "batch"."""
    out = []
    for e in json.load(open(db)):
        f = e["file"]
        if os.sep + "Unity" + os.sep not in f or not f.endswith("_cxx.cxx"):
            out.append(e)
            continue
        with open(f) as batch:
            for line in batch:
                line = line.strip()
                if line.startswith('#include "') and line.endswith('"'):
                    src = line[len('#include "'):-1]
                    out.append(dict(e, file=src, command=e["command"].replace(f, src), batch=e))
    return out


def whole_batches(entries):
    """`entries` with each unity batch whose every source is among them replaced by the batch
    itself: one clang call parses the headers its sources share once (the CLI's 25 files in 3
    calls instead of 25) and analyses the same functions."""
    listed = {}
    for e in entries:
        if "batch" in e:
            listed[e["batch"]["file"]] = listed.get(e["batch"]["file"], 0) + 1
    whole = set()
    for path, n in listed.items():
        with open(path) as f:
            if n == sum(1 for line in f if line.strip().startswith('#include "')):
                whole.add(path)
    out, seen = [], set()
    for e in entries:
        b = e.get("batch")
        if b is None or b["file"] not in whole:
            out.append(e)
        elif b["file"] not in seen:
            seen.add(b["file"])
            out.append(b)
    return out


def check(entry):
    r = subprocess.run(clang_args(entry), capture_output=True, text=True,
                       cwd=entry["directory"], timeout=600)
    return entry["file"], r.returncode, r.stderr


def main():
    args = sys.argv[1:]
    skip_dirs = []
    while "--skip-built-by" in args:
        i = args.index("--skip-built-by")
        skip_dirs.append(args[i + 1])
        del args[i:i + 2]
    build = args[0] if args else "build/release"
    db = os.path.join(build, "compile_commands.json")
    if not os.path.exists(db):
        print(f"check_thread_safety: {db} not found; build the release flavour first",
              file=sys.stderr)
        return 2
    root = os.path.abspath(".")
    entries = [e for e in load_entries(db)
               if e["file"].startswith(os.path.join(root, "src") + os.sep)]
    covered = set()
    for d in skip_dirs:
        path = os.path.join(d, "compile_commands.json")
        if not os.path.exists(path):
            print(f"check_thread_safety: {path} not found; checking every file", file=sys.stderr)
            continue
        covered |= {e["file"] for e in load_entries(path)}
    skipped = sum(1 for e in entries if e["file"] in covered)
    entries = [e for e in entries if e["file"] not in covered]
    calls = whole_batches(entries)
    failed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for path, rc, err in pool.map(check, calls):
            if rc != 0:
                failed.append(path)
                sys.stderr.write(err)
    print(f"check_thread_safety: {len(entries)} files in {len(calls)} clang calls, "
          f"{len(failed)} calls with diagnostics ({skipped} more files checked by the clang "
          f"builds)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
