#!/usr/bin/env python3
"""Clang's thread-safety analysis over every source file of the release build.

CONVENTIONS.md: protected fields carry GUARDED_BY / REQUIRES annotations and a
clang build with -Wthread-safety -Werror checks them (g++ ignores them). This
runs clang++ -fsyntax-only with each file's flags from
build/release/compile_commands.json and fails on any thread-safety diagnostic.
Usage: scripts/check_thread_safety.py [BUILD_DIR]   (default build/release)
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


def check(entry):
    r = subprocess.run(clang_args(entry), capture_output=True, text=True,
                       cwd=entry["directory"], timeout=600)
    return entry["file"], r.returncode, r.stderr


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else "build/release"
    db = os.path.join(build, "compile_commands.json")
    if not os.path.exists(db):
        print(f"check_thread_safety: {db} not found; build the release flavour first",
              file=sys.stderr)
        return 2
    root = os.path.abspath(".")
    entries = [e for e in json.load(open(db))
               if e["file"].startswith(os.path.join(root, "src") + os.sep)]
    failed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for path, rc, err in pool.map(check, entries):
            if rc != 0:
                failed.append(path)
                sys.stderr.write(err)
    print(f"check_thread_safety: {len(entries)} files, {len(failed)} with diagnostics",
          file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
