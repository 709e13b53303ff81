#!/usr/bin/env python3
"""Where a device run's time goes, from a `--trace FILE` of simpler.

Usage: scripts/trace_occupancy.py TRACE.json [--json] [--skip N]

The trace has one span per task block on the track of the core that ran it (tid 1 + core) and
one "run" span per run on the device (tid 0). For each run this prints how long its device span
lasted and how much of it had no block running, some cores but not all running one ("partial"),
or every core running one ("full"), every core the trace shows; the time each kernel's blocks
took, summed over cores; the SPMD skew: for each task of several blocks, how much later its
last block ended than its first, summed over the run's tasks (a core whose block ended first
waits that long for the task's partner blocks, unless another task's block is ready); and the
tasks of several blocks that ran every block on one core ("one-core tasks", with the time from
their first block's start to their last block's end: while it, another core may have idled).
Then the medians over the runs after the first `--skip` (default 1: the first run of a process
warms up).

With --json: one JSON object per run, then {"summary": ...} with the medians.
Exit status 2 when the file is not a trace with device runs.
"""

import argparse
import json
import statistics
import sys


def load(path):
    with open(path) as f:
        root = json.load(f)
    events = root.get("traceEvents") if isinstance(root, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a trace (no 'traceEvents' list)")
    runs, blocks = {}, {}
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or e.get("cat") != "device":
            continue
        args = e.get("args") or {}
        run_id = args.get("run_id")
        start, end = e["ts"] * 1000.0, (e["ts"] + e["dur"]) * 1000.0  # ns
        if e.get("name") == "run":
            runs[run_id] = (start, end)
        else:
            blocks.setdefault(run_id, []).append(
                (start, end, e.get("tid"), e.get("name"), args.get("task"), args.get("block")))
    if not runs:
        raise ValueError(f"{path}: no device 'run' spans")
    cores = sorted({b[2] for bs in blocks.values() for b in bs})
    return runs, blocks, cores


def occupancy(run, blocks, num_cores):
    """ns with 0 cores busy, some but not all, all `num_cores`, within the run's span."""
    start, end = run
    edges = []
    for b in blocks:
        s, e = max(b[0], start), min(b[1], end)
        if e > s:
            edges += [(s, 1), (e, -1)]
    edges.sort()
    idle = partial = full = 0.0
    busy, at = 0, start
    for t, d in edges + [(end, 0)]:
        span = t - at
        if busy == 0:
            idle += span
        elif busy >= num_cores:
            full += span
        else:
            partial += span
        busy += d
        at = t
    return idle, partial, full


def analyse(runs, blocks, cores):
    rows = []
    for run_id in sorted(runs, key=lambda r: runs[r][0]):
        bs = blocks.get(run_id, [])
        idle, partial, full = occupancy(runs[run_id], bs, max(1, len(cores)))
        kernels, ends, spans = {}, {}, {}
        for s, e, tid, name, task, _ in bs:
            kernels[name] = kernels.get(name, 0.0) + (e - s)
            ends.setdefault(task, []).append(e)
            spans.setdefault(task, []).append((s, e, tid))
        skew = sum(max(v) - min(v) for v in ends.values() if len(v) > 1)
        one_core = [v for v in spans.values() if len(v) > 1 and len({b[2] for b in v}) == 1]
        one_core_ns = sum(max(b[1] for b in v) - min(b[0] for b in v) for v in one_core)
        rows.append({"run_id": run_id, "run_ms": (runs[run_id][1] - runs[run_id][0]) / 1e6,
                     "idle_ms": idle / 1e6, "partial_ms": partial / 1e6, "full_ms": full / 1e6,
                     "spmd_end_skew_ms": skew / 1e6, "blocks": len(bs),
                     "multi_block_tasks": sum(1 for v in spans.values() if len(v) > 1),
                     "one_core_tasks": len(one_core), "one_core_ms": one_core_ns / 1e6,
                     "kernel_ms": {k: v / 1e6 for k, v in sorted(kernels.items())}})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--skip", type=int, default=1, help="leading runs left out of the medians")
    a = ap.parse_args()
    if a.skip < 0:
        ap.error(f"--skip must be >= 0, got {a.skip}")
    try:
        runs, blocks, cores = load(a.trace)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"trace_occupancy: {e}", file=sys.stderr)
        return 2
    rows = analyse(runs, blocks, cores)
    counted = rows[a.skip:] or rows
    keys = ("run_ms", "idle_ms", "partial_ms", "full_ms", "spmd_end_skew_ms", "one_core_tasks",
            "one_core_ms")
    summary = {"runs": len(counted), "cores": len(cores)}
    summary.update({k: statistics.median(r[k] for r in counted) for k in keys})
    names = sorted({k for r in counted for k in r["kernel_ms"]})
    summary["kernel_ms"] = {k: statistics.median(r["kernel_ms"].get(k, 0.0) for r in counted)
                            for k in names}
    if a.json:
        for r in rows:
            print(json.dumps(r))
        print(json.dumps({"summary": summary}))
        return 0
    print(f"{'run':>5} {'run ms':>9} {'idle':>8} {'partial':>8} {'full':>8} {'skew':>8}")
    for r in rows:
        print(f"{r['run_id']:>5} {r['run_ms']:9.3f} {r['idle_ms']:8.3f} {r['partial_ms']:8.3f} "
              f"{r['full_ms']:8.3f} {r['spmd_end_skew_ms']:8.3f}")
    s = summary
    print(f"median of {s['runs']} runs on {s['cores']} cores: run {s['run_ms']:.3f} ms = idle "
          f"{s['idle_ms']:.3f} + partial {s['partial_ms']:.3f} + full {s['full_ms']:.3f}; SPMD "
          f"end skew {s['spmd_end_skew_ms']:.3f} ms; one-core tasks {s['one_core_tasks']:g} "
          f"({s['one_core_ms']:.3f} ms)")
    for k, v in sorted(s["kernel_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:<20} {v:9.3f} ms of block time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
