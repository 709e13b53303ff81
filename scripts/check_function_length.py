#!/usr/bin/env python3
"""Fails when a production function is longer than the house limit.

CONVENTIONS.md: a function fits on a screen. The limit is 80 lines for the runtime, the
engine and the server, 120 for the CLI's commands (src/cli/), counted from the first line of
the function's signature to its closing brace; a lambda counts toward the function that holds
it. Tests, fuzz targets and benchmarks are not checked.

The code is clang-formatted (the test command checks it), so a function's body opens with the
`{` that ends its signature's last line, at namespace or class scope; this reads the sources as
text (comments, string and character literals blanked first) and matches braces, in well under
a second for the whole tree. What opens a brace is told from the text before it: a
namespace / class / struct / union / enum / extern "C" head is a scope to look into, a head
with a parameter list (and no `=`) is a function, anything else (an initializer) is neither.

The functions still over their limit are listed, with their length, in
scripts/function_length_baseline.txt: a ratchet. A function over its limit fails the check
unless it is listed there at its length or longer, and a listed function that now fits (or is
gone) fails it too, until its line is deleted: the list only shrinks.

Usage: scripts/check_function_length.py [--top N] [--write-baseline] [PATH ...]
       (default: src/; --top N prints the N longest functions and passes;
       --write-baseline rewrites the list with the functions over their limit now)
Exits 1 naming every function over its limit that the list does not hold, and every stale line.
"""
import os
import re
import sys

LIMIT = 80
CLI_LIMIT = 120
BASELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "function_length_baseline.txt")
EXCLUDED = re.compile(r"(_test\.cc|_fuzz\.cc|_benchmark\.cc|_test_util\.h|test_[a-z_]*\.h)$")
SCOPE_HEAD = re.compile(
    r'^(template\s*<.*>\s*)?(\[\[.*\]\]\s*)?(inline\s+)?'
    r'(namespace\b|class\b|struct\b|union\b|enum\b|extern\s+"C")')


def blank_literals(text):
    """The text with comments, string and character literals replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == 'R' and text.startswith('R"', i) and (i == 0 or not text[i - 1].isalnum()):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if m:
                end = text.find(")" + m.group(1) + '"', i)
                j = n if end < 0 else end + len(m.group(1)) + 2
                out.append('""' + re.sub(r"[^\n]", " ", text[i + 2:j]))
                i = j
            else:
                out.append(c)
                i += 1
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # a digit separator: 1'000
                out.append(c)
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (min(j, n) - i - 1) + (c if j < n else ""))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(path):
    """Yields (first line, last line, signature) of the functions defined in `path`."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = blank_literals(f.read()).split("\n")
    stack = []  # per open brace: 'scope', 'function' (with start line) or 'other'
    head, head_line = "", None
    in_directive = False  # a preprocessor line and its backslash continuations
    for no, line in enumerate(lines, 1):
        if in_directive or line.lstrip().startswith("#"):
            in_directive = line.rstrip().endswith("\\")
            continue
        for ch in line:
            in_function = any(kind == "function" for kind, _, _ in stack)
            if ch == "{":
                if in_function:
                    stack.append(("other", 0, ""))
                    continue
                h = " ".join(head.split())
                if SCOPE_HEAD.match(h):
                    stack.append(("scope", 0, ""))
                elif "(" in h and not re.search(r"=\s*$", h) and not re.search(r"\)\s*=", h):
                    stack.append(("function", head_line or no, h))
                else:
                    stack.append(("other", 0, ""))
                head, head_line = "", None
            elif ch == "}":
                if stack:
                    kind, start, sig = stack.pop()
                    if kind == "function":
                        yield start, no, sig
                head, head_line = "", None
            elif ch == ";" and not in_function:
                head, head_line = "", None
            elif not in_function:
                if head_line is None and not ch.isspace():
                    head_line = no
                head += ch
        if not any(kind == "function" for kind, _, _ in stack):
            head += " "


def name_of(sig):
    sig = re.sub(r"__attribute__\s*\(\(.*?\)\)|\[\[.*?\]\]", "", sig)
    m = re.search(r"([~\w:]+(?:operator\s*\S+?)?)\s*\(", sig)
    return m.group(1) if m else sig[:60]


def sources(paths):
    for p in paths:
        if os.path.isfile(p):
            yield p
            continue
        for d, _, files in os.walk(p):
            if "/fuzz" in d.replace(os.sep, "/") + "/" and d.replace(os.sep, "/").endswith("fuzz"):
                continue
            for f in sorted(files):
                if f.endswith((".cc", ".h")) and not EXCLUDED.search(f):
                    yield os.path.join(d, f)


def main():
    argv = sys.argv[1:]
    top = 0
    argv = [a for a in argv if a != "--write-baseline"]
    if "--top" in argv:
        i = argv.index("--top")
        top = int(argv[i + 1])
        del argv[i:i + 2]
    rows = []
    for path in sources(argv or ["src"]):
        for first, last, sig in functions(path):
            rows.append((last - first + 1, os.path.normpath(path), first, name_of(sig)))
    rows.sort(key=lambda r: -r[0])
    if top:
        for length, path, line, name in rows[:top]:
            print(f"{length:4d}  {path}:{line}  {name}")
        return 0
    over = {}
    for length, path, line, name in rows:
        limit = CLI_LIMIT if path.replace(os.sep, "/").startswith("src/cli/") else LIMIT
        if length > limit:
            over.setdefault((path, name), (length, line, limit))
    if "--write-baseline" in sys.argv:
        with open(BASELINE, "w", encoding="utf-8") as f:
            f.write("# Functions over their length limit (scripts/check_function_length.py): path, name,\n"
                    "# lines. The list only shrinks: split a function, then delete its line.\n")
            for (path, name), (length, _, _) in sorted(over.items()):
                f.write(f"{path} {name} {length}\n")
        print(f"check_function_length: wrote {len(over)} functions to {BASELINE}", file=sys.stderr)
        return 0
    listed = {}
    if os.path.exists(BASELINE):
        with open(BASELINE, encoding="utf-8") as f:
            for raw in f:
                if raw.strip() and not raw.startswith("#"):
                    path, name, length = raw.split()
                    listed[(path, name)] = int(length)
    bad = []
    for (path, name), (length, line, limit) in sorted(over.items()):
        allowed = listed.get((path, name))
        if allowed is None:
            bad.append(f"{path}:{line}: {name} is {length} lines (limit {limit})")
        elif length > allowed:
            bad.append(f"{path}:{line}: {name} grew to {length} lines (listed at {allowed}; limit {limit})")
    for key in sorted(set(listed) - set(over)):
        bad.append(f"{key[0]}: {key[1]} fits its limit now (or is gone): delete its line from "
                   f"{os.path.relpath(BASELINE)}")
    for b in bad:
        print(b, file=sys.stderr)
    if bad:
        print(f"check_function_length: {len(bad)} problem(s)", file=sys.stderr)
        return 1
    print(f"check_function_length: {len(rows)} functions; {len(over)} still over their limit, "
          f"as listed", file=sys.stderr)
    return 0

if __name__ == "__main__":
    sys.exit(main())
