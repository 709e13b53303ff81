#!/usr/bin/env python3
"""Where one clang compile's time went, from its -ftime-trace JSON (scripts/time_build_call.sh).

Prints clang's totals per phase ("Total Frontend", "Total Source", "Total InstantiateFunction",
"Total OptFunction", ...), then for each event kind the details that took longest, summed over
the events of that kind and detail (a header for "Source", a function for "InstantiateFunction"
or "OptFunction"; nested events count in each enclosing one).
Usage: scripts/time_trace_summary.py TRACE.json [--top N] [KIND ...]
       (default kinds: Source, ParseClass, InstantiateClass, InstantiateFunction, OptFunction)
"""
import collections
import json
import sys


def main():
    args = sys.argv[1:]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    top = 12
    if "--top" in args:
        i = args.index("--top")
        top = int(args[i + 1])
        del args[i:i + 2]
    path, kinds = args[0], args[1:] or [
        "Source", "ParseClass", "InstantiateClass", "InstantiateFunction", "OptFunction"]
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    totals = sorted(((e["dur"] / 1e6, e["name"]) for e in events
                     if e.get("name", "").startswith("Total ")), reverse=True)
    for seconds, name in totals[:top]:
        print(f"{seconds:8.2f} s  {name}")
    for kind in kinds:
        by_detail = collections.Counter()
        for e in events:
            if e.get("name") == kind and e.get("ph") == "X":
                by_detail[e.get("args", {}).get("detail", "")[:150]] += e["dur"] / 1e6
        print(f"-- {kind}: the {top} longest")
        for detail, seconds in by_detail.most_common(top):
            print(f"{seconds:8.2f} s  {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
