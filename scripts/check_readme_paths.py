#!/usr/bin/env python3
"""The READMEs name only files of this repository: a clone stands alone.

Every markdown link target and every `code` span that names a path in the repository (it starts
with one of the repository's top-level entries, is a file name ending in .md, or, in a folder's
README, a source file name: .cc, .h, .py, .sh, .cmake) must exist, relative to the repository
root, the README's own folder or its parent (a folder's README may name its files by their bare
names, and its parent's as "../x"), or, for src/X's README, include/simpler/X (its public
headers). A path that leaves
the repository (the root README's "../x") is an error. Template paths (<...>, *, ~) and build
outputs (build/...) are not checked.

Usage: scripts/check_readme_paths.py [REPO_ROOT]. Exit 1, naming each README, line and path,
when one is missing.
"""

import os
import re
import subprocess
import sys


def readmes(root):
    out = subprocess.run(["git", "-C", root, "ls-files", "README.md", "*/README.md"],
                         capture_output=True, text=True, check=True).stdout.split()
    return [p for p in out if not p.startswith("node_modules/")]


def top_level(root):
    out = subprocess.run(["git", "-C", root, "ls-files"], capture_output=True, text=True,
                         check=True).stdout.split()
    return {p.split("/", 1)[0] for p in out}


def candidates(line):
    for m in re.finditer(r"`([^`\s]+)`|\]\(([^)\s]+)\)", line):
        yield (m.group(1) or m.group(2)).split("#", 1)[0].rstrip(",.:;")


def problems(root):
    tops = top_level(root)
    for readme in readmes(root):
        here = os.path.dirname(readme)
        # Where a path it names may be: the root, its folder, its parent, and the public headers
        # of its folder (src/X's README names include/simpler/X's headers by their bare names).
        parts = here.split("/")
        dirs = ["", here, os.path.dirname(here)] + [
            os.path.join("include", "simpler", p) for p in parts[1:2]]
        with open(os.path.join(root, readme), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                for path in candidates(line):
                    if not path or re.search(r"[<>*~]|^[a-z]+://|^/|^build/", path):
                        continue
                    if path.startswith("../"):
                        inside = os.path.normpath(os.path.join(here, path))
                        if inside.startswith(".."):
                            yield f"{readme}:{n}: '{path}' is outside the repository"
                        elif not os.path.exists(os.path.join(root, inside)):
                            yield f"{readme}:{n}: '{path}' is not in the repository"
                        continue
                    source = re.search(r"\.(cc|h|py|sh|cmake)$", path) and "(" not in path
                    if (path.split("/", 1)[0] not in tops and not path.endswith(".md")
                            and not (source and here)):
                        continue
                    if not any(os.path.exists(os.path.join(root, d, path)) for d in dirs):
                        yield f"{readme}:{n}: '{path}' is not in the repository"


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    found = list(problems(root))
    for p in found:
        print(p, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
