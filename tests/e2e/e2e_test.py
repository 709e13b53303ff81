#!/usr/bin/python3
"""End-to-end tests of the `simpler` CLI: Qwen3 generation against the numpy reference
(tests/reference/qwen3_ref.py), CLI error paths, and program libraries (`simpler run`).

One scenario per invocation (each is its own ctest test, label "e2e"):

  e2e_test.py --scenario NAME --simpler PATH --reference PATH --work DIR [--matmul-lib PATH]

The scenario wipes and recreates DIR, writes everything it needs there (checkpoints, prompt
files, outputs), deletes DIR when it passes and keeps it for inspection when it fails. Nothing
is shared between scenarios. A failure exits non-zero with every problem found listed.

Scenarios (`--list` prints them):

  writer_headdim_kv1    reference-written checkpoint, f32, 3 shards: head_dim 32 != hidden 64 /
                        heads 4, a single KV head, vocab 8192
  writer_untied_f32     reference-written checkpoint, bf16 body, untied F32 lm_head,
                        8 heads / 2 KV heads (groups of 4), 3 layers, vocab 12000
  writer_launch_depth2  the writer_untied_f32 shape with another seed, clones at
                        --launch-depth 1, 2 and 4, distinct prompts at depth 4 (tokens must
                        equal the reference at every depth); --host-sampling at depth 2 falls
                        back to serial launch (one step in flight) with the same tokens
  writer_host_built     head_dim != hidden/heads, one KV head, host-built task graphs
                        (--graph-placement host) at depth 1 and 2
  make_model_tiny       `simpler make-model --preset tiny` (vocab 151936, tokenizer), with a
                        text prompt in the distinct-prompts batch
  long_prompt           a 2,000-token prompt on the tiny preset: 8 tokens in < 30 s
  cli_errors            error paths a user hits (truncated/missing tensors, bad prompts files,
                        unknown architecture, out-of-vocabulary ids, launch depth / run grant
                        out of bounds) and the --json contract
  run_matmul            `simpler run` of the example matmul library; malformed SIMPLER_SIM_FAULTS;
                        --run-grant below / above --launch-depth, --launch-depth above the cap
  run_matmul_fault      `simpler run` with an injected kernel_error in run 0, task 0; --trace is
                        written on the failure and holds the failed run
  bench_pipeline        `simpler bench pipeline --json`: one object per (H, depth) row with the
                        issue's keys and sane values, pinned and unpinned; bad options refused
                        (run grant below the depth, --launch-depth with --depths)
  trace                 --trace on `run` (depth 2), `generate` (also failing) and `bench
                        pipeline`: every run's spans, launch order within the depth, a span
                        per task block on its core's track; scripts/trace_occupancy.py's sums
  bench_decode          `simpler bench decode --json` on the tiny preset at depths 1 and 2,
                        and with --capture on,off (a row each)
  bench_prefill_load    `simpler bench prefill --json` and `bench load --json` on the tiny
                        preset: keys, consistent numbers, a prompt past the positions refused;
                        `bench throughput`'s ratios say what they are ratios of; `bench serve
                        --structured` in text and JSON, a refused schema's reason named
  run_defects           `simpler run` error paths that once crashed or hung: a refused launch
                        with runs in flight (exits cleanly, reporting it), a hang at depth 1
                        and 2 (one sentence naming run, task, kernel and limit), a kernel that
                        never returns (fails at --timeout, exits within seconds)
  generate_faults       `simpler generate` under faults: a device fault at depth 4 reports the
                        failing step's own error every time; a request that can never fit the
                        KV pool is refused while the others are served; a known error is
                        reported without waiting out a hung step's timeout
  bad_input             malformed, huge, deep, non-UTF-8 and inconsistent input is an
                        error exit naming the file / flag / field, never a crash, hang or silent
                        acceptance

Each reference scenario checks, for its checkpoint:
  * 16 clone requests x 127 decode steps (--ignore-eos): every request's tokens equal the
    reference's (one reference run of the prompt);
  * a batch of distinct prompts (lengths 1, 5, 17, 40) from --prompts-file: each request gets its
    own reference tokens;
  * logits at steps 0, 1, 63, 126: relative L2 ||a - b|| / ||b|| <= 1e-4;
  * K/V read back from the page pool at positions 0, 15, 16 (the last of the first page and the
    first of the second at page size 16) and the last processed position, per layer and for K
    and V separately: relative L2 <= 1e-5 (the reference's [kv_heads][head_dim] flattened);
  * pages: each request holds ceil(processed / page_size) distinct pages inside the pool, and
    no page is held by two requests at once;
  * each clone run's --json reports its launch depth, max_steps_in_flight equal to it and
    serial_launch false;
  * `--json` stdout is exactly one JSON object.
"""

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

# One BLAS thread, as the reference (tests/reference/qwen3_ref.py) runs, in-process here too
# (Ctx.reference_generate): the tests run two at a time, and a second OpenBLAS thread spins
# while it waits. Set before numpy loads OpenBLAS; a value already in the environment wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402  (after the BLAS thread count)

MAX_NEW = 127
LOGIT_STEPS = (0, 1, 63, 126)
PAGE_SIZE = 16
CLONES = 16
CLONE_PROMPT_LEN = 7
DISTINCT_LENGTHS = (1, 5, 17, 40)
LOGITS_RTOL = 1e-4
KV_RTOL = 1e-5
CLI_TIMEOUT_S = 150


class Failure(Exception):
    pass


def log(msg):
    print(msg, flush=True)


def csv(ids):
    return ",".join(str(int(i)) for i in ids)


def tail(text, n=2000):
    text = text or ""
    return text if len(text) <= n else "..." + text[-n:]


class Problems:
    """Collects failures so one run reports all of them."""

    def __init__(self):
        self.items = []

    def add(self, msg):
        log("FAIL: " + msg)
        self.items.append(msg)

    def check(self, cond, msg):
        if not cond:
            self.add(msg)
        return bool(cond)


class Ctx:
    def __init__(self, args):
        self.simpler = os.path.abspath(args.simpler)
        self.reference_py = os.path.abspath(args.reference)
        self.work = os.path.abspath(args.work)
        self.matmul_lib = os.path.abspath(args.matmul_lib) if args.matmul_lib else None
        self.spin_lib = os.path.abspath(args.spin_lib) if args.spin_lib else None
        self.tokenizer_dir = os.path.abspath(args.tokenizer_dir) if args.tokenizer_dir else None
        self.python = sys.executable or "/usr/bin/python3"
        self.problems = Problems()
        self.env = dict(os.environ)
        self.env.pop("SIMPLER_SIM_FAULTS", None)
        self.env["PYTHONDONTWRITEBYTECODE"] = "1"

    def path(self, *parts):
        return os.path.join(self.work, *parts)

    # -- processes ---------------------------------------------------------------------------

    def run(self, argv, *, env=None, timeout=CLI_TIMEOUT_S, label=None):
        """Runs argv; returns (CompletedProcess, wall seconds). Never raises on exit status."""
        label = label or os.path.basename(argv[0])
        shown = " ".join(a if len(a) < 120 else a[:60] + "...(%d chars)" % len(a) for a in argv)
        log(f"$ {shown}")
        t0 = time.monotonic()
        try:
            p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env if env is not None else self.env, timeout=timeout,
                               errors="replace")
        except subprocess.TimeoutExpired as e:
            raise Failure(f"{label}: still running after {timeout} s: {shown}\n"
                          f"stderr: {tail(e.stderr if isinstance(e.stderr, str) else '')}")
        wall = time.monotonic() - t0
        log(f"  -> exit {p.returncode} in {wall:.2f} s")
        return p, wall

    def run_ok(self, argv, **kw):
        p, wall = self.run(argv, **kw)
        if p.returncode != 0:
            raise Failure(f"{kw.get('label') or argv[0]} exited {p.returncode}: "
                          f"{' '.join(argv)[:400]}\nstderr:\n{tail(p.stderr)}")
        return p, wall

    def generate(self, model, extra, label):
        """`simpler generate --json`; returns (parsed stdout, stderr, wall seconds)."""
        argv = [self.simpler, "generate", "--model", model, "--json"] + extra
        p, wall = self.run_ok(argv, label=label)
        out = parse_one_json_object(p.stdout, label)
        return out, p.stderr, wall

    def reference(self):
        """tests/reference/qwen3_ref.py as a module (its Qwen3 class and safetensors reader and
        writer), loaded once."""
        if "qwen3_ref" not in sys.modules:
            spec = importlib.util.spec_from_file_location("qwen3_ref", self.reference_py)
            module = importlib.util.module_from_spec(spec)
            sys.modules["qwen3_ref"] = module
            spec.loader.exec_module(module)
        return sys.modules["qwen3_ref"]

    def reference_generate(self, model, prompts, max_new, logits_steps, kv_positions,
                           label="reference"):
        """Greedy decode of `prompts` by the float64 reference on `model`, what
        `qwen3_ref.py generate --ignore-eos` computes and writes (the same Qwen3.generate_all),
        run in this process: the JSON of 151,936-wide logits is neither written nor parsed back,
        and numpy loads once. Returns ({"requests": [...]}, wall seconds)."""
        log(f"$ {label} (in-process): qwen3_ref.Qwen3({model}).generate_all({len(prompts)} "
            f"prompts, {max_new} tokens, logits at {sorted(logits_steps)}, K/V at "
            f"{sorted(kv_positions)})")
        t0 = time.monotonic()
        try:
            requests = self.reference().Qwen3(model).generate_all(
                [[int(t) for t in p] for p in prompts], max_new, [], set(logits_steps),
                sorted(kv_positions))
        except (OSError, ValueError, KeyError) as e:
            raise Failure(f"{label}: the reference failed on {model}: {e!r}")
        wall = time.monotonic() - t0
        log(f"  -> done in {wall:.2f} s")
        return {"requests": requests}, wall

    def write_model(self, out, *extra, tokenizer=True, label="write-model"):
        """A checkpoint from the reference's writer; with tokenizer=True the Qwen3 tokenizer
        files are copied in (`generate --prompts-file` needs them)."""
        argv = [self.python, self.reference_py, "write-model", "--out", out] + list(extra)
        if tokenizer:
            if not self.tokenizer_dir:
                raise Failure("--tokenizer-dir is required for this scenario")
            argv += ["--tokenizer-dir", self.tokenizer_dir]
        self.run_ok(argv, label=label)
        return out

    def make_model(self, out, *extra):
        self.run_ok([self.simpler, "make-model", "--out", out] + list(extra), label="make-model")
        return out


def parse_one_json_object(stdout, label):
    """stdout must be exactly one JSON object (whitespace around it allowed)."""
    # Not stdout.strip(): a copy of tens of MB where logits are dumped; json.loads allows the
    # whitespace around the object.
    if stdout.isspace() or not stdout:
        raise Failure(f"{label}: --json printed nothing on stdout")
    try:
        obj = json.loads(stdout)  # rejects trailing data ("Extra data")
    except json.JSONDecodeError as e:
        raise Failure(f"{label}: --json stdout is not exactly one JSON object ({e}); "
                      f"stdout begins {stdout.lstrip()[:300]!r}")
    if not isinstance(obj, dict):
        raise Failure(f"{label}: --json stdout is a {type(obj).__name__}, not an object")
    return obj


def rel_l2(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return None
    nb = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / nb) if nb > 0 else float(np.linalg.norm(a - b))


def kv_pool_pages(stderr):
    m = re.search(r"(\d+) KV pages of (\d+) tokens", stderr)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


# ---------------------------------------------------------------------------------------------
# Comparison with the reference


def first_mismatch(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class TokenDiagnosis:
    """On a token mismatch, asks the reference for its logits at that step (once per prompt and
    step) so the report shows whether the reference's choice was a near tie."""

    def __init__(self, ctx, model):
        self.ctx, self.model, self.cache = ctx, model, {}

    def explain(self, prompt, step, got_token):
        key = (tuple(prompt), step)
        if key not in self.cache:
            try:
                res, _ = self.ctx.reference_generate(self.model, [prompt], step + 1, [step], [],
                                                     label="reference (diagnosis)")
                lg = np.asarray(res["requests"][0]["logits"][str(step)])
                order = np.argsort(-lg)
                self.cache[key] = lg, order
            except Failure as e:
                self.cache[key] = None, str(e)
        lg, order = self.cache[key]
        if lg is None:
            return f"(diagnosis failed: {order})"
        t1, t2 = int(order[0]), int(order[1])
        got_logit = lg[got_token] if 0 <= got_token < len(lg) else float("nan")
        return (f"reference logits at step {step}: top1 {t1} ({lg[t1]:.6f}), top2 {t2} "
                f"({lg[t2]:.6f}), gap {lg[t1] - lg[t2]:.3e}; simpler's token {got_token} has "
                f"reference logit {got_logit:.6f} ({lg[t1] - got_logit:.3e} below the top)")


def check_same_requests(pb, label, got, want, keys, other):
    """Each of `keys` of every request in `got` equals the same request's in `want` (`other`
    names where those came from). A mismatch's message shows the start of both values, built
    only on a mismatch: str() of a request's logits (3 steps of a 151,936 vocabulary) takes
    0.2 CPU-s."""
    for i, (a, b) in enumerate(zip(got, want)):
        for key in keys:
            if a.get(key) != b.get(key):
                pb.add(f"{label} request {i}: {key} {str(a.get(key))[:200]} != {other}'s "
                       f"{str(b.get(key))[:200]}")


def both_have(pb, got, ref, section, key, what):
    """(simpler's, the reference's) entry `key` of `section`, or None, recorded as a problem
    naming `what`, when either lacks it."""
    g = (got.get(section) or {}).get(str(key))
    r = (ref.get(section) or {}).get(str(key))
    if not pb.check(g is not None and r is not None,
                    f"{what} missing (simpler {'has' if g is not None else 'lacks'} them, "
                    f"reference {'has' if r is not None else 'lacks'} them)"):
        return None
    return g, r


def compare_request(pb, label, got, ref, *, max_new, logits_steps, kv_positions, diag):
    """One simpler request against one reference request."""
    plen = len(ref["prompt_ids"])
    if not pb.check(got["prompt_ids"] == ref["prompt_ids"],
                    f"{label}: prompt_ids differ from the reference's "
                    f"({got['prompt_ids'][:8]}... vs {ref['prompt_ids'][:8]}...)"):
        return
    toks, rtoks = got["tokens"], ref["tokens"]
    pb.check(len(rtoks) == max_new, f"{label}: reference made {len(rtoks)} tokens, not {max_new}")
    pb.check(len(toks) == max_new,
             f"{label}: {len(toks)} tokens, expected {max_new} (--ignore-eos)")
    pb.check(got["finish_reason"] == "length",
             f"{label}: finish_reason {got['finish_reason']!r}, expected 'length'")
    i = first_mismatch(toks, rtoks)
    if i is not None:
        got_tok = toks[i] if i < len(toks) else None
        why = diag.explain(ref["prompt_ids"], i, got_tok) if got_tok is not None else ""
        pb.add(f"{label}: tokens differ from the reference from step {i} on "
               f"(prompt length {plen}): simpler {toks[max(0, i - 2):i + 4]} vs reference "
               f"{rtoks[max(0, i - 2):i + 4]} (steps {max(0, i - 2)}..); {why}")
    for s in logits_steps:
        pair = both_have(pb, got, ref, "logits", s, f"{label}: logits at step {s}")
        if pair is None:
            continue
        g, r = pair
        e = rel_l2(g, r)
        pb.check(e is not None and e <= LOGITS_RTOL,
                 f"{label}: logits at step {s}: relative L2 {e} > {LOGITS_RTOL} "
                 f"(len {len(g)} vs {len(r)})")
    processed = plen + len(rtoks) - 1
    for pos in kv_positions:
        pair = both_have(pb, got, ref, "kv", pos,
                         f"{label}: K/V at position {pos} (processed {processed})")
        if pair is None:
            continue
        g, r = pair
        for which in ("k", "v"):
            ga = np.asarray(g[which], dtype=np.float64)
            ra = np.asarray(r[which], dtype=np.float64)  # [layers][kv_heads][head_dim]
            ra = ra.reshape(ra.shape[0], -1)
            if not pb.check(ga.shape == ra.shape,
                            f"{label}: {which.upper()} at position {pos}: shape {ga.shape}, "
                            f"reference (flattened) {ra.shape}"):
                continue
            for layer in range(ra.shape[0]):
                e = rel_l2(ga[layer], ra[layer])
                pb.check(e <= KV_RTOL,
                         f"{label}: {which.upper()} at position {pos}, layer {layer}: relative L2 "
                         f"{e:.3e} > {KV_RTOL}")


def check_pages(pb, label, requests, page_size, pool_pages):
    """Every request holds ceil(processed / page_size) distinct pages inside the pool, and no page
    is held by two live requests at the same time: request r held page p from the step that
    allocated it (`page_steps`) through its last step (`last_step`); two requests' spans of the
    same page must not overlap (a finished request's pages are reused only by later steps)."""
    spans = {}  # page -> [(first_step, last_step, request)]
    for i, r in enumerate(requests):
        pages, steps, last = r.get("pages"), r.get("page_steps"), r.get("last_step")
        if not pb.check(isinstance(pages, list) and isinstance(steps, list)
                        and len(steps) == len(pages) and isinstance(last, int),
                        f"{label} request {i}: no 'pages' / 'page_steps' / 'last_step' "
                        f"({pages!r}, {steps!r}, {last!r})"):
            return
        processed = len(r["prompt_ids"]) + len(r["tokens"]) - 1
        expect = math.ceil(processed / page_size)
        pb.check(len(pages) == expect,
                 f"{label} request {i}: holds {len(pages)} pages at finish, expected "
                 f"ceil({processed} / {page_size}) = {expect}")
        pb.check(len(set(pages)) == len(pages),
                 f"{label} request {i}: a page appears twice in its own table: {pages}")
        if pool_pages is not None:
            bad = [p for p in pages if not 0 <= p < pool_pages]
            pb.check(not bad, f"{label} request {i}: pages {bad} outside the pool of "
                              f"{pool_pages}")
        for p, first in zip(pages, steps):
            pb.check(1 <= first <= last, f"{label} request {i}: page {p} allocated at step "
                                         f"{first}, after its last step {last}")
            spans.setdefault(p, []).append((first, last, i))
    clashes = []
    for p, held in spans.items():
        held.sort()
        for (f1, l1, i), (f2, l2, j) in zip(held, held[1:]):
            if f2 <= l1:
                clashes.append((p, i, (f1, l1), j, (f2, l2)))
    pb.check(not clashes,
             f"{label}: a page held by two live requests at once (page, request, steps, request, "
             f"steps): {clashes[:8]}{' ...' if len(clashes) > 8 else ''}")


def random_prompt(rng, n, vocab):
    # Any id in range works with --ignore-eos; stay clear of the stop ids at the top anyway.
    hi = min(vocab - 2, 151643)
    return [int(x) for x in rng.integers(0, hi, size=n)]


def check_checkpoint(ctx, model, *, seed, depths=(1,), clone_logits=True, text_prompt=None,
                     flags=()):
    """Scenarios 2-7 of the issue for one checkpoint."""
    pb = ctx.problems
    with open(os.path.join(model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    rng = np.random.default_rng(seed)
    clone_prompt = random_prompt(rng, CLONE_PROMPT_LEN, vocab)
    distinct = [random_prompt(rng, n, vocab) for n in DISTINCT_LENGTHS]
    last = lambda plen: plen + MAX_NEW - 2  # the last position run through the model
    clone_kv = [0, PAGE_SIZE - 1, PAGE_SIZE, last(len(clone_prompt))]
    common = ["--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--page-size",
              str(PAGE_SIZE)] + list(flags)
    timings = {}

    # simpler: 16 clones of one prompt, at each launch depth.
    clone_runs = {}
    for depth in depths:
        extra = ["--prompt-ids", csv(clone_prompt), "--requests", str(CLONES),
                 "--dump-kv-positions", csv(clone_kv), "--launch-depth", str(depth)] + common
        if clone_logits:
            extra += ["--dump-logits-steps", csv(LOGIT_STEPS)]
        out, err, wall = ctx.generate(model, extra, f"generate clones depth {depth}")
        timings[f"simpler clones depth {depth}"] = wall
        pb.check(len(out.get("requests", [])) == CLONES,
                 f"clones depth {depth}: {len(out.get('requests', []))} requests, "
                 f"expected {CLONES}")
        pb.check(out.get("launch_depth") == depth,
                 f"clones depth {depth}: JSON reports launch_depth {out.get('launch_depth')}")
        # Device-side token feedback: the engine keeps `depth` steps in flight (127 steps are
        # plenty to reach it) and never falls back to serial launch.
        pb.check(out.get("max_steps_in_flight") == depth and out.get("serial_launch") is False,
                 f"clones depth {depth}: max_steps_in_flight {out.get('max_steps_in_flight')!r} "
                 f"(expected {depth}), serial_launch {out.get('serial_launch')!r} (expected "
                 f"false)")
        clone_runs[depth] = (out, err)

    # The text prompt's ids (through the CLI's tokenizer), so its K/V positions are known.
    text_ids = None
    if text_prompt is not None:
        tout, _, _ = ctx.generate(model, ["--prompt", text_prompt, "--max-new-tokens", "1"],
                                  "generate text prompt (ids)")
        text_ids = tout["requests"][0]["prompt_ids"]
        log(f"text prompt {text_prompt!r} -> {len(text_ids)} ids {text_ids}")

    # simpler: distinct prompts of different lengths from a prompts file.
    pfile = ctx.path("prompts.jsonl")
    with open(pfile, "w") as f:
        for p in distinct:
            f.write(json.dumps({"prompt_ids": p}) + "\n")
        if text_prompt is not None:
            f.write("\n")  # blank lines are skipped
            f.write(json.dumps({"prompt": text_prompt}) + "\n")
    n_distinct = len(distinct) + (1 if text_prompt is not None else 0)
    # K/V positions: the union over requests (each compared where both sides have it).
    lens = [len(p) for p in distinct] + ([len(text_ids)] if text_ids is not None else [])
    kv_union = sorted({0, PAGE_SIZE - 1, PAGE_SIZE} | {last(n) for n in lens})
    extra = ["--prompts-file", pfile, "--launch-depth", str(depths[-1]),
             "--dump-logits-steps", csv(LOGIT_STEPS),
             "--dump-kv-positions", csv(kv_union)] + common
    dout, derr, wall = ctx.generate(model, extra, "generate distinct prompts")
    timings["simpler distinct prompts"] = wall
    dreqs = dout.get("requests", [])
    if not pb.check(len(dreqs) == n_distinct,
                    f"distinct prompts: {len(dreqs)} requests, expected {n_distinct}"):
        raise Failure("cannot continue: wrong number of requests")
    for i, p in enumerate(distinct):
        pb.check(dreqs[i]["prompt_ids"] == p,
                 f"distinct request {i}: prompt_ids {dreqs[i]['prompt_ids'][:8]} are not the "
                 f"file's {p[:8]}")
    if text_prompt is not None:
        tr = dreqs[-1]
        pb.check(len(text_ids) > 0, "text prompt encoded to no ids")
        pb.check(tr["prompt_ids"] == text_ids,
                 f"text prompt: ids {tr['prompt_ids']} in the prompts file, {text_ids} with "
                 f"--prompt")
        pb.check(isinstance(tr.get("text"), str) and tr["text"] != "",
                 f"text prompt: 'text' is {tr.get('text')!r}, expected the decoded string")
    distinct_prompts = [r["prompt_ids"] for r in dreqs]

    # reference: one run of the clone prompt plus each distinct prompt.
    ref_kv = sorted(set(clone_kv) | set(kv_union))
    ref, wall = ctx.reference_generate(model, [clone_prompt] + distinct_prompts, MAX_NEW,
                                       LOGIT_STEPS, ref_kv)
    timings["reference"] = wall
    rreqs = ref["requests"]
    diag = TokenDiagnosis(ctx, model)

    for depth, (out, err) in clone_runs.items():
        reqs = out["requests"]
        for i, r in enumerate(reqs):
            compare_request(pb, f"clones depth {depth} request {i}", r, rreqs[0], max_new=MAX_NEW,
                            logits_steps=LOGIT_STEPS if clone_logits else (),
                            kv_positions=clone_kv, diag=diag)
        check_pages(pb, f"clones depth {depth}", reqs, PAGE_SIZE, kv_pool_pages(err)[0])
    if len(clone_runs) > 1:
        base = [r["tokens"] for r in clone_runs[depths[0]][0]["requests"]]
        for depth in depths[1:]:
            other = [r["tokens"] for r in clone_runs[depth][0]["requests"]]
            pb.check(base == other, f"clone tokens at launch depth {depth} differ from depth "
                                    f"{depths[0]}")

    for i, r in enumerate(dreqs):
        plen = len(r["prompt_ids"])
        compare_request(pb, f"distinct request {i} (prompt length {plen})", r, rreqs[1 + i],
                        max_new=MAX_NEW, logits_steps=LOGIT_STEPS,
                        kv_positions=[0, PAGE_SIZE - 1, PAGE_SIZE, last(plen)], diag=diag)
    check_pages(pb, "distinct prompts", dreqs, PAGE_SIZE, kv_pool_pages(derr)[0])

    for k, v in timings.items():
        log(f"time: {k}: {v:.2f} s")


# ---------------------------------------------------------------------------------------------
# Scenarios


def scenario_writer_headdim_kv1(ctx):
    model = ctx.write_model(ctx.path("model"), "--seed", "11", "--dtype", "f32", "--shards", "3",
                            "--hidden", "64", "--heads", "4", "--kv-heads", "1", "--head-dim",
                            "32", "--layers", "2", "--intermediate", "128", "--vocab", "8192")
    check_checkpoint(ctx, model, seed=101)


WRITER_UNTIED = ("--dtype", "bf16", "--hidden", "128", "--heads", "8", "--kv-heads", "2",
                 "--head-dim", "16", "--layers", "3", "--intermediate", "256", "--vocab", "12000",
                 "--untied", "--lm-head-dtype", "f32")


def scenario_writer_untied_f32(ctx):
    model = ctx.write_model(ctx.path("model"), "--seed", "12", *WRITER_UNTIED)
    check_checkpoint(ctx, model, seed=102)


def scenario_writer_launch_depth2(ctx):
    pb = ctx.problems
    model = ctx.write_model(ctx.path("model"), "--seed", "13", *WRITER_UNTIED)
    check_checkpoint(ctx, model, seed=103, depths=(1, 2, 4))

    # Host sampling needs each step's logits on the host before the next step: at
    # --launch-depth 2 it falls back to serial launch (one step in flight, a warning) and gives
    # the tokens device-side sampling gives.
    prompt = random_prompt(np.random.default_rng(113), CLONE_PROMPT_LEN, 12000)
    common = ["--prompt-ids", csv(prompt), "--requests", "2", "--max-new-tokens", "12",
              "--ignore-eos", "--launch-depth", "2"]
    dev, _, _ = ctx.generate(model, common, "generate depth 2, device sampling")
    host, err, _ = ctx.generate(model, common + ["--host-sampling"],
                                "generate depth 2, --host-sampling")
    pb.check(host.get("max_steps_in_flight") == 1 and host.get("serial_launch") is True
             and host.get("host_sampling") is True and host.get("launch_depth") == 2,
             f"--host-sampling at depth 2: max_steps_in_flight "
             f"{host.get('max_steps_in_flight')!r} (expected 1), serial_launch "
             f"{host.get('serial_launch')!r} (expected true), host_sampling "
             f"{host.get('host_sampling')!r}, launch_depth {host.get('launch_depth')!r}")
    pb.check(host.get("effective_depth") == 1,
             f"--host-sampling at depth 2: effective_depth {host.get('effective_depth')!r}, "
             f"expected 1 (serial launch)")
    pb.check("falling back to serial launch" in err,
             f"--host-sampling at depth 2: no fallback warning on stderr: {tail(err, 600)!r}")
    pb.check(dev.get("max_steps_in_flight") == 2 and dev.get("serial_launch") is False,
             f"device sampling at depth 2: max_steps_in_flight "
             f"{dev.get('max_steps_in_flight')!r} (expected 2), serial_launch "
             f"{dev.get('serial_launch')!r} (expected false)")
    got = [r["tokens"] for r in host.get("requests", [])]
    want = [r["tokens"] for r in dev.get("requests", [])]
    pb.check(got == want and len(got) == 2,
             f"--host-sampling tokens {got} differ from device sampling's {want}")


def scenario_writer_host_built(ctx):
    """Host-built task graphs (--graph-placement host) give the reference's tokens too."""
    model = ctx.write_model(ctx.path("model"), "--seed", "17", "--dtype", "f32", "--hidden", "64",
                            "--heads", "4", "--kv-heads", "1", "--head-dim", "32", "--layers",
                            "2", "--intermediate", "128", "--vocab", "8192")
    check_checkpoint(ctx, model, seed=107, depths=(1, 2), flags=("--graph-placement", "host"))


def scenario_make_model_tiny(ctx):
    model = ctx.make_model(ctx.path("model"), "--preset", "tiny", "--seed", "14",
                           "--dtype", "bf16")
    # Vocab 151936: 16 clones x 4 steps of logits would be ~10M floats of JSON; the logits are
    # checked on the distinct-prompts batch instead.
    check_checkpoint(ctx, model, seed=104, clone_logits=False,
                     text_prompt="The quick brown fox jumps over the lazy dog.")


def scenario_long_prompt(ctx):
    pb = ctx.problems
    model = ctx.make_model(ctx.path("model"), "--preset", "tiny", "--seed", "15",
                           "--dtype", "bf16")
    prompt = random_prompt(np.random.default_rng(105), 2000, 151936)
    out, err, wall = ctx.generate(model, ["--prompt-ids", csv(prompt), "--max-new-tokens", "8",
                                          "--ignore-eos"], "generate long prompt")
    log(f"2000-token prompt + 8 tokens: {wall:.2f} s wall (timing {out.get('timing')})")
    pb.check(wall < 30, f"2000-token prompt + 8 new tokens took {wall:.1f} s, limit 30 s")
    r = out["requests"][0]
    pb.check(r["prompt_ids"] == prompt, "long prompt: prompt_ids differ from the input")
    pb.check(len(r["tokens"]) == 8, f"long prompt: {len(r['tokens'])} tokens, expected 8")
    pb.check(all(0 <= t < 151936 for t in r["tokens"]), f"long prompt: tokens {r['tokens']}")
    pb.check(r["finish_reason"] == "length", f"long prompt: finish_reason {r['finish_reason']}")
    check_pages(pb, "long prompt", [r], PAGE_SIZE, kv_pool_pages(err)[0])
    # Chunked prefill: ceil(2000 / 512) prompt steps (the default budget), then 7 decode steps.
    steps = (out.get("timing") or {}).get("steps")
    pb.check(steps == 4 + 7, f"long prompt: {steps} steps, expected 11 (ceil(2000 / 512) = 4 "
                             f"chunked-prefill steps + 7 decode steps)")


def start_server(ctx, model, *extra, env=None):
    """`simpler serve --port 0` in the background; returns (process, base URL). The caller stops
    it (SIGTERM) and reads its exit status; server_stderr(process) is what it logged (read by a
    thread as it comes: the access log would fill a pipe nobody reads)."""
    import threading
    argv = [ctx.simpler, "serve", "--model", model, "--port", "0"] + list(extra)
    log(f"$ {' '.join(argv)} &")
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env or ctx.env)
    p.stderr_lines = []
    p.stderr_thread = threading.Thread(target=lambda: p.stderr_lines.extend(p.stderr),
                                       daemon=True)
    p.stderr_thread.start()
    deadline = time.monotonic() + 60
    line = ""
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        m = re.search(r"ready on (http://127\.0\.0\.1:(\d+))/v1", line)
        if m:
            return p, m.group(1), int(m.group(2))
        if p.poll() is not None:
            break
    p.kill()
    raise Failure(f"serve did not print its ready line: {line!r} {server_stderr(p)[-2000:]}")


def server_stderr(p):
    """What a start_server process wrote on stderr (all of it once the process has exited)."""
    if p.poll() is not None:
        p.stderr_thread.join(timeout=10)
    return "".join(p.stderr_lines)


def stop_server(p):
    """SIGTERM to a start_server process; its exit status, or None when it had to be killed
    after 30 s."""
    p.send_signal(15)
    try:
        return p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        return None


def http(port, method, path, body=None, headers=None, timeout=120):
    """One request on its own connection: (status, body text, headers)."""
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, (bytes, type(None))) else body.encode()
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    c.request(method, path, body=data, headers=h)
    r = c.getresponse()
    text = r.read().decode("utf-8", "replace")
    c.close()
    return r.status, text, dict(r.getheaders())


def sse_stream(port, body, headers=None, leave_after=None, timeout=120):
    """A streamed request read event by event: (status, [data payloads], ended with [DONE]). With
    leave_after=k the client closes the connection after k events."""
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    c.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers=h)
    r = c.getresponse()
    events, buf, done = [], b"", False
    while not done:
        chunk = r.read1(65536) if hasattr(r, "read1") else r.read(1)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            ev = ev.decode("utf-8", "replace")
            if not ev.startswith("data: "):
                raise Failure(f"an SSE event without 'data: ': {ev[:200]!r}")
            payload = ev[6:]
            if payload == "[DONE]":
                done = True
                break
            events.append(payload)
            if leave_after is not None and len(events) >= leave_after:
                c.sock.close()
                return r.status, events, False
    c.close()
    return r.status, events, done


def scenario_serve(ctx):
    """The OpenAI server through a real HTTP client and curl: 32 distinct prompts sent concurrently equal
    their float64 reference tokens; a seeded sampled completion is the same alone and under
    load; 64 concurrent streams with a third of the clients leaving mid-stream (the rest end with
    [DONE], nothing stays running, every page comes back); a corpus of bad requests (curl) each
    gets its status and an error object while a good stream runs; SIGTERM exits 0."""
    import concurrent.futures as cf
    pb = ctx.problems
    model = ctx.write_model(ctx.path("model"), "--vocab", "4096", "--seed", "29")
    key = "e2e-key"
    auth = {"Authorization": f"Bearer {key}"}
    # --api-key wins over SIMPLER_API_KEY.
    proc, url, port = start_server(ctx, model, "--api-key", key, "--served-model-name", "m",
                                   "--max-num-seqs", "8", "--max-body-bytes", "65536",
                                   "--drain-timeout", "5",
                                   env=dict(ctx.env, SIMPLER_API_KEY="not-the-key"))
    try:
        st, body, hdrs = http(port, "GET", "/v1/models/m",
                              headers=dict(auth, **{"X-Request-Id": "e2e-request-1"}))
        pb.check(st == 200 and json.loads(body).get("id") == "m" and
                 hdrs.get("X-Request-Id") == "e2e-request-1",
                 f"/v1/models/m: HTTP {st} {body[:200]}, X-Request-Id {hdrs.get('X-Request-Id')}")
        st, _, _ = http(port, "GET", "/v1/models", headers={"Authorization": "Bearer not-the-key"})
        pb.check(st == 401, f"SIMPLER_API_KEY beside --api-key: HTTP {st} (401: the flag wins)")
        rng = np.random.default_rng(31)
        prompts = [random_prompt(rng, int(n), 4096) for n in [1, 300] + list(rng.integers(1, 301, size=30))]
        ref, _ = ctx.reference_generate(model, prompts, 8, [], [])

        def complete(pr, **kw):
            body = {"model": "m", "prompt": pr, "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True}
            body.update(kw)
            return http(port, "POST", "/v1/completions", json.dumps(body), auth)

        with cf.ThreadPoolExecutor(32) as ex:
            got = list(ex.map(complete, prompts))
        for i, ((status, text, _), want) in enumerate(zip(got, ref["requests"])):
            if not pb.check(status == 200, f"prompt {i}: HTTP {status}: {text[:300]}"):
                continue
            st, detok, _ = http(port, "POST", "/detokenize",
                                json.dumps({"tokens": want["tokens"]}), auth)
            pb.check(st == 200 and json.loads(text)["choices"][0]["text"] == json.loads(detok)["prompt"],
                     f"prompt {i} (length {len(prompts[i])}): the text differs from the "
                     f"reference tokens' text")
        # A seeded sampled completion: the same alone and among 31 concurrent others.
        seeded = dict(temperature=0.9, top_k=40, seed=1234)
        alone = complete(prompts[5], **seeded)
        with cf.ThreadPoolExecutor(32) as ex:
            futures = [ex.submit(complete, prompts[5], **seeded)] + \
                      [ex.submit(complete, p) for p in prompts[:31]]
            loaded = futures[0].result()
            [f.result() for f in futures[1:]]
        pb.check(alone[0] == 200 and loaded[0] == 200 and
                 json.loads(alone[1])["choices"][0]["text"] == json.loads(loaded[1])["choices"][0]["text"],
                 f"seeded completion differs under load: {alone[1][:200]} vs {loaded[1][:200]}")

        # 64 concurrent streams of random lengths; every third client leaves after 3 events.
        def streamer(i):
            r = np.random.default_rng(1000 + i)
            body = {"model": "m", "prompt": random_prompt(r, int(r.integers(1, 64)), 4096),
                    "max_tokens": int(r.integers(4, 48)) if i % 3 else 400, "ignore_eos": True,
                    "stream": True}
            return sse_stream(port, body, auth, leave_after=3 if i % 3 == 0 else None)
        with cf.ThreadPoolExecutor(64) as ex:
            streams = list(ex.map(streamer, range(64)))
        for i, (status, events, done) in enumerate(streams):
            if i % 3 == 0:
                continue
            pb.check(status == 200 and done, f"stream {i}: HTTP {status}, ended with [DONE]: {done}")
            finals = [e for e in events if json.loads(e)["choices"][0].get("finish_reason")]
            pb.check(len(finals) == 1, f"stream {i}: {len(finals)} final chunks")
        metrics = ""
        for _ in range(100):
            _, metrics, _ = http(port, "GET", "/metrics")
            if 'simpler:num_requests_running{model_name="m"} 0' in metrics:
                break
            time.sleep(0.1)
        pb.check('simpler:num_requests_running{model_name="m"} 0' in metrics,
                 "requests still running after every client finished or left")
        free = re.search(r'simpler:kv_cache_pages\{model_name="m",state="free"\} (\d+)', metrics)
        used = re.search(r'simpler:kv_cache_pages\{model_name="m",state="used"\} (\d+)', metrics)
        pb.check(free and used and int(used.group(1)) == 0,
                 f"pages still used after the streams: {used.group(0) if used else metrics[:300]}")

        # Bad requests through curl, with a good stream running meanwhile.
        good = cf.ThreadPoolExecutor(1).submit(
            sse_stream, port, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 64,
                               "ignore_eos": True, "stream": True}, auth)
        corpus = [
            ("truncated JSON", b'{"prompt": "x", "max_tokens": ', 400, True),
            ("wrong type", b'{"prompt": "x", "max_tokens": "seven"}', 400, True),
            ("huge number", b'{"prompt": "x", "max_tokens": 1e400}', 400, True),
            ("deep nesting", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, True),
            ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', 400, True),
            ("unknown field", b'{"prompt": "x", "frobnicate": true}', 400, True),
            ("oversize body", b'{"prompt": "' + b"a" * 70000 + b'"}', 413, True),
            ("missing auth", b'{"prompt": "x"}', 401, False),
            ("negative n", b'{"prompt": "x", "n": -1}', 400, True),
            ("not an object", b'[1, 2]', 400, True),
        ]
        for label, body, want, with_auth in corpus:
            bodyfile = ctx.path("body.bin")
            with open(bodyfile, "wb") as f:
                f.write(body)
            argv = ["curl", "-s", "-o", ctx.path("resp.json"), "-w", "%{http_code}",
                    "-H", "Content-Type: application/json", "--data-binary", f"@{bodyfile}",
                    f"{url}/v1/completions"]
            if with_auth:
                argv[1:1] = ["-H", f"Authorization: Bearer {key}"]
            p, _ = ctx.run(argv, label=f"curl {label}")
            code = int(p.stdout or 0)
            with open(ctx.path("resp.json"), "rb") as f:
                resp = f.read().decode("utf-8", "replace")
            err = json.loads(resp).get("error") if resp.startswith("{") else None
            pb.check(code == want and isinstance(err, dict) and err.get("message"),
                     f"{label}: HTTP {code} (expected {want}), body {resp[:200]!r}")
        status, events, done = good.result()
        pb.check(status == 200 and done and len(events) >= 2,
                 f"the good stream beside the bad requests: HTTP {status}, done {done}")
    finally:
        rc = stop_server(proc)
        pb.check(rc == 0, f"serve after SIGTERM: exit {rc}; stderr {server_stderr(proc)[-500:]}")
    check_access_log(pb, server_stderr(proc))
    check_env_api_key(ctx, model)


def check_access_log(pb, stderr):
    """scenario_serve's access log: a line per request, tokens where known, its request id."""
    lines = [l for l in stderr.splitlines() if "request_id=" in l]
    done = [l for l in lines if re.search(r"\] POST /v1/completions 200 prompt_tokens=\d+ "
                                          r"completion_tokens=8 ms=\d+\.\d request_id=\S+$", l)]
    pb.check(len(done) >= 64, f"access log: {len(done)} lines of 8-token completions (64 or more "
                              f"expected) among {len(lines)}: {lines[:3]}")
    pb.check(any(re.search(r"\] POST /v1/completions 413 .* request_id=req-[0-9a-f]{20}$", l)
                 for l in lines), f"access log: no 413 line: {lines[-12:]}")
    pb.check(any("request_id=e2e-request-1" in l for l in lines),
             "access log: the client's X-Request-Id is not in it")


def check_env_api_key(ctx, model):
    """The API key from SIMPLER_API_KEY (no --api-key) and --no-access-log."""
    pb = ctx.problems
    env = dict(ctx.env, SIMPLER_API_KEY="env-key")
    proc, _, port = start_server(ctx, model, "--no-access-log", env=env)
    try:
        without, _, _ = http(port, "GET", "/v1/models")
        with_key, _, _ = http(port, "GET", "/v1/models", headers={"Authorization": "Bearer env-key"})
        pb.check(without == 401 and with_key == 200,
                 f"SIMPLER_API_KEY: HTTP {without} without the key (401 expected), {with_key} "
                 f"with it (200 expected)")
    finally:
        stop_server(proc)
    pb.check("request_id=" not in server_stderr(proc),
             f"--no-access-log: access lines logged: {server_stderr(proc)[-300:]}")


def scenario_continuous_batching(ctx):
    """Continuous batching against the float64 reference: 32 distinct prompts of 1-300 tokens through the
    continuous-batching engine at token budgets 1, 7 and 64 and launch depths 1 and 2, and with a KV
    pool small enough to force preemption by recompute: every request's tokens equal the
    reference's, no page is held by two live requests at once; a hang in a step fails the
    requests with the timeout, in bounded time."""
    pb = ctx.problems
    model = ctx.write_model(ctx.path("model"), "--vocab", "4096", "--seed", "23",
                            tokenizer=False)
    rng = np.random.default_rng(123)
    lengths = [1, 300] + [int(x) for x in rng.integers(1, 301, size=30)]
    prompts = [random_prompt(rng, n, 4096) for n in lengths]
    max_new = 8
    path = ctx.path("prompts.jsonl")
    with open(path, "w") as f:
        for pr in prompts:
            f.write(json.dumps({"prompt_ids": pr}) + "\n")
    ref, _ = ctx.reference_generate(model, prompts, max_new, [], [])
    diag = TokenDiagnosis(ctx, model)
    common = ["--prompts-file", path, "--max-new-tokens", str(max_new), "--ignore-eos",
              "--page-size", str(PAGE_SIZE)]
    runs = [("budget 1, depth 1", ["--max-num-batched-tokens", "1", "--max-num-seqs", "1",
                                   "--launch-depth", "1"], False),
            ("budget 7, depth 2", ["--max-num-batched-tokens", "7", "--max-num-seqs", "7",
                                   "--launch-depth", "2"], False),
            ("budget 64, depth 1", ["--max-num-batched-tokens", "64", "--max-num-seqs", "16",
                                    "--launch-depth", "1"], False),
            # The longest request needs ceil((300 + 8 - 1) / 16) = 20 pages; 48 hold two or three.
            ("small pool, depth 2", ["--max-num-batched-tokens", "64", "--max-num-seqs", "16",
                                     "--launch-depth", "2", "--num-pages", "48"], True)]
    for label, extra, preempts in runs:
        out, err, wall = ctx.generate(model, common + extra, f"generate {label}")
        log(f"{label}: {wall:.1f} s, {out.get('timing', {}).get('steps')} steps, "
            f"{out.get('preemptions')} preemptions")
        reqs = out.get("requests", [])
        if not compare_tokens(pb, label, reqs, ref, len(prompts), max_new, diag):
            continue
        check_pages(pb, label, reqs, PAGE_SIZE, kv_pool_pages(err)[0])
        if preempts:
            pb.check((out.get("preemptions") or 0) > 0,
                     f"{label}: {out.get('preemptions')} preemptions, expected some")
    check_prefix_caching(ctx, model, rng, diag, max_new)
    # A hang in step 3 with a 1 s operation timeout: every request fails with the timeout (the
    # engine is unhealthy), the call prints every result and exits 1 within seconds.
    env = dict(ctx.env, SIMPLER_SIM_FAULTS="run=2:task=1:kind=hang")
    t0 = time.monotonic()
    expect_request_failure(ctx, [ctx.simpler, "generate", "--model", model, "--json", *common,
                                 "--max-num-batched-tokens", "64", "--launch-depth", "2",
                                 "--timeout", "1"],
                           "hang in step 3", ["run 2"], env=env)
    wall = time.monotonic() - t0
    pb.check(wall < 30, f"hang in step 3: the call took {wall:.1f} s")


def compare_tokens(pb, label, reqs, ref, count, max_new, diag):
    """`count` requests of a `generate --json` run, each against the reference's; False when the
    count is wrong (nothing compared)."""
    if not pb.check(len(reqs) == count, f"{label}: {len(reqs)} requests"):
        return False
    for i, (got, want) in enumerate(zip(reqs, ref["requests"])):
        compare_request(pb, f"{label} request {i}", got, want, max_new=max_new,
                        logits_steps=(), kv_positions=(), diag=diag)
    return True


def check_prefix_caching(ctx, model, rng, diag, max_new):
    """Prefix caching against the float64 reference: six prompts that share a 100-token prefix
    (one of them twice: clones), at depth 2 with a budget that chunks the prefill, with the cache
    on (the default) and off: every request's tokens equal the reference's both times, the cache
    served prompt tokens when on (whole pages of the shared prefix) and none when off."""
    pb = ctx.problems
    prefix = random_prompt(rng, 100, 4096)
    prompts = [prefix + random_prompt(rng, n, 4096) for n in (1, 17, 33, 40, 5)]
    prompts.append(list(prompts[2]))
    path = ctx.path("prefix_prompts.jsonl")
    with open(path, "w") as f:
        for pr in prompts:
            f.write(json.dumps({"prompt_ids": pr}) + "\n")
    ref, _ = ctx.reference_generate(model, prompts, max_new, [], [],
                                    label="reference (shared prefixes)")
    common = ["--prompts-file", path, "--max-new-tokens", str(max_new), "--ignore-eos",
              "--page-size", str(PAGE_SIZE), "--max-num-batched-tokens", "48",
              "--max-num-seqs", "4", "--launch-depth", "2"]
    for label, extra in (("prefix caching on", []),
                         ("prefix caching off", ["--no-enable-prefix-caching"])):
        out, _, _ = ctx.generate(model, common + extra, f"generate {label}")
        reqs = out.get("requests", [])
        if not compare_tokens(pb, label, reqs, ref, len(prompts), max_new, diag):
            continue
        cached = out.get("timing", {}).get("cached_prompt_tokens")
        per_request = [r.get("cached_tokens") for r in reqs]
        if extra:
            pb.check(cached == 0 and out.get("prefix_caching") is False,
                     f"{label}: {cached} cached prompt tokens, prefix_caching "
                     f"{out.get('prefix_caching')!r}")
        else:
            whole = all(isinstance(c, int) and c % PAGE_SIZE == 0 for c in per_request)
            pb.check(isinstance(cached, int) and cached >= 4 * 96 and whole,
                     f"{label}: cached prompt tokens {cached} (per request {per_request}); "
                     f"expected whole pages, at least 96 of the shared prefix for 4 requests")


def without_log_records(text):
    """`text` less its log records ("[08:25:23.448] [error] engine: ...": an unhealthy engine
    logs its failure as it happens, before the command reports it)."""
    return "\n".join(ln for ln in text.splitlines()
                     if not re.match(r"\[\d\d:\d\d:\d\d\.\d+\] \[", ln))


def check_printed_once(pb, label, p, message):
    """The error `message` is printed once: it occurs exactly once in stdout and stderr, leaving
    out the log records."""
    n = without_log_records(p.stdout + "\n" + p.stderr).count(message)
    pb.check(n == 1, f"{label}: the error is printed {n} times, expected once: {message!r}; "
                     f"stdout {tail(p.stdout, 300)!r}, stderr {tail(p.stderr, 600)!r}")


def expect_error(ctx, argv, label, must_contain, *, env=None):
    """argv must exit non-zero (not by a signal), print nothing on stdout, and name every string
    of must_contain (case-sensitive) in the last line of stderr (the error; earlier lines are
    progress and warnings, which may mention paths too), printed once."""
    pb = ctx.problems
    p, _ = ctx.run(argv, env=env, label=label)
    log(f"  stderr: {tail(p.stderr, 600).strip()}")
    if p.returncode == 0:
        pb.add(f"{label}: exited 0, expected a failure")
        return p
    pb.check(0 < p.returncode < 128,
             f"{label}: exit status {p.returncode} (a crash or signal, not an error exit); "
             f"stderr: {tail(p.stderr, 800)}")
    pb.check(p.stdout.strip() == "", f"{label}: printed on stdout on failure: "
                                     f"{tail(p.stdout, 300)!r}")
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    for s in must_contain:
        pb.check(s in last, f"{label}: the error (last stderr line) does not name {s!r}: "
                            f"{last!r}")
    if last:
        check_printed_once(pb, label, p, last.split(": ", 1)[-1])
    return p


def expect_request_failure(ctx, argv, label, must_contain, *, env=None):
    """`simpler generate` whose requests fail: it exits 1 (not by a signal) after printing every
    request's result — with --json one JSON object whose failed items carry finish_reason "error"
    and an "error" naming every string of must_contain, else the results of the others only —
    and the last line of stderr is a failed request's error, naming them too. Each failed
    request's error is printed once on stderr ("simpler generate: request N failed: ERROR"),
    and nowhere else but in its --json item."""
    pb = ctx.problems
    p, _ = ctx.run(argv, env=env, label=label)
    log(f"  stderr: {tail(p.stderr, 600).strip()}")
    if not pb.check(p.returncode == 1, f"{label}: exit status {p.returncode}, expected 1; "
                                       f"stderr: {tail(p.stderr, 800)}"):
        return p
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    for s in must_contain:
        pb.check(s in last, f"{label}: the error (last stderr line) does not name {s!r}: "
                            f"{last!r}")
    if "--json" in argv:
        try:
            out = parse_one_json_object(p.stdout, label)
            failed = [r for r in out.get("requests", []) if r.get("finish_reason") == "error"]
            pb.check(failed and all(all(s in r.get("error", "") for s in must_contain)
                                    for r in failed),
                     f"{label}: the failed requests' items do not name {must_contain}: {failed}")
        except (Failure, ValueError) as e:
            pb.add(f"{label}: {e}")
    # The message without a status code's name ("INTERNAL: ") before it.
    failures = [m.group(1) for m in re.finditer(
        r"^simpler generate: request \d+ failed: (?:[A-Z_]+: )?(.*)$", p.stderr, re.M)]
    pb.check(failures, f"{label}: stderr names no failed request: {tail(p.stderr, 400)!r}")
    if "--json" in argv:
        for message in set(failures):
            n = without_log_records(p.stderr).count(message)
            pb.check(n == failures.count(message),
                     f"{label}: the error is printed {n} times on stderr, expected "
                     f"{failures.count(message)}: {message!r}")
    else:
        for message in set(failures):
            if failures.count(message) == 1:
                check_printed_once(pb, label, p, message)
    return p


def expect_refused_by_parser(ctx, argv, label, must_contain):
    """argv must be refused while parsing its flags: an error exit, nothing on stdout, no
    command output on stderr ("simpler <command>: ..."), and stderr names every string of
    must_contain (CLI11 prints the reason, once, then a --help hint as its last line)."""
    pb = ctx.problems
    p, _ = ctx.run(argv, label=label)
    log(f"  stderr: {tail(p.stderr, 600).strip()}")
    pb.check(0 < p.returncode < 128, f"{label}: exit {p.returncode}, expected an error exit "
                                     f"from the flag parser; stderr: {tail(p.stderr, 400)!r}")
    pb.check(p.stdout.strip() == "", f"{label}: printed on stdout: {tail(p.stdout, 300)!r}")
    pb.check("simpler " not in p.stderr,
             f"{label}: the command ran instead of being refused by the parser: "
             f"{tail(p.stderr, 400)!r}")
    for s in must_contain:
        pb.check(s in p.stderr, f"{label}: stderr does not name {s!r}: {tail(p.stderr, 400)!r}")
    reason = next((ln for ln in p.stderr.splitlines() if ln.strip()), "")
    if reason:
        check_printed_once(pb, label, p, reason)
    return p


# ---------------------------------------------------------------------------------------------
# Traces (--trace FILE): Chrome trace JSON, one complete event ("ph": "X") per span


HOST_SPANS = ("submit", "prepare", "launch", "reap", "finalize", "retire")


def span_ns(ev):
    """(start, end) of a span in integer ns since the trace's origin (ts and dur are µs)."""
    start = round(ev["ts"] * 1000)
    return start, start + round(ev["dur"] * 1000)


def read_trace(ctx, path, label, stderr=None):
    """Loads a --trace file and checks its format; returns {run_id: {span name: [event, ...]}}
    of its complete events, or None when the file is missing or not trace JSON. With `stderr`,
    the CLI's "wrote trace with N spans" line must count the file's events."""
    pb = ctx.problems
    if not pb.check(os.path.isfile(path), f"{label}: --trace wrote no file {path}"):
        return None
    try:
        with open(path) as f:
            root = json.load(f)
    except json.JSONDecodeError as e:
        pb.add(f"{label}: trace {path} is not JSON ({e})")
        return None
    if not pb.check(isinstance(root, dict) and isinstance(root.get("traceEvents"), list),
                    f"{label}: trace {path} is not an object with a 'traceEvents' list"):
        return None
    spans = [e for e in root["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    if not pb.check(spans, f"{label}: trace {path} holds no complete ('X') events"):
        return None
    if stderr is not None:
        m = re.search(r"wrote trace with (\d+) spans to (.+)", stderr)
        if pb.check(m, f"{label}: stderr does not report the trace: {tail(stderr, 400)!r}"):
            pb.check(int(m.group(1)) == len(spans) and m.group(2).strip() == path,
                     f"{label}: stderr reports {m.group(1)} spans to {m.group(2).strip()}, the "
                     f"file {path} holds {len(spans)}")
    runs, bad = {}, []
    for e in spans:
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        run_id, cat = args.get("run_id"), e.get("cat")
        ok = (isinstance(e.get("name"), str) and cat in ("host", "device")
              and e.get("pid") == (0 if cat == "host" else 1)
              and all(isinstance(e.get(k), (int, float)) for k in ("ts", "dur"))
              and e.get("ts", -1) >= 0 and e.get("dur", -1) >= 0
              and isinstance(run_id, int) and run_id >= 0)
        if ok and cat == "host":
            ok = e["name"] in HOST_SPANS
        if ok and cat == "device" and e["name"] != "run":
            ok = isinstance(args.get("task"), int) and args["task"] >= 0  # a task span
        if not ok:
            bad.append(e)
            continue
        runs.setdefault(run_id, {}).setdefault(e["name"], []).append(e)
    pb.check(not bad, f"{label}: {len(bad)} malformed spans (a host span named other than "
                      f"{HOST_SPANS}, no args.run_id, a device task span without args.task, "
                      f"wrong pid, negative ts/dur), e.g. {bad[:3]}")
    return runs


def check_trace_run(pb, label, run_id, spans, *, failed_task=None):
    """One run's spans: each host span once, one device "run" span, its task spans inside it,
    and the run's life in order on one clock: submit <= prepare <= launch <= device run <=
    reap end <= finalize <= retire. With `failed_task`, that task's span must be there."""
    where = f"{label}: run {run_id}"
    missing = [n for n in HOST_SPANS + ("run",) if len(spans.get(n, [])) != 1]
    if not pb.check(not missing, f"{where}: spans {missing} missing or repeated "
                                 f"(has {sorted((n, len(v)) for n, v in spans.items())})"):
        return
    ns = {n: span_ns(spans[n][0]) for n in HOST_SPANS + ("run",)}
    tasks = [e for n, evs in spans.items() if n not in HOST_SPANS + ("run",) for e in evs]
    pb.check(tasks, f"{where}: no device task spans")
    outside = [(e["name"], e["args"]["task"]) for e in tasks
               if not (ns["run"][0] <= span_ns(e)[0] and span_ns(e)[1] <= ns["run"][1])]
    pb.check(not outside, f"{where}: task spans {outside[:5]} lie outside the device run span "
                          f"{ns['run']}")
    # One span per block: a task of several blocks has each of its blocks once (args.block), and
    # a core's track (tid) shows one block at a time.
    blocks, cores = {}, {}
    for e in tasks:
        blocks.setdefault(e["args"]["task"], []).append(e["args"].get("block"))
        cores.setdefault(e.get("tid"), []).append(span_ns(e))
    bad_blocks = [(t, b) for t, b in blocks.items()
                  if len(b) > 1 and (None in b or sorted(b) != list(range(len(b))))]
    pb.check(not bad_blocks, f"{where}: tasks whose block spans are not blocks 0..n-1 once each "
                             f"(task, blocks): {bad_blocks[:5]}")
    overlaps = [(tid, a, b) for tid, spans_ in cores.items()
                for a, b in zip(sorted(spans_), sorted(spans_)[1:])
                if b[0] < a[1] - 1]  # ns rounded from µs: 1 ns of slack
    pb.check(not overlaps, f"{where}: a core's track shows two blocks at once (tid, span, next "
                           f"span): {overlaps[:5]}")
    if failed_task is not None:
        pb.check(any(e["args"]["task"] == failed_task for e in tasks),
                 f"{where}: no span of the failed task {failed_task} "
                 f"(tasks {sorted(e['args']['task'] for e in tasks)})")
    order = [("submit start", ns["submit"][0]), ("prepare start", ns["prepare"][0]),
             ("prepare end", ns["prepare"][1]), ("launch start", ns["launch"][0]),
             ("device run start", ns["run"][0]), ("device run end", ns["run"][1]),
             ("reap end", ns["reap"][1]), ("finalize start", ns["finalize"][0]),
             ("finalize end", ns["finalize"][1]), ("retire start", ns["retire"][0])]
    for (a, ta), (b, tb) in zip(order, order[1:]):
        pb.check(ta <= tb, f"{where}: {a} at {ta} ns is after {b} at {tb} ns")


TRACE_OCCUPANCY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                               "trace_occupancy.py")


def check_trace_occupancy(ctx, path, label, expect_runs):
    """scripts/trace_occupancy.py on a trace: a row per device run whose idle, partial and full
    times add up to its span, whose one-core tasks are some of its tasks of several blocks, and a
    summary of the medians."""
    pb = ctx.problems
    p = subprocess.run([sys.executable, TRACE_OCCUPANCY, path, "--json", "--skip", "0"],
                       capture_output=True, text=True, timeout=120)
    if not pb.check(p.returncode == 0, f"{label}: trace_occupancy.py exited {p.returncode}: "
                                       f"{tail(p.stderr, 400)!r}"):
        return
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.strip()]
    rows, summary = lines[:-1], lines[-1].get("summary") if lines else None
    pb.check(len(rows) == expect_runs and summary and summary.get("runs") == expect_runs,
             f"{label}: trace_occupancy.py gave {len(rows)} runs and summary {summary}, "
             f"expected {expect_runs}")
    for r in rows:
        parts = (r["idle_ms"], r["partial_ms"], r["full_ms"])
        pb.check(min(parts) >= 0 and abs(sum(parts) - r["run_ms"]) <= 1e-6 * max(1, r["run_ms"])
                 and r["blocks"] > 0 and sum(r["kernel_ms"].values()) > 0,
                 f"{label}: run {r['run_id']}: idle + partial + full {parts} is not its span "
                 f"{r['run_ms']} ms, or it has no blocks: {r}")
        # Tasks of several blocks that ran them all on one core: some of those tasks, and the time
        # from their first block's start to their last one's end within the run.
        pb.check(0 <= r["one_core_tasks"] <= r["multi_block_tasks"] <= r["blocks"]
                 and 0 <= r["one_core_ms"] <= r["run_ms"]
                 and (r["one_core_tasks"] > 0) == (r["one_core_ms"] > 0),
                 f"{label}: run {r['run_id']}: one-core tasks {r['one_core_tasks']} "
                 f"({r['one_core_ms']} ms) of {r['multi_block_tasks']} tasks of several blocks: "
                 f"{r}")


def check_trace_runs(pb, label, runs, expect_ids):
    """Every run of a completed command: exactly the run ids `expect_ids`, each complete."""
    if runs is None:
        return
    pb.check(sorted(runs) == sorted(expect_ids),
             f"{label}: trace holds runs {sorted(runs)}, expected {sorted(expect_ids)}")
    for run_id in sorted(runs):
        check_trace_run(pb, label, run_id, runs[run_id])


def check_launch_order(pb, label, runs, depth, *, expect_early):
    """At launch depth `depth`, run k launches only after run k - depth ended on the device
    (at most `depth` runs on the device). With expect_early, some run k also launches before
    run k - 1 ended on the device: it was enqueued early, not after its predecessor."""
    if runs is None:
        return
    ids = sorted(r for r in runs if len(runs[r].get("launch", [])) == 1
                 and len(runs[r].get("run", [])) == 1)
    launch = {r: span_ns(runs[r]["launch"][0])[0] for r in ids}
    end = {r: span_ns(runs[r]["run"][0])[1] for r in ids}
    too_early = [(k, launch[k], k - depth, end[k - depth]) for k in ids if k - depth in end
                 and launch[k] < end[k - depth]]
    pb.check(not too_early,
             f"{label}: at launch depth {depth}, runs launched before run k - {depth} ended on "
             f"the device (run, launch ns, earlier run, its device end ns): {too_early[:5]}")
    if expect_early:
        early = [k for k in ids if k - 1 in end and launch[k] < end[k - 1]]
        pb.check(early, f"{label}: at launch depth {depth} no run launched before its "
                        f"predecessor ended on the device (launch ns vs previous end ns: "
                        f"{[(k, launch[k], end[k - 1]) for k in ids if k - 1 in end][:8]})")


def scenario_cli_errors(ctx):
    pb = ctx.problems
    shape = ["--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--layers",
             "2", "--intermediate", "64", "--vocab", "512", "--dtype", "f32", "--seed", "16"]
    single = ctx.write_model(ctx.path("single"), *shape, tokenizer=False)
    sharded = ctx.write_model(ctx.path("sharded"), *shape, "--shards", "3")
    gen = lambda model, *extra: [ctx.simpler, "generate", "--model", model, "--json",
                                 "--max-new-tokens", "4", *extra]

    # The good models work, and --json stdout is exactly one object.
    for model in (single, sharded):
        out, _, _ = ctx.generate(model, ["--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                                         "--requests", "2", "--ignore-eos"],
                                 f"generate {os.path.basename(model)}")
        pb.check(len(out["requests"]) == 2 and all(len(r["tokens"]) == 4
                                                   for r in out["requests"]),
                 f"{model}: expected 2 requests of 4 tokens: {out['requests']}")
        if model == single:
            pb.check(all(r["text"] is None for r in out["requests"]),
                     "no tokenizer: 'text' must be null")
        else:
            pb.check(all(isinstance(r["text"], str) for r in out["requests"]),
                     "with a tokenizer: 'text' must be a string")
        pb.check("timing" in out, "--json output lacks 'timing'")

    # Truncated safetensors files: in the tensor data (one byte short, half) and in the header.
    st_size = os.path.getsize(os.path.join(single, "model.safetensors"))
    for name, size in (("trunc_1", st_size - 1), ("trunc_half", st_size // 2),
                       ("trunc_header", 20)):
        d = ctx.path(name)
        shutil.copytree(single, d)
        path = os.path.join(d, "model.safetensors")
        os.truncate(path, size)
        expect_error(ctx, gen(d, "--prompt-ids", "1,2"), f"{name} ({size} of {st_size} bytes)",
                     [path])

    # A bad --prompts-file line names file:line (blank lines count).
    for name, text, bad_line, label in (
            ("bad_prompts.jsonl", '{"prompt_ids": [1, 2, 3]}\n\n{"prompt_ids": [1, 2\n', 3,
             "malformed prompts-file line"),
            ("bad_prompts2.jsonl", '{"prompt_ids": [1, 2]}\n{"prompt_ids": [1, "x"]}\n', 2,
             "prompts-file non-integer id"),
            ("bad_prompts3.jsonl", '{"ids": [1, 2]}\n', 1, "prompts-file line without a prompt")):
        pf = ctx.path(name)
        with open(pf, "w") as f:
            f.write(text)
        expect_error(ctx, gen(sharded, "--prompts-file", pf), label, [f"{pf}:{bad_line}"])

    # A prompts file of token ids needs no tokenizer (as --prompt-ids does not).
    pf5 = ctx.path("ids_only.jsonl")
    with open(pf5, "w") as f:
        f.write('{"prompt_ids": [1, 2, 3]}\n{"prompt_ids": [4]}\n')
    p, _ = ctx.run(gen(single, "--prompts-file", pf5, "--ignore-eos"),
                   label="prompts-file of ids, no tokenizer")
    if pb.check(p.returncode == 0,
                f"--prompts-file holding only prompt_ids fails on a model without a tokenizer "
                f"(exit {p.returncode}): {tail(p.stderr, 400).strip()!r}"):
        out = parse_one_json_object(p.stdout, "prompts-file of ids, no tokenizer")
        pb.check([r["prompt_ids"] for r in out["requests"]] == [[1, 2, 3], [4]]
                 and all(len(r["tokens"]) == 4 for r in out["requests"]),
                 f"prompts-file of ids, no tokenizer: {out['requests']}")

    # A tensor missing from a sharded index names the tensor.
    d = ctx.path("missing_in_index")
    shutil.copytree(sharded, d)
    idx_path = os.path.join(d, "model.safetensors.index.json")
    with open(idx_path) as f:
        idx = json.load(f)
    gone = "model.layers.1.mlp.up_proj.weight"
    del idx["weight_map"][gone]
    with open(idx_path, "w") as f:
        json.dump(idx, f)
    expect_error(ctx, gen(d, "--prompt-ids", "1,2"), "tensor missing from the index", [gone])

    # A single-file checkpoint written without one tensor names the tensor.
    qwen3_ref = ctx.reference()  # the reference's own safetensors reader and writer
    d = ctx.path("missing_in_file")
    shutil.copytree(single, d)
    st_path = os.path.join(d, "model.safetensors")
    tensors, meta = qwen3_ref.read_safetensors(st_path)
    gone = "model.norm.weight"
    kept = [(n, dt, np.array(raw)) for n, (dt, shape, raw) in tensors.items() if n != gone]
    del tensors
    qwen3_ref.write_safetensors(st_path, kept, meta)
    expect_error(ctx, gen(d, "--prompt-ids", "1,2"), "tensor missing from the file", [gone])

    # An unknown architecture in config.json.
    d = ctx.path("llama")
    shutil.copytree(single, d)
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    p = expect_error(ctx, gen(d, "--prompt-ids", "1,2"), "unknown architecture",
                     ["LlamaForCausalLM", "config.json"])
    pb.check("architecture" in p.stderr.lower(),
             f"unknown architecture: stderr does not say 'architecture': {p.stderr!r}")

    # A missing model directory or .gguf file: the flag parser names it whole, before anything
    # loads (not as the first file a loader looks for inside it, "DIR/config.json: no such file").
    for nowhere, want in ((ctx.path("no_such_model"), "no such model directory"),
                          (ctx.path("no_such.gguf"), "no such .gguf file")):
        expect_refused_by_parser(ctx, gen(nowhere, "--prompt-ids", "1,2"), f"missing model: {want}",
                                 ["--model", nowhere, want])

    # Token ids outside the vocabulary.
    expect_error(ctx, gen(single, "--prompt-ids", "1,512"), "--prompt-ids id == vocab",
                 ["512", "vocab"])
    expect_error(ctx, gen(single, "--prompt-ids", "3,100000,4"), "--prompt-ids id > vocab",
                 ["100000", "vocab"])
    expect_error(ctx, gen(single, "--prompt-ids=-1,2"), "--prompt-ids negative id",
                 ["-1", "vocab"])
    expect_error(ctx, gen(single, "--prompt-ids", "1,x2"), "--prompt-ids not an integer",
                 ["x2"])
    pf4 = ctx.path("oov_prompts.jsonl")
    with open(pf4, "w") as f:
        f.write('{"prompt_ids": [1, 2]}\n{"prompt_ids": [3, 600]}\n')
    expect_request_failure(ctx, gen(sharded, "--prompts-file", pf4),
                           "prompts-file id outside the vocab", [f"{pf4}:2", "600", "vocab"])
    # Its error printed once in text output too (on stderr; the results on stdout).
    p = expect_request_failure(ctx, [a for a in gen(sharded, "--prompts-file", pf4)
                                     if a != "--json"],
                               "prompts-file id outside the vocab, text",
                               [f"{pf4}:2", "600", "vocab"])
    pb.check(p.stdout.count("--- request") == 2 and "--- request 1 (error)" in p.stdout,
             f"prompts-file id outside the vocab, text: stdout {tail(p.stdout, 300)!r}")

    # Launch depth and run grant out of bounds name the field and its value.
    expect_refused_by_parser(ctx, gen(single, "--prompt-ids", "1,2", "--launch-depth", "2",
                                      "--run-grant", "1"), "generate --launch-depth 2 --run-grant 1",
                             ["--run-grant: 1 is below --launch-depth 2"])
    expect_refused_by_parser(ctx, gen(single, "--prompt-ids", "1,2", "--launch-depth", "2000"),
                             "generate --launch-depth 2000", ["--launch-depth", "2000", "1024"])


def ipv6_loopback_available():
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def scenario_cli_input(ctx):
    """What the flag parser and the prompts file refuse, and what the CLI tells a new user:
    sampling flags and seeds out of range are refused before the model loads, empty ids and
    unknown prompts-file keys are errors naming where, a refused prompts-file line fails only
    its request, --version and the defaults in --help, and the IPv6 URL `serve` prints."""
    pb = ctx.problems
    model = ctx.make_model(ctx.path("tiny"), "--preset", "tiny", "--seed", "5",
                           "--tokenizer-dir", ctx.tokenizer_dir)
    gen = lambda *extra: [ctx.simpler, "generate", "--model", model, "--max-new-tokens", "4",
                          *extra]

    # --version, and the defaults in generate --help.
    p, _ = ctx.run([ctx.simpler, "--version"], label="--version")
    pb.check(p.returncode == 0 and re.fullmatch(r"simpler \d+\.\d+\.\d+", p.stdout.strip()),
             f"--version: exit {p.returncode}, stdout {p.stdout!r}, stderr {tail(p.stderr, 300)!r}")
    p, _ = ctx.run([ctx.simpler, "generate", "--help"], label="generate --help")
    for flag, default in (("--max-new-tokens", "32"), ("--temperature", "0"), ("--top-p", "1"),
                          ("--chips", "1"), ("--child-mode", "process"),
                          ("--graph-placement", "device")):
        pb.check(re.search(rf"{flag}\b[^\n]*={default}\b", p.stdout),
                 f"generate --help does not show {flag}'s default {default}: {p.stdout!r}")

    # Defaults in other commands' --help (every flag with a default shows it).
    for argv, flag, default in ((["make-model"], "--preset", "tiny"),
                                (["make-model"], "--shards", "1"),
                                (["l3-example"], "--intermediate", "256"),
                                (["bench", "pipeline"], "--runs", "200"),
                                (["bench", "mailbox"], "--runs", "2000"),
                                (["bench", "mailbox"], "--launch-depth", "2"),
                                (["bench", "mailbox"], "--cores", "1")):
        p, _ = ctx.run([ctx.simpler] + argv + ["--help"], label=" ".join(argv) + " --help")
        pb.check(re.search(rf"{flag}\b[^\n]*={default}\b", p.stdout),
                 f"{' '.join(argv)} --help does not show {flag}'s default {default}")
    # An empty stop string and a trace file in a missing folder, refused by the parser (the
    # first failed each request after the model loaded, the second after the whole run).
    expect_refused_by_parser(ctx, gen("--prompt", "Hi", "--stop", ""), "--stop ''",
                             ["--stop", "an empty stop string"])
    expect_refused_by_parser(ctx, gen("--prompt", "Hi", "--trace", ctx.path("no", "t.json")),
                             "--trace NODIR/t.json", ["--trace", "there is no directory"])
    expect_error(ctx, gen("--prompt", "Hi", "--chips", "2", "--trace", ctx.path("t.json")),
                 "--chips 2 --trace", ["--trace records this process's device",
                                       "run it with --chips 1"])
    expect_error(ctx, gen("--prompt", "Hi", "--dump-logits-steps", "0,4", "--json"),
                 "--dump-logits-steps 4 of 4", ["--dump-logits-steps: step 4 is never run",
                                                "--max-new-tokens 4 runs steps 0 to 3"])
    expect_refused_by_parser(ctx, [ctx.simpler, "bench", "mailbox", "--run-grant", "1"],
                             "bench mailbox --run-grant 1",  # against its own depth default, 2
                             ["--run-grant: 1 is below --launch-depth 2"])
    expect_refused_by_parser(ctx, gen("--prompt", "Hi", "--launch-depth", "3", "--run-grant",
                                      "2"), "--run-grant 2 --launch-depth 3",
                             ["--run-grant: 2 is below --launch-depth 3"])

    # Benchmark flags refused before any workload runs: --url's form and reachability (a server
    # that does not answer used to fail every request after the whole workload), a request rate
    # whose arrivals would span days, and a --ttft-probe-len the model cannot hold (refused only
    # after both throughput runs before).
    serve = [ctx.simpler, "bench", "serve", "--model", model, "--num-prompts", "2"]
    expect_refused_by_parser(ctx, serve + ["--url", "https://127.0.0.1:8000"], "--url https",
                             ["--url", "only http:// is supported"])
    expect_refused_by_parser(ctx, serve + ["--url", "http://127.0.0.1:99999"], "--url port",
                             ["--url", "the port must be a number in [1, 65535]"])
    expect_refused_by_parser(ctx, serve + ["--url", "http://127.0.0.1:8000/v1"], "--url path",
                             ["--url", "has a path"])
    expect_refused_by_parser(ctx, serve + ["--url", "http://::1:8000"], "--url IPv6 bare",
                             ["--url", "an IPv6 address goes in brackets"])
    expect_refused_by_parser(ctx, serve + ["--request-rate", "1e-9"], "--request-rate 1e-9",
                             ["--request-rate", "at least 0.001"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]  # nothing listens there once closed
    t0 = time.monotonic()
    p = expect_error(ctx, serve + ["--url", f"http://127.0.0.1:{closed_port}"], "--url closed",
                     ["--url", "no answer to GET /v1/models"])
    pb.check(time.monotonic() - t0 < 30 and "requests finished" not in p.stderr,
             f"--url closed: not refused before the workload: {tail(p.stderr, 400)!r}")
    p = expect_error(ctx, [ctx.simpler, "bench", "throughput", "--model", model, "--num-prompts",
                           "2", "--ttft-probe-len", "5000"], "--ttft-probe-len 5000",
                     ["--ttft-probe-len", "exceeds max_position_embeddings 4096"])
    pb.check("continuous run" not in p.stderr,
             f"--ttft-probe-len 5000: refused only after the runs: {tail(p.stderr, 400)!r}")

    # -n above the default 256 sequences: the choices of a prompt run at once, so the default
    # grows to them (they used to fail one by one after the model loaded); a --max-num-seqs
    # given below them is refused naming both flags.
    many, _, _ = ctx.generate(model, ["--prompt", "Hi", "-n", "300", "--max-new-tokens", "1"],
                              "generate -n 300")
    pb.check(len(many.get("requests", [])) == 300 and
             all(r.get("finish_reason") in ("length", "stop") for r in many["requests"]),
             f"generate -n 300: {str(many)[:400]}")
    expect_error(ctx, gen("--prompt", "Hi", "-n", "3", "--max-num-seqs", "1"),
                 "-n 3 --max-num-seqs 1", ["--max-num-seqs 1 is below the 3 choices",
                                           "-n/--requests"])

    # Sampling flags out of range, refused by the parser (before the model loads).
    for argv, label, names in (
            (["--top-p", "2"], "--top-p 2", ["--top-p", "2", "maximum of 1"]),
            (["--top-p", "0"], "--top-p 0", ["--top-p", "not above the minimum of 0"]),
            (["--min-p", "1.5"], "--min-p 1.5", ["--min-p", "1.5", "maximum of 1"]),
            (["--temperature", "101"], "--temperature 101", ["--temperature", "101"]),
            (["--seed=-1"], "--seed -1", ["--seed", "'-1' is not an integer"]),
            (["--seed", "18446744073709551616"], "--seed 2^64",
             ["--seed", "18446744073709551616", "18446744073709551615"])):
        expect_refused_by_parser(ctx, gen("--prompt", "Hi", *argv), label, names)
    expect_refused_by_parser(ctx, [ctx.simpler, "make-model", "--preset", "tiny", "--out",
                                   ctx.path("never"), "--seed=-1"], "make-model --seed -1",
                             ["--seed", "'-1'"])
    # The largest seed runs.
    out, _, _ = ctx.generate(model, ["--prompt", "Hi", "--max-new-tokens", "2", "--ignore-eos",
                                     "--temperature", "1", "--seed", "18446744073709551615"],
                             "--seed 2^64-1")
    pb.check(len(out["requests"][0]["tokens"]) == 2, f"--seed 2^64-1: {out['requests']}")

    # Empty ids in --prompt-ids.
    for ids in ("9707,,11", "9707,11,", ",9707"):
        expect_error(ctx, gen("--prompt-ids", ids), f"--prompt-ids {ids}",
                     ["--prompt-ids", "is empty"])

    # Prompts-file lines with unknown keys, or both prompts: refused naming file:line and the key.
    pf = ctx.path("keys.jsonl")
    with open(pf, "w") as f:
        f.write('{"prompt": "A"}\n{"prompt":"A","max_tokens":5,"temperature":9}\n')
    expect_error(ctx, gen("--prompts-file", pf), "prompts-file unknown key",
                 [f"{pf}:2", '"max_tokens"'])
    with open(pf, "w") as f:
        f.write('{"prompt": "A", "prompt_ids": [9707]}\n')
    expect_error(ctx, gen("--prompts-file", pf), "prompts-file prompt and prompt_ids",
                 [f"{pf}:1", "not both"])

    # A line the model refuses fails its request only; the others run.
    pf = ctx.path("one_bad.jsonl")
    with open(pf, "w") as f:
        f.write('{"prompt": "Hello"}\n\n{"prompt": ""}\n{"prompt_ids": [9707, 11]}\n')
    p = expect_request_failure(ctx, gen("--prompts-file", pf, "--ignore-eos", "--json"),
                               "prompts-file with an empty prompt", [f"{pf}:3", "empty prompt"])
    try:
        reqs = parse_one_json_object(p.stdout, "prompts-file with an empty prompt")["requests"]
        pb.check([r["finish_reason"] for r in reqs] == ["length", "error", "length"]
                 and len(reqs[0]["tokens"]) == 4 and len(reqs[2]["tokens"]) == 4
                 and reqs[1]["chip"] is None,
                 f"prompts-file with an empty prompt: {reqs}")
    except Failure as e:
        pb.add(str(e))
    p = expect_request_failure(ctx, gen("--prompts-file", pf, "--ignore-eos"),
                               "prompts-file with an empty prompt, text", [f"{pf}:3"])
    pb.check(p.stdout.count("--- request") == 3, f"text output: {p.stdout!r}")

    # serve on an IPv6 address prints its URL with the address in brackets.
    if not ipv6_loopback_available():
        log("no IPv6 loopback here: the serve --host ::1 check is skipped")
        return
    argv = [ctx.simpler, "serve", "--model", model, "--port", "0", "--host", "::1"]
    log(f"$ {' '.join(argv)} &")
    srv = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=ctx.env)
    try:
        line = srv.stdout.readline()
        pb.check(re.search(r"ready on http://\[::1\]:\d+/v1 ", line),
                 f"serve --host ::1 printed {line!r}")
    finally:
        srv.send_signal(signal.SIGTERM)
        try:
            srv.wait(timeout=60)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()


def matmul_argv(ctx, *extra):
    if not ctx.matmul_lib:
        raise Failure("--matmul-lib is required for this scenario")
    return [ctx.simpler, "run", ctx.matmul_lib, *extra]


def scenario_run_matmul(ctx):
    pb = ctx.problems
    p, _ = ctx.run_ok(matmul_argv(ctx), label="simpler run")
    log(p.stdout.strip())
    m = re.search(r"max error ([0-9.eE+-]+|nan|inf)", p.stdout)
    if pb.check(m, f"simpler run: no 'max error' on stdout: {p.stdout!r}"):
        pb.check(float(m.group(1)) < 1e-3, f"simpler run: max error {m.group(1)} >= 1e-3")
    p, _ = ctx.run_ok(matmul_argv(ctx, "--json"), label="simpler run --json")
    out = parse_one_json_object(p.stdout, "simpler run --json")
    pb.check(out.get("passed") is True and out.get("max_abs_error", 1) < 1e-3
             and len(out.get("checks", [])) >= 1, f"simpler run --json: {out}")

    # Malformed fault plans are refused with the reason.
    for plan, reason in (("run=zero:task=0:kind=kernel_error", "zero"),
                         ("run=0:task=0:kind=explode", "explode"),
                         ("run=0:task=0:kind=kernel_error,", "empty fault")):
        env = dict(ctx.env, SIMPLER_SIM_FAULTS=plan)
        expect_error(ctx, matmul_argv(ctx), f"SIMPLER_SIM_FAULTS={plan}",
                     ["SIMPLER_SIM_FAULTS", reason], env=env)

    # The run grant: below the launch depth is refused naming both; above it the runs pass
    # and still at most launch-depth runs are on the device at once.
    expect_refused_by_parser(ctx, matmul_argv(ctx, "--launch-depth", "2", "--run-grant", "1"),
                             "run --launch-depth 2 --run-grant 1",
                             ["--run-grant: 1 is below --launch-depth 2"])
    expect_refused_by_parser(ctx, matmul_argv(ctx, "--launch-depth", "2000"),
                             "run --launch-depth 2000", ["--launch-depth", "2000", "1024"])
    trace = ctx.path("grant4.trace.json")
    p, _ = ctx.run_ok(matmul_argv(ctx, "--launch-depth", "2", "--run-grant", "4", "--repeats", "4",
                                  "--json", "--trace", trace),
                      label="run --launch-depth 2 --run-grant 4")
    out = parse_one_json_object(p.stdout, "run --launch-depth 2 --run-grant 4")
    pb.check(out.get("passed") is True and len(out.get("checks", [])) == 8,
             f"run --launch-depth 2 --run-grant 4: expected 8 passed checks: {out}")
    runs = read_trace(ctx, trace, "run --run-grant 4", p.stderr)
    check_trace_runs(pb, "run --run-grant 4", runs, [c.get("run_id") for c in out["checks"]])
    check_launch_order(pb, "run --run-grant 4", runs, 2, expect_early=False)


def scenario_run_matmul_fault(ctx):
    pb = ctx.problems
    env = dict(ctx.env, SIMPLER_SIM_FAULTS="run=0:task=0:kind=kernel_error")
    trace = ctx.path("fault.trace.json")
    p = expect_error(ctx, matmul_argv(ctx, "--trace", trace),
                     "SIMPLER_SIM_FAULTS=run=0:task=0:kind=kernel_error", ["run 0", "task 0"],
                     env=env)
    # The trace is written on failure too, and shows the failed run and its failed task.
    runs = read_trace(ctx, trace, "failed run's trace", p.stderr)
    if runs is not None and pb.check(0 in runs, f"failed run's trace: no spans of run 0 "
                                                f"(runs {sorted(runs)})"):
        check_trace_run(pb, "failed run's trace", 0, runs[0], failed_task=0)
    pb.check(re.search(r"kernel '[^']+'", p.stderr),
             f"kernel_error: stderr does not name the kernel: {tail(p.stderr, 600)!r}")
    pb.check("kernel_error" in p.stderr or "kernel reported failure" in p.stderr,
             f"kernel_error: stderr does not say what failed: {tail(p.stderr, 600)!r}")


def last_stderr_line(p):
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def scenario_run_defects(ctx):
    pb = ctx.problems
    # A refused launch while earlier runs are in flight: the refused run's error, a clean exit
    # (once: "free(): corrupted unsorted chunks", finalize writing freed host buffers).
    for extra in (["--launch-depth", "2"], ["--launch-depth", "1", "--repeats", "4"]):
        env = dict(ctx.env, SIMPLER_SIM_FAULTS="run=1:task=0:kind=launch_refused")
        expect_error(ctx, matmul_argv(ctx, *extra), "launch_refused " + " ".join(extra),
                     ["run 1 launch: stream refused the launch of run 1"], env=env)
    # A hang at depth 1 and 2: one sentence naming the run, the task still executing, its
    # kernel and the limit — never "lane poisoned" without the task, never repeated.
    for depth in ("1", "2"):
        env = dict(ctx.env, SIMPLER_SIM_FAULTS="run=3:task=0:kind=hang")
        p = expect_error(ctx, matmul_argv(ctx, "--launch-depth", depth, "--repeats", "4",
                                          "--timeout", "1"),
                         f"hang at depth {depth}",
                         ["run 3 did not finish within the operation timeout of 1 s; still "
                          "executing: task 0 (kernel 'matmul_rows'", "; device aborted"],
                         env=env)
        last = last_stderr_line(p)
        pb.check(last.count("operation timeout") == 1,
                 f"hang at depth {depth}: the message repeats itself: {last!r}")
    # A kernel that never returns: fails at its timeout naming run, task and kernel; the
    # process exits within a few seconds although the thread running the kernel cannot be
    # joined (it is abandoned).
    if not ctx.spin_lib:
        raise Failure("--spin-lib is required for this scenario")
    p = expect_error(ctx, [ctx.simpler, "run", ctx.spin_lib, "--timeout", "2"],
                     "never-returning kernel",
                     ["run 0 did not finish within the operation timeout of 2 s",
                      "task 0 (kernel 'spin_forever'"])
    p2, wall = ctx.run([ctx.simpler, "run", ctx.spin_lib, "--timeout", "2"],
                       label="never-returning kernel (timed)", timeout=60)
    pb.check(p2.returncode == 1, f"never-returning kernel: exit {p2.returncode}")
    pb.check(wall < 10, f"never-returning kernel: the process took {wall:.1f} s to exit after "
                        f"a 2 s timeout (limit 10 s)")


def scenario_generate_faults(ctx):
    pb = ctx.problems
    model = ctx.write_model(ctx.path("model"), "--vocab", "4096", "--seed", "21",
                            tokenizer=False)
    base = [ctx.simpler, "generate", "--model", model, "--max-new-tokens", "16",
            "--ignore-eos"]
    # A device fault in step 3 at depth 4: the failing step's own error (INTERNAL, naming run 3
    # and its task), never "lane poisoned by run 3" from a later submit — every time.
    env = dict(ctx.env, SIMPLER_SIM_FAULTS="run=3:task=5:kind=device_fault")
    for i in range(8):
        p = expect_request_failure(ctx, base + ["--prompt-ids", "1,2,3", "--launch-depth", "4"],
                                   f"device_fault at depth 4, try {i}",
                                   ["run 3 task 5", "device fault, error code 507018"], env=env)
        pb.check("lane poisoned" not in last_stderr_line(p),
                 f"device_fault try {i}: a later submit's refusal was reported instead of the "
                 f"step's own error: {last_stderr_line(p)!r}")
        # The engine's log line says it turned unhealthy and why, without the status's payloads
        # (the runtime's bookkeeping, e.g. [simpler/unrecoverable='1']).
        pb.check("the engine is unhealthy: INTERNAL: run 3 task 5" in p.stderr
                 and "[simpler/" not in p.stderr,
                 f"device_fault try {i}: the engine's log line: {tail(p.stderr, 600)!r}")
    # A request that can never fit the KV pool is refused before any work, naming its need and
    # the pool's size; the other request is served; the call exits non-zero after printing both.
    prompts = ctx.path("prompts.jsonl")
    with open(prompts, "w") as f:
        f.write(json.dumps({"prompt_ids": [7] * 1280}) + "\n")
        f.write(json.dumps({"prompt_ids": [1, 2, 3, 4, 5]}) + "\n")
    p, wall = ctx.run([ctx.simpler, "generate", "--model", model, "--prompts-file", prompts,
                       "--num-pages", "64", "--page-size", "16", "--max-new-tokens", "5",
                       "--ignore-eos", "--json"], label="never-fitting request")
    pb.check(p.returncode == 1, f"never-fitting request: exit {p.returncode}, expected 1")
    try:
        out = parse_one_json_object(p.stdout, "never-fitting request")
        r0, r1 = out["requests"]
        pb.check(r0.get("finish_reason") == "error" and
                 "needs 81 pages of 16 tokens, and the pool holds 64 pages" in r0.get("error", ""),
                 f"never-fitting request: request 0 is {r0}")
        pb.check(r1.get("finish_reason") == "length" and len(r1.get("tokens", [])) == 5
                 and "error" not in r1, f"never-fitting request: request 1 is {r1}")
        pb.check(wall < 60, f"never-fitting request: {wall:.1f} s (the refused one ran?)")
    except (Failure, ValueError, KeyError) as e:
        pb.add(f"never-fitting request: {e}")
    # A known error does not wait out a hung step's timeout (60 s by default): reported as soon
    # as it is known, naming its run.
    env = dict(ctx.env, SIMPLER_SIM_FAULTS="run=2:task=3:kind=kernel_error,run=3:task=1:kind=hang")
    t0 = time.monotonic()
    expect_request_failure(ctx, base + ["--prompt-ids", "1,2,3", "--launch-depth", "4"],
                           "kernel_error behind a hang",
                           ["run 2 task 3", "kernel reported failure"], env=env)
    wall = time.monotonic() - t0
    pb.check(wall < 20, f"kernel_error behind a hang: reported after {wall:.1f} s (the hung "
                        f"step's 60 s timeout must not be waited out)")


def scenario_bench_pipeline(ctx):
    """The --json contract of `simpler bench pipeline` (numbers are not asserted: speed is
    recorded in docs/benchmarks.md, not tested)."""
    pb = ctx.problems
    keys = {"depth", "host_us", "device_us", "runs_per_s", "device_busy", "gap_us_p50",
            "gap_us_p99"}
    for pin in ("auto", "off"):
        p, _ = ctx.run_ok([ctx.simpler, "bench", "pipeline", "--json", "--runs", "12",
                           "--device-us", "200", "--depths", "1,2", "--host-ratios", "0.25,1",
                           "--pin", pin], label=f"bench pipeline --pin {pin}")
        rows = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
        pb.check(len(rows) == 4, f"--pin {pin}: expected 4 rows (2 depths x 2 H), got {len(rows)}")
        seen = set()
        for r in rows:
            missing = keys - r.keys()
            pb.check(not missing, f"--pin {pin}: row {r} lacks {sorted(missing)}")
            if missing:
                continue
            seen.add((r["depth"], r["host_us"]))
            pb.check(r["device_us"] == 200, f"--pin {pin}: device_us {r['device_us']} != 200")
            pb.check(r["runs_per_s"] > 0, f"--pin {pin}: runs_per_s {r['runs_per_s']}")
            pb.check(0 < r["device_busy"] <= 1.0, f"--pin {pin}: device_busy {r['device_busy']}")
            pb.check(0 <= r["gap_us_p50"] <= r["gap_us_p99"],
                     f"--pin {pin}: gap p50 {r['gap_us_p50']} > p99 {r['gap_us_p99']}")
            for k in ("gaps_over_20us", "late_launches"):
                pb.check(isinstance(r.get(k), int) and 0 <= r[k] <= 11,
                         f"--pin {pin}: {k} {r.get(k)!r} not a count of the 11 gaps")
            if r["depth"] == 1:
                # At depth 1 every run launches after its predecessor completed.
                pb.check(r.get("late_launches") == 11,
                         f"--pin {pin}: depth 1 late_launches {r.get('late_launches')!r} != 11")
        pb.check(seen == {(1, 50.0), (2, 50.0), (1, 200.0), (2, 200.0)},
                 f"--pin {pin}: rows cover {sorted(seen)}")
    for bad, what in ((["--pin", "sometimes"], "--pin"), (["--host-ratios", "-1"], "--host-ratios"),
                      (["--runs", "1"], "--runs"), (["--depths", "0"], "depth")):
        p, _ = ctx.run([ctx.simpler, "bench", "pipeline", "--runs", "4", *bad],
                       label=f"bench pipeline {' '.join(bad)}")
        pb.check(0 < p.returncode < 128, f"bench pipeline {bad}: exit {p.returncode}, expected "
                                         f"an error exit")
        pb.check(what in p.stderr, f"bench pipeline {bad}: stderr does not name {what!r}: "
                                   f"{tail(p.stderr, 400)!r}")
    bench = [ctx.simpler, "bench", "pipeline", "--runs", "5", "--host-ratios", "0.25"]
    expect_refused_by_parser(ctx, bench + ["--launch-depth", "2", "--run-grant", "1"],
                             "bench pipeline --launch-depth 2 --run-grant 1",
                             ["--run-grant: 1 is below --launch-depth 2"])
    expect_refused_by_parser(ctx, bench + ["--launch-depth", "2000"],
                             "bench pipeline --launch-depth 2000",
                             ["--launch-depth", "2000", "1024"])
    expect_refused_by_parser(ctx, bench + ["--launch-depth", "2", "--depths", "1"],
                             "bench pipeline --launch-depth 2 --depths 1",
                             ["--launch-depth", "--depths", "excludes"])
    # --launch-depth D is --depths D: one row, at depth D.
    p, _ = ctx.run_ok(bench + ["--launch-depth", "2", "--run-grant", "4", "--json",
                               "--device-us", "200"],
                      label="bench pipeline --launch-depth 2 --run-grant 4")
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    pb.check([r.get("depth") for r in rows] == [2],
             f"bench pipeline --launch-depth 2: expected one row at depth 2, got {rows}")


def scenario_trace(ctx):
    """--trace FILE on `run`, `generate` and `bench pipeline`: Chrome trace JSON with every
    run's host and device spans, in the order the launch depth allows; written on failure too."""
    pb = ctx.problems

    # run at depth 2: 16 runs, early enqueue, at most 2 on the device.
    trace = ctx.path("run.trace.json")
    p, _ = ctx.run_ok(matmul_argv(ctx, "--launch-depth", "2", "--repeats", "8", "--json",
                                  "--trace", trace), label="run --launch-depth 2 --trace")
    out = parse_one_json_object(p.stdout, "run --launch-depth 2 --trace")
    pb.check(out.get("passed") is True and len(out.get("checks", [])) == 16,
             f"run --launch-depth 2: expected 16 passed checks: {out}")
    runs = read_trace(ctx, trace, "run trace", p.stderr)
    check_trace_runs(pb, "run trace", runs, [c.get("run_id") for c in out.get("checks", [])])
    check_launch_order(pb, "run trace", runs, 2, expect_early=True)
    check_trace_occupancy(ctx, trace, "run trace", len(out.get("checks", [])))
    if runs and (os.cpu_count() or 1) >= 2:  # the example's tasks take a block per core
        spmd = [(r, e.get("tid")) for r, spans in runs.items()
                for e in spans.get("matmul_rows", []) if "block" in e.get("args", {})]
        pb.check(len({tid for _, tid in spmd}) >= 2,
                 f"run trace: the example's matmul blocks are not each on their own core's track "
                 f"(run, tid of its block spans): {spmd[:6]}")

    # generate at depth 2: one run per decode step.
    model = ctx.write_model(ctx.path("model"), "--hidden", "32", "--heads", "2", "--kv-heads", "1",
                            "--head-dim", "16", "--layers", "2", "--intermediate", "64",
                            "--vocab", "512", "--dtype", "f32", "--seed", "19", tokenizer=False)
    gen = ["--prompt-ids", "1,2,3", "--requests", "2", "--max-new-tokens", "8", "--ignore-eos",
           "--launch-depth", "2"]
    trace = ctx.path("generate.trace.json")
    out, err, _ = ctx.generate(model, gen + ["--trace", trace], "generate --trace")
    steps = (out.get("timing") or {}).get("steps")
    pb.check(steps == 8, f"generate: {steps} steps, expected 8 (both 3-token prompts in one "
                         f"chunked-prefill step, then 7 decode steps)")
    runs = read_trace(ctx, trace, "generate trace", err)
    check_trace_runs(pb, "generate trace", runs, range(steps or 0))
    check_launch_order(pb, "generate trace", runs, 2, expect_early=False)

    # generate failing in step 3: the error as without --trace, and the trace holds the steps
    # up to the failed one, complete.
    trace = ctx.path("generate_fault.trace.json")
    env = dict(ctx.env, SIMPLER_SIM_FAULTS="run=3:task=0:kind=kernel_error")
    p = expect_request_failure(ctx, [ctx.simpler, "generate", "--model", model, "--json", *gen,
                                     "--trace", trace], "generate with a kernel_error in run 3",
                               ["run 3", "task 0"], env=env)
    runs = read_trace(ctx, trace, "failed generate's trace", p.stderr)
    if runs is not None:
        for run_id in range(4):
            if pb.check(run_id in runs, f"failed generate's trace: no spans of run {run_id} "
                                        f"(runs {sorted(runs)})"):
                check_trace_run(pb, "failed generate's trace", run_id, runs[run_id],
                                failed_task=0 if run_id == 3 else None)

    # bench pipeline at depth 2 with H = D / 4: the host is ahead, every run is early.
    trace = ctx.path("pipeline.trace.json")
    p, _ = ctx.run_ok([ctx.simpler, "bench", "pipeline", "--runs", "20", "--host-ratios", "0.25",
                       "--depths", "2", "--device-us", "500", "--json", "--trace", trace],
                      label="bench pipeline --trace")
    runs = read_trace(ctx, trace, "bench pipeline trace", p.stderr)
    check_trace_runs(pb, "bench pipeline trace", runs, range(20))
    check_launch_order(pb, "bench pipeline trace", runs, 2, expect_early=True)


def decode_weight_elements(cfg):
    """Weights a decode step streams, as (matrix elements, norm-vector elements): every layer's,
    the final norm and the LM head (the embedding table when tied); the embedding lookup reads
    one row per request. Matrices stay in the checkpoint's dtype on the device; norm vectors are
    f32."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    layers = cfg["num_hidden_layers"]
    matrices = layers * (q * h + 2 * kv * h + h * q + 3 * inter * h) + cfg["vocab_size"] * h
    vectors = layers * (2 * h + 2 * hd) + h
    return matrices, vectors


def scenario_bench_decode(ctx):
    """`simpler bench decode --json` at launch depths 1 and 2 on the tiny preset: the keys,
    positive finite numbers that agree with each other, the depth echoed, a trace; and
    `--capture on,off`: a row each, in that order, with positive finite step time, host
    prepare and device ns per task."""
    pb = ctx.problems
    model = ctx.make_model(ctx.path("model"), "--preset", "tiny", "--seed", "18",
                           "--dtype", "bf16")
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    matrices, vectors = decode_weight_elements(cfg)
    weight_bytes = 2 * matrices + 4 * vectors  # a bf16 checkpoint
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # a position
    keys = {"model", "batch", "steps", "launch_depth", "kernel_isa", "precision", "step_ms",
            "device_step_ms_p50", "effective_depth", "tokens_per_s", "weight_bytes_per_step",
            "weight_gb_per_s", "read_gb_per_s", "fraction_of_read_bandwidth", "gflop_per_s",
            "capture", "prepare_us_p50", "ns_per_task_p50", "step_ms_p50", "turnaround_us_p50",
            "read_gb_per_s_before", "read_gb_per_s_after", "context", "kv_bytes_per_step",
            "read_bytes_gb_per_s", "decode_steps"}
    close = lambda a, b: abs(a - b) <= 1e-6 * max(abs(a), abs(b))
    for depth in (1, 2):
        label = f"bench decode --launch-depth {depth}"
        trace = ctx.path(f"decode{depth}.trace.json")
        p, _ = ctx.run_ok([ctx.simpler, "bench", "decode", "--model", model, "--steps", "4",
                           "--json", "--launch-depth", str(depth), "--trace", trace], label=label)
        out = parse_one_json_object(p.stdout, label)
        log(f"  {out}")
        if not pb.check(set(out) == keys, f"{label}: keys {sorted(out)}; missing "
                                          f"{sorted(keys - set(out))}, unexpected "
                                          f"{sorted(set(out) - keys)}"):
            continue
        pb.check(out["launch_depth"] == depth and out["steps"] == 4 and out["batch"] == 1
                 and out["model"] == model,
                 f"{label}: echoes launch_depth {out['launch_depth']}, steps {out['steps']}, "
                 f"batch {out['batch']}, model {out['model']!r}; expected {depth}, 4, 1, "
                 f"{model!r}")
        pb.check(out["kernel_isa"] in ("avx512", "x86-64-v3", "neon", "portable"),
                 f"{label}: kernel_isa {out['kernel_isa']!r}: not a target auto resolves to")
        pb.check(out["precision"] == "int8", f"{label}: precision {out['precision']!r}")
        pb.check(out["capture"] == "off", f"{label}: capture {out['capture']!r}, default off")
        pb.check(out["context"] == 0, f"{label}: context {out['context']}, default 0")
        bad = {k: out[k] for k in sorted(keys - {"model", "kernel_isa", "precision", "capture",
                                                 "context"})
               if not (isinstance(out[k], (int, float)) and not isinstance(out[k], bool)
                       and math.isfinite(out[k]) and out[k] > 0)}
        if not pb.check(not bad, f"{label}: not positive finite numbers: {bad}"):
            continue
        pb.check(1 <= out["effective_depth"] <= depth,
                 f"{label}: effective_depth {out['effective_depth']} outside [1, {depth}]")
        wb = out["weight_bytes_per_step"]
        pb.check(isinstance(wb, int) and wb == weight_bytes,
                 f"{label}: weight_bytes_per_step {wb}, expected {weight_bytes}: {matrices} "
                 f"matrix weights kept in bf16 and {vectors} norm weights in f32")
        # The derived numbers agree with the measured ones.
        pb.check(close(out["weight_gb_per_s"], wb / (out["device_step_ms_p50"] / 1e3) / 1e9),
                 f"{label}: weight_gb_per_s {out['weight_gb_per_s']} is not weight bytes / "
                 f"device step time ({wb} B / {out['device_step_ms_p50']} ms)")
        # The row is held against the higher of the probes just before and just after it.
        pb.check(close(out["read_gb_per_s"],
                       max(out["read_gb_per_s_before"], out["read_gb_per_s_after"])),
                 f"{label}: read_gb_per_s {out['read_gb_per_s']} is not the higher of the probes "
                 f"before ({out['read_gb_per_s_before']}) and after ({out['read_gb_per_s_after']}) "
                 f"the row")
        # The step reads its weights and its f32 K and V: the one-token prompt, then 3 timed
        # steps attending 2, 3 and 4 positions, 3 on average.
        pb.check(out["kv_bytes_per_step"] == kv * 3 and out["decode_steps"] == 3,
                 f"{label}: kv_bytes_per_step {out['kv_bytes_per_step']}, expected {kv} x 3; "
                 f"decode_steps {out['decode_steps']}, expected 3")
        pb.check(close(out["read_bytes_gb_per_s"],
                       (wb + out["kv_bytes_per_step"]) / (out["device_step_ms_p50"] / 1e3) / 1e9),
                 f"{label}: read_bytes_gb_per_s {out['read_bytes_gb_per_s']} is not (weights + K "
                 f"and V) / device step time")
        pb.check(close(out["fraction_of_read_bandwidth"],
                       out["read_bytes_gb_per_s"] / out["read_gb_per_s"]),
                 f"{label}: fraction_of_read_bandwidth {out['fraction_of_read_bandwidth']} is not "
                 f"{out['read_bytes_gb_per_s']} / {out['read_gb_per_s']}")
        pb.check(close(out["gflop_per_s"],
                       2 * matrices / (out["device_step_ms_p50"] / 1e3) / 1e9),
                 f"{label}: gflop_per_s {out['gflop_per_s']} is not 2 x {matrices} matrix "
                 f"weights per row / device step time")
        pb.check(close(out["tokens_per_s"], 1e3 / out["step_ms"]),
                 f"{label}: tokens_per_s {out['tokens_per_s']} is not 1 token per step of "
                 f"{out['step_ms']} ms")
        runs = read_trace(ctx, trace, f"{label} trace", p.stderr)
        check_trace_runs(pb, f"{label} trace", runs, range(4))
        check_launch_order(pb, f"{label} trace", runs, depth, expect_early=False)
    # The text row: a share of the read probe over 100% (a model small enough to stay in the
    # caches) is said to be one, and only then.
    label = "bench decode (text)"
    p, _ = ctx.run_ok([ctx.simpler, "bench", "decode", "--model", model, "--steps", "4",
                       "--warm-up-rows", "0"], label=label)
    m = re.search(r"= ([0-9.]+)% of the read-bandwidth probe's", p.stdout)
    if pb.check(m is not None, f"{label}: no share of the read probe in {p.stdout!r}"):
        over = float(m.group(1)) > 100
        noted = "over 100%: the" in p.stdout and "stay in the CPU caches" in p.stdout
        pb.check(over == noted, f"{label}: share {m.group(1)}%, note printed: {noted}: "
                                f"{p.stdout!r}")
    # Without the warm-up row (the runs above have it): still one printed row per mode.
    label = "bench decode --capture on,off --warm-up-rows 0"
    p, _ = ctx.run_ok([ctx.simpler, "bench", "decode", "--model", model, "--steps", "6",
                       "--json", "--capture", "on,off", "--warm-up-rows", "0"], label=label)
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    log(f"  {rows}")
    if pb.check([r.get("capture") for r in rows] == ["on", "off"],
                f"{label}: rows {[r.get('capture') for r in rows]}, expected ['on', 'off']"):
        for r in rows:
            pb.check(all(math.isfinite(r[k]) and r[k] > 0
                         for k in ("step_ms", "prepare_us_p50", "ns_per_task_p50")),
                     f"{label}: capture {r['capture']}: step_ms {r['step_ms']}, prepare_us_p50 "
                     f"{r['prepare_us_p50']}, ns_per_task_p50 {r['ns_per_task_p50']}: not "
                     f"positive finite")
    # --repeat 2: the modes alternate in one process (on, off, on, off), then one summary line
    # whose medians are those of each mode's rows and whose ratios are off / on.
    label = "bench decode --capture on,off --repeat 2"
    p, _ = ctx.run_ok([ctx.simpler, "bench", "decode", "--model", model, "--steps", "6",
                       "--json", "--capture", "on,off", "--repeat", "2", "--warm-up-rows", "0"],
                      label=label)
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    log(f"  {lines}")
    rows = [r for r in lines if "summary" not in r]
    summaries = [r for r in lines if "summary" in r]
    if pb.check([r.get("capture") for r in rows] == ["on", "off", "on", "off"]
                and len(summaries) == 1,
                f"{label}: rows {[r.get('capture') for r in rows]} and {len(summaries)} summary "
                f"lines, expected ['on', 'off', 'on', 'off'] and 1"):
        s = summaries[0]
        for mode in ("on", "off"):
            mine = sorted(r["step_ms_p50"] for r in rows if r["capture"] == mode)
            # The median of two rows is their mean (to the JSON's rounding).
            pb.check(s[mode]["rows"] == 2
                     and abs(s[mode]["step_ms_p50"] - (mine[0] + mine[1]) / 2) <= 1e-6 * mine[1],
                     f"{label}: summary {mode} {s[mode]} is not the median of its rows {mine}")
            pb.check(all(r["turnaround_us_p50"] > 0 for r in rows if r["capture"] == mode),
                     f"{label}: a {mode} row without a host turnaround")
            frac = sorted(r["fraction_of_read_bandwidth"] for r in rows if r["capture"] == mode)
            got = s[mode].get("fraction_of_read_bandwidth_p50", -1)
            pb.check(abs(got - (frac[0] + frac[1]) / 2) <= 1e-6 * frac[1]
                     and "over_llamacpp_p50" not in s[mode],
                     f"{label}: summary {mode} {s[mode]}: fraction_of_read_bandwidth_p50 is not "
                     f"the median of its rows' {frac}, or a llama.cpp ratio without --compare")
        pb.check(abs(s["replay_step_speedup"] - s["off"]["step_ms_p50"] / s["on"]["step_ms_p50"])
                 <= 1e-9 * s["replay_step_speedup"],
                 f"{label}: replay_step_speedup {s['replay_step_speedup']} is not off / on")
    # --context 40: a 40-token prompt prefilled first, untimed; the timed steps are the decode
    # steps after it (attending 41, 42 and 43 positions), and a context past the
    # model's positions is refused naming both flags.
    label = "bench decode --context 40"
    p, _ = ctx.run_ok([ctx.simpler, "bench", "decode", "--model", model, "--steps", "4",
                       "--json", "--context", "40", "--warm-up-rows", "0"], label=label)
    out = parse_one_json_object(p.stdout, label)
    log(f"  {out}")
    pb.check(out.get("context") == 40 and out.get("kv_bytes_per_step") == kv * 42
             and out.get("tokens_per_s", 0) > 0,
             f"{label}: context {out.get('context')}, kv_bytes_per_step "
             f"{out.get('kv_bytes_per_step')} (expected {kv} x 42), tokens_per_s "
             f"{out.get('tokens_per_s')}")
    # Two copies of a 600-token prompt (two prefill chunks of up to 512): the second copy waits a
    # step for the first one's prompt pages, so the timed steps are the 4 in which both rows
    # decode, after the step before them; their prompt's 37 full pages of 16 (592 positions)
    # count once, each row's 8 more, its token and on average 1.5 of the timed steps' per row.
    label = "bench decode --batch 2 --context 600"
    p, _ = ctx.run_ok([ctx.simpler, "bench", "decode", "--model", model, "--steps", "6",
                       "--batch", "2", "--json", "--context", "600", "--warm-up-rows", "0"],
                      label=label)
    out = parse_one_json_object(p.stdout, label)
    log(f"  {out}")
    pb.check(out.get("decode_steps") == 4 and out.get("kv_bytes_per_step") == kv * 613,
             f"{label}: decode_steps {out.get('decode_steps')} (expected 4), kv_bytes_per_step "
             f"{out.get('kv_bytes_per_step')} (expected {kv} x (592 + 2 x 10.5))")
    p, _ = ctx.run([ctx.simpler, "bench", "decode", "--model", model, "--context", "1000000"],
                   label="bench decode --context 1000000")
    pb.check(p.returncode != 0 and "--context and --steps" in p.stderr
             and "max_position_embeddings" in p.stderr,
             f"bench decode --context 1000000: exit {p.returncode}, stderr {p.stderr[-300:]!r}")
    # PyTorch's script decodes after a one-token prompt only: a context is refused, naming both.
    p, _ = ctx.run([ctx.simpler, "bench", "decode", "--model", model, "--context", "40",
                    "--compare", "torch"], label="bench decode --context 40 --compare torch")
    pb.check(p.returncode != 0 and "--compare torch" in p.stderr and "--context 40" in p.stderr,
             f"bench decode --context 40 --compare torch: exit {p.returncode}, stderr "
             f"{p.stderr[-300:]!r}")
    # One step is only the prompt's: nothing would be timed.
    expect_refused_by_parser(ctx, [ctx.simpler, "bench", "decode", "--model", model, "--steps",
                                   "1"], "bench decode --steps 1", ["--steps"])
    expect_refused_by_parser(ctx, [ctx.simpler, "bench", "decode", "--model", model,
                                   "--repeat", "0"], "bench decode --repeat 0", ["--repeat"])
    expect_refused_by_parser(ctx, [ctx.simpler, "bench", "decode", "--model", model,
                                   "--warm-up-rows", "2"], "bench decode --warm-up-rows 2",
                             ["--warm-up-rows"])



def check_bench_throughput(ctx, model):
    """`simpler bench throughput` says what each ratio it prints is a ratio of, and its --json
    keys for them stay (continuous_over_static, ttft_probe_over_prefill_device,
    output_tokens_per_s_on_over_off), each the quotient of the numbers it names."""
    pb = ctx.problems
    close = lambda a, b: abs(a - b) <= 1e-6 * max(abs(a), abs(b))
    argv = [ctx.simpler, "bench", "throughput", "--model", model, "--num-prompts", "4",
            "--input-len-range", "8:16", "--output-len-range", "4:8", "--ttft-probe-len", "16"]
    p, _ = ctx.run_ok(argv, label="bench throughput")
    for want in (r"^output tokens/s, continuous / static: \d+\.\d\dx$",
                 r"; TTFT / prefill device time: \d+\.\d{3}x$"):
        pb.check(re.search(want, p.stdout, re.M), f"bench throughput: no line matching {want!r}: "
                                                  f"{tail(p.stdout, 600)!r}")
    p, _ = ctx.run_ok(argv + ["--json"], label="bench throughput --json")
    j = parse_one_json_object(p.stdout, "bench throughput --json")
    pb.check(close(j.get("continuous_over_static", 0),
                   j.get("output_tokens_per_s", 0) / max(j.get("static_output_tokens_per_s", 0),
                                                         1e-300)),
             f"bench throughput --json: continuous_over_static {j.get('continuous_over_static')}")
    pb.check(close(j.get("ttft_probe_over_prefill_device", 0),
                   j.get("ttft_probe_ms", 0) / max(j.get("ttft_probe_prefill_device_ms", 0),
                                                   1e-300)),
             f"bench throughput --json: ttft_probe_over_prefill_device "
             f"{j.get('ttft_probe_over_prefill_device')}")
    argv = [ctx.simpler, "bench", "throughput", "--model", model, "--workload", "multi-turn",
            "--num-prompts", "2", "--turns", "2", "--system-prompt-len", "16"]
    p, _ = ctx.run_ok(argv, label="bench throughput multi-turn")
    want = r"^output tokens/s: cache off \d+\.\d, cache on \d+\.\d \(on / off: \d+\.\d\dx\)$"
    pb.check(re.search(want, p.stdout, re.M),
             f"bench throughput multi-turn: no line matching {want!r}: {tail(p.stdout, 600)!r}")
    p, _ = ctx.run_ok(argv + ["--json"], label="bench throughput multi-turn --json")
    j = parse_one_json_object(p.stdout, "bench throughput multi-turn --json")
    pb.check("output_tokens_per_s_on_over_off" in j,
             f"bench throughput multi-turn --json: keys {sorted(j)}")


def check_bench_serve_structured(ctx, model):
    """`simpler bench serve --structured json-schema FILE` on loopback: its text names each
    figure (the constrained and unconstrained rows, the run without the schema, the mask time
    over the constrained rows, the per-pair ITL ratios), --json carries them under "structured";
    a schema the server refuses fails the run naming the server's reason, not a bare status."""
    pb = ctx.problems
    schema = ctx.path("bench_serve_schema.json")
    with open(schema, "w") as f:
        json.dump({"type": "object", "properties": {"name": {"type": "string"},
                                                    "n": {"type": "integer"}},
                   "required": ["name", "n"]}, f)
    argv = [ctx.simpler, "bench", "serve", "--model", model, "--num-prompts", "4",
            "--input-len-range", "8:16", "--output-len-range", "4:8",
            "--structured", "json-schema", schema]
    p, _ = ctx.run_ok(argv, label="bench serve --structured")
    for want in (r"^structured \(schema on every second request, first pair\): constrained "
                 r"\d+\.\d output tokens/s, ITL ms p50 [\d.]+ p99 [\d.]+; unconstrained beside "
                 r"them \d+\.\d tokens/s, .*; the workload without the schema \d+\.\d tokens/s",
                 r"^structured: grammar mask [\d.]+ ms mean over [1-9]\d* rows",
                 r"^structured: unconstrained ITL p50 / without the schema's, per pair: "
                 r"\d+\.\d\d \(median \d+\.\d\d\)$"):
        pb.check(re.search(want, p.stdout, re.M), f"bench serve --structured: no line matching "
                                                  f"{want!r}: {tail(p.stdout, 800)!r}")
    pb.check("structured: {" not in p.stdout,
             f"bench serve --structured: raw JSON in the text: {tail(p.stdout, 400)!r}")
    p, _ = ctx.run_ok(argv + ["--json"], label="bench serve --structured --json")
    j = parse_one_json_object(p.stdout, "bench serve --structured --json")
    st = j.get("structured") or {}
    pb.check(st.get("mask_rows", 0) > 0 and st.get("pairs") == 1
             and len(st.get("unconstrained_over_without_itl_p50", [])) == 1,
             f"bench serve --structured --json: structured {st}")
    with open(schema, "w") as f:
        json.dump({"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}}},
                  f)
    p, _ = ctx.run(argv, label="bench serve with a refused schema")
    pb.check(p.returncode == 1 and "request(s) failed; the first: HTTP 400: 'response_format': "
                                   "unsupported JSON Schema keyword 'maxLength'" in p.stderr,
             f"bench serve with a refused schema: exit {p.returncode}, stderr "
             f"{tail(p.stderr, 400)!r}")
    # --url: the workload against a server already running (it answers GET /v1/models first).
    proc, url, _ = start_server(ctx, model, "--no-access-log")
    try:
        p, _ = ctx.run_ok([ctx.simpler, "bench", "serve", "--model", model, "--url", url + "/",
                           "--num-prompts", "2", "--input-len-range", "4:4",
                           "--output-len-range", "2:2", "--json"], label="bench serve --url")
        j = parse_one_json_object(p.stdout, "bench serve --url")
        pb.check(j.get("url") == url + "/" and j.get("errors") == 0 and j.get("num_prompts") == 2
                 and j.get("output_tokens_per_s", 0) > 0,
                 f"bench serve --url: {str(j)[:400]}")
    finally:
        stop_server(proc)


def scenario_bench_prefill_load(ctx):
    """`simpler bench prefill --json` and `bench load --json` on the tiny preset: one object per
    prompt length with the issue's keys, numbers that agree with each other (GFLOP/s from the
    prompt's FLOPs and the TTFT, the fraction of the measured peak), and the load row's keys;
    `--compare starpu` / `--compare torch` either run with their keys or are refused naming
    the Debian package; a prompt past the model's positions refused. And `bench throughput`'s
    labelled ratios (check_bench_throughput), `bench serve --structured`
    (check_bench_serve_structured)."""
    pb = ctx.problems
    model = ctx.make_model(ctx.path("model"), "--preset", "tiny", "--seed", "19",
                           "--dtype", "bf16")
    check_bench_throughput(ctx, model)
    check_bench_serve_structured(ctx, model)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    matrices, _ = decode_weight_elements(cfg)
    lm = cfg["vocab_size"] * cfg["hidden_size"]
    close = lambda a, b: abs(a - b) <= 1e-6 * max(abs(a), abs(b))
    p, _ = ctx.run_ok([ctx.simpler, "bench", "prefill", "--model", model, "--prompt-lens",
                       "16,48", "--json"], label="bench prefill")
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    keys = {"model", "prompt_len", "kernel_isa", "precision", "ttft_ms", "tokens_per_s",
            "gflop_per_s", "peak_gflop_per_s", "fraction_of_peak", "peak_isa",
            "theoretical_peak_gflop_per_s", "theoretical_peak", "peak_below_half_theoretical",
            "fraction_of_theoretical_peak", "gflop", "attention_gflop"}
    words = {"model", "kernel_isa", "precision", "peak_isa", "theoretical_peak",
             "peak_below_half_theoretical", "theoretical_peak_gflop_per_s",
             "fraction_of_theoretical_peak"}
    pb.check([r.get("prompt_len") for r in rows] == [16, 48],
             f"bench prefill: prompt_len rows {[r.get('prompt_len') for r in rows]}, expected "
             f"[16, 48]")
    for r in rows:
        label = f"bench prefill {r.get('prompt_len')}"
        if not pb.check(set(r) == keys, f"{label}: keys {sorted(r)}, expected {sorted(keys)}"):
            continue
        n = r["prompt_len"]
        pb.check(r["precision"] == "int8", f"{label}: precision {r['precision']!r}")
        pb.check(all(isinstance(r[k], (int, float)) and math.isfinite(r[k]) and r[k] > 0
                     for k in keys - words),
                 f"{label}: not positive finite numbers: {r}")
        # The peak is measured on the fastest target whatever target the kernels ran, and held
        # against the figure on paper (at the measured clock; 0 where no clock is known).
        pb.check(r["peak_isa"] == r["kernel_isa"] and r["kernel_isa"] != "auto",
                 f"{label}: kernel_isa {r['kernel_isa']!r}, peak_isa {r['peak_isa']!r}")
        paper = r["theoretical_peak_gflop_per_s"]
        pb.check(paper >= 0 and r["peak_below_half_theoretical"] ==
                 (paper > 0 and r["peak_gflop_per_s"] < paper / 2),
                 f"{label}: peak_below_half_theoretical disagrees with the figures: {r}")
        # The clock on paper is a real core's: an add chain a renamer folds (an add of an
        # immediate on Intel's Golden Cove) once measured 17 GHz.
        clock = re.search(r" x ([0-9.]+) GHz \(measured", r["theoretical_peak"])
        pb.check(paper == 0 or (clock is not None and 0.2 <= float(clock.group(1)) <= 7.0),
                 f"{label}: the measured clock of the figure on paper is not a core's: "
                 f"{r['theoretical_peak']!r}")
        pb.check(close(r["fraction_of_theoretical_peak"],
                       r["gflop_per_s"] / paper if paper > 0 else 0.0),
                 f"{label}: fraction_of_theoretical_peak is not gflop_per_s / "
                 f"theoretical_peak_gflop_per_s: {r}")
        # The projections of every position, the LM head of the last one, and the causal
        # attention: per layer and query head, head_dim multiply-adds for the score and for the
        # weighted V of each (position, attended position) pair.
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        attention = 2 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * 2 * hd * \
            (n * (n + 1) // 2)
        flop = 2 * (n * (matrices - lm) + lm) + attention
        pb.check(close(r["gflop"], flop / 1e9) and close(r["attention_gflop"], attention / 1e9),
                 f"{label}: gflop {r['gflop']}, attention_gflop {r['attention_gflop']}, expected "
                 f"{flop / 1e9} and {attention / 1e9}")
        pb.check(close(r["gflop_per_s"], flop / (r["ttft_ms"] / 1e3) / 1e9),
                 f"{label}: gflop_per_s {r['gflop_per_s']} is not {flop} FLOPs / ttft")
        pb.check(close(r["fraction_of_peak"], r["gflop_per_s"] / r["peak_gflop_per_s"]),
                 f"{label}: fraction_of_peak is not gflop_per_s / peak_gflop_per_s")
        pb.check(close(r["tokens_per_s"], n / (r["ttft_ms"] / 1e3)),
                 f"{label}: tokens_per_s is not prompt_len / ttft")
    # generate --json names the target it ran.
    p, _ = ctx.run_ok([ctx.simpler, "generate", "--model", model, "--prompt-ids", "9707,11",
                       "--max-new-tokens", "2", "--kernel-isa", "portable", "--json"],
                      label="generate --kernel-isa portable")
    g = parse_one_json_object(p.stdout, "generate --kernel-isa portable --json")
    pb.check(g.get("kernel_isa") == "portable" and g.get("precision") == "int8",
             f"generate --json: kernel_isa {g.get('kernel_isa')!r}, precision {g.get('precision')!r}")
    p, _ = ctx.run_ok([ctx.simpler, "bench", "prefill", "--model", model, "--prompt-lens", "16",
                       "--kernel-isa", "portable", "--json"], label="bench prefill portable")
    r = parse_one_json_object(p.stdout, "bench prefill --kernel-isa portable")
    pb.check(r.get("kernel_isa") == "portable" and r.get("peak_isa") == rows[0].get("peak_isa"),
             f"bench prefill --kernel-isa portable: the peak must stay the fastest target's: {r}")
    # Precision bf16 adds the bf16 GEMM library on the same shapes (where the CPU runs bf16;
    # elsewhere the row says exact and has no library keys).
    p, _ = ctx.run_ok([ctx.simpler, "bench", "prefill", "--model", model, "--prompt-lens", "32",
                       "--precision", "bf16", "--json"], label="bench prefill --precision bf16")
    r = parse_one_json_object(p.stdout, "bench prefill --precision bf16")
    lib_keys = {"library", "library_gflop_per_s", "fraction_of_library"}
    if r.get("precision") == "bf16":
        pb.check(set(r) == keys | lib_keys
                 and r["library"].startswith("oneDNN ") and r["library_gflop_per_s"] > 0
                 and close(r["fraction_of_library"], r["gflop_per_s"] / r["library_gflop_per_s"]),
                 f"bench prefill --precision bf16: {r}; expected the keys {sorted(keys | lib_keys)}"
                 f" with fraction_of_library = gflop_per_s / library_gflop_per_s")
    else:
        pb.check(r.get("precision") == "exact" and set(r) == keys,
                 f"bench prefill --precision bf16 on a CPU without bf16: {r}")
    p, _ = ctx.run_ok([ctx.simpler, "bench", "load", "--model", model, "--json"],
                      label="bench load")
    out = parse_one_json_object(p.stdout, "bench load")
    keys = {"model", "checkpoint_bytes", "load_s", "read_s", "load_over_read", "vm_hwm_bytes",
            "weight_types"}
    if pb.check(set(out) == keys, f"bench load: keys {sorted(out)}, expected {sorted(keys)}"):
        # The tiny bf16 preset stores every tensor in bf16, the norms too: the embedding, the
        # final norm, 11 a layer, and the LM head when untied.
        layers, tied = cfg["num_hidden_layers"], cfg.get("tie_word_embeddings", True)
        want = {"bf16": 2 + 11 * layers + (0 if tied else 1)}
        pb.check(out["weight_types"] == want,
                 f"bench load: weight_types {out['weight_types']}, expected {want}")
        size = os.path.getsize(os.path.join(model, "model.safetensors"))
        pb.check(out["checkpoint_bytes"] == size,
                 f"bench load: checkpoint_bytes {out['checkpoint_bytes']}, the file has {size}")
        pb.check(out["load_s"] > 0 and out["read_s"] > 0
                 and close(out["load_over_read"], out["load_s"] / out["read_s"]),
                 f"bench load: load_s / read_s / load_over_read disagree: {out}")
        pb.check(out["vm_hwm_bytes"] >= size,
                 f"bench load: vm_hwm_bytes {out['vm_hwm_bytes']} below the checkpoint's {size}")
    # The peers: each either runs (and its keys are there) or is refused naming the package.
    p, _ = ctx.run([ctx.simpler, "bench", "dispatch", "--tasks", "200", "--compare", "starpu",
                    "--json"], label="bench dispatch --compare starpu")
    if p.returncode == 0:
        rows = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
        pb.check([(r["pattern"], r["mode"]) for r in rows]
                 == [(p, m) for p in ("independent", "chain", "8_chains")
                     for m in ("uncaptured", "replayed")]
                 and all(r["starpu_ns_per_task"] > 0 and close(
                     r["starpu_over_simpler"], r["starpu_ns_per_task"] / r["ns_per_task"])
                     for r in rows),
                 f"bench dispatch --compare starpu: rows {rows}")
    else:
        pb.check(p.returncode == 1 and "libstarpu-dev" in p.stderr,
                 f"bench dispatch --compare starpu without StarPU: exit {p.returncode}, stderr "
                 f"{p.stderr[-300:]!r}; expected exit 1 naming libstarpu-dev")
    p, _ = ctx.run([ctx.simpler, "bench", "prefill", "--model", model, "--prompt-lens", "8",
                    "--compare", "torch", "--json"], label="bench prefill --compare torch")
    if p.returncode == 0:
        r = parse_one_json_object(p.stdout, "bench prefill --compare torch")
        pb.check(r.get("torch_ttft_ms", 0) > 0
                 and close(r["speedup_vs_torch"], r["torch_ttft_ms"] / r["ttft_ms"]),
                 f"bench prefill --compare torch: {r}")
    else:
        pb.check(p.returncode == 1 and "python3-torch" in p.stderr,
                 f"bench prefill --compare torch without torch: exit {p.returncode}, stderr "
                 f"{p.stderr[-300:]!r}; expected exit 1 naming python3-torch")
    too_long = str(cfg.get("max_position_embeddings", 32768) + 1)
    p, _ = ctx.run([ctx.simpler, "bench", "prefill", "--model", model, "--prompt-lens", too_long],
                label="bench prefill past the positions")
    pb.check(p.returncode == 1 and "--prompt-lens" in p.stderr,
             f"bench prefill --prompt-lens {too_long}: exit {p.returncode}, stderr "
             f"{p.stderr[-300:]!r}; expected exit 1 naming --prompt-lens")


# ---------------------------------------------------------------------------------------------
# Bad input: never a crash, a hang or a silent acceptance


def read_st(path):
    """(header text, byte buffer) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    return raw[8:8 + n], raw[8 + n:]


def write_st(path, header, buffer):
    """A safetensors file with the header bytes given as they are (no validation), written
    afresh: a hard link at `path` is replaced, the file it shared left as it was."""
    if isinstance(header, str):
        header = header.encode()
    rewrite(path, len(header).to_bytes(8, "little") + header + buffer)


def rewrite(path, data):
    """Writes `data` (str or bytes) to a new file at `path`, removing what was there first (a
    hard link to a file that must stay as it is, see link_large)."""
    if os.path.lexists(path):
        os.remove(path)
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


# The files of a checkpoint too large to copy once per broken variant (the tiny preset's).
LARGE_FILES = ("model.safetensors", "tokenizer.json")


def link_large(src, dst):
    """shutil.copytree's copy_function: a hard link for LARGE_FILES, a copy for the rest."""
    if os.path.basename(src) in LARGE_FILES:
        os.link(src, dst)
        return dst
    return shutil.copy2(src, dst)


def edit_json(path, **changes):
    with open(path) as f:
        j = json.load(f)
    j.update(changes)
    with open(path, "w") as f:
        json.dump(j, f)


def run_bytes(argv, env=None, timeout=CLI_TIMEOUT_S):
    """Runs argv (str or bytes items) and returns the CompletedProcess with bytes output; for
    paths that are not UTF-8, which the logging of Ctx.run cannot print."""
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                          timeout=timeout)


def scenario_bad_input(ctx):
    pb = ctx.problems
    base = ctx.make_model(ctx.path("tiny"), "--preset", "tiny", "--seed", "3",
                          "--tokenizer-dir", ctx.tokenizer_dir)
    n = [0]
    stamp = lambda: [(os.stat(os.path.join(base, f)).st_size,
                      os.stat(os.path.join(base, f)).st_mtime_ns) for f in LARGE_FILES]
    base_stamp = stamp()

    def copy(tag):
        """A copy of the base checkpoint to break. Its two large files (the weights, 39 MB, and
        the tokenizer, 11 MB) are hard links to the base's: every edit below writes a file
        afresh (write_st and `rewrite` remove it first), so that the base is never changed."""
        n[0] += 1
        d = ctx.path(f"m{n[0]}_{tag}")
        shutil.copytree(base, d, copy_function=link_large)
        return d

    def gen(model, *extra):
        return [ctx.simpler, "generate", "--model", model, "--max-new-tokens", "4", *extra]

    deep = "[" * 100000 + "]" * 100000

    # 1. A value nested 100,000 deep: refused with its path, and the error line stays short.
    for field in ("hidden_size", "rope_scaling"):
        d = copy("deep_" + field)
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        cfg.pop(field)
        text = json.dumps(cfg)[:-1] + f', "{field}": {deep}}}'
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write(text)
        p = expect_error(ctx, gen(d, "--prompt-ids", "1,2"), f"1. config.json {field} deep",
                         ["config.json", f"JSON nested deeper than 64 levels at /{field}"])
        pb.check(len(p.stderr) < 2000, f"1. {field} deep: {len(p.stderr)} bytes of stderr")
    d = copy("deep_gen")
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        f.write('{"eos_token_id": ' + deep + "}")
    expect_error(ctx, gen(d, "--prompt-ids", "1,2"), "1. generation_config.json eos deep",
                 ["generation_config.json", "nested deeper than 64 levels at /eos_token_id"])
    for key in ("shape", "data_offsets"):
        d = copy("deep_st_" + key)
        st = os.path.join(d, "model.safetensors")
        header, buf = read_st(st)
        h = json.loads(header)
        first = sorted(k for k in h if k != "__metadata__")[0]
        h[first][key] = "DEEP"
        write_st(st, json.dumps(h).replace('"DEEP"', deep), buf)
        expect_error(ctx, gen(d, "--prompt-ids", "1,2"), f"1. safetensors {key} deep",
                     [st, f"nested deeper than 64 levels at /{first}/{key}"])
    d = copy("deep_tok_cfg")
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        f.write('{"eos_token": ' + deep + "}")
    p = expect_error(ctx, gen(d, "--prompt", "hi"), "1. tokenizer_config.json eos_token deep",
                     ["tokenizer_config.json", "nested deeper than 64 levels at /eos_token"])
    # Nested within the bound: the value is quoted, but short.
    d = copy("nested_rope")
    nested = ["x" * 2000]
    for _ in range(50):
        nested = [nested]
    edit_json(os.path.join(d, "config.json"), rope_scaling=nested)
    p = expect_error(ctx, gen(d, "--prompt-ids", "1,2"), "messages: a bad value nested deep",
                     ["rope_scaling", "unsupported"])
    pb.check(len(p.stderr.splitlines()[-1]) < 400,
             f"messages: the rope_scaling error line is {len(p.stderr.splitlines()[-1])} chars")

    # 2. 1e400: an error naming the file, never an abort; with --prompt-ids the tokenizer is
    # optional, so the run goes on after a warning.
    for name, text in (("tokenizer.json", None), ("tokenizer_config.json",
                                                  '{"model_max_length": 1e400}')):
        d = copy("huge_" + name.split(".")[0])
        path = os.path.join(d, name)
        if text is None:
            with open(path) as f:
                text = f.read().rstrip()
            text = text[:-1] + ', "simpler_test": 1e400}'
        rewrite(path, text)
        p, _ = ctx.run(gen(d, "--prompt-ids", "1,2"), label=f"2. {name} 1e400 --prompt-ids")
        pb.check(p.returncode == 0, f"2. {name} 1e400 with --prompt-ids: exit {p.returncode}: "
                                    f"{tail(p.stderr, 400)!r}")
        pb.check(path in p.stderr and "number overflow" in p.stderr,
                 f"2. {name} 1e400: the warning does not name the file and the overflow: "
                 f"{tail(p.stderr, 400)!r}")
        expect_error(ctx, gen(d, "--prompt", "hi"), f"2. {name} 1e400 --prompt",
                     [path, "number overflow parsing '1e400'"])

    # 3. Names and paths that are not UTF-8 come out as U+FFFD, in --json and in --trace.
    odd_dir = os.fsencode(ctx.path("dir")) + b"\xff"
    shutil.copytree(os.fsencode(base), odd_dir)
    p = run_bytes([os.fsencode(ctx.simpler), b"bench", b"decode", b"--model", odd_dir,
                   b"--json", b"--steps", b"2"], env=ctx.env)
    if pb.check(p.returncode == 0, f"3. bench decode --model dir\\xff --json: exit "
                                   f"{p.returncode}: {p.stderr[-400:]!r}"):
        out = json.loads(p.stdout.decode("utf-8"))
        pb.check(out.get("model", "").endswith("dir\ufffd"), f"3. model {out.get('model')!r}")
    odd_lib = os.path.join(os.path.dirname(ctx.matmul_lib), "libsimpler_test_odd_program.so")
    trace = ctx.path("odd.trace.json")
    p, _ = ctx.run([ctx.simpler, "run", odd_lib, "--json", "--trace", trace],
                   label="3. run odd names --json --trace")
    if pb.check(p.returncode == 0, f"3. run odd names: exit {p.returncode}: "
                                   f"{tail(p.stderr, 400)!r}"):
        out = parse_one_json_object(p.stdout, "3. run odd names")
        pb.check(out.get("library") == "odd\ufffd" and out.get("passed") is True,
                 f"3. run odd names --json: {out}")
        with open(trace, encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
        pb.check(any("\ufffd" in e.get("name", "") for e in events),
                 "3. the trace holds no span named with U+FFFD")

    # 4. Huge flag values: refused by the parser, naming the flag, the value and the bound.
    for flags, names in ((["--requests", "2147483647"], ["--requests", "2147483647", "4096"]),
                         (["--cores", "40000"], ["--cores", "40000", "256"]),
                         (["--cores", "2147483647"], ["--cores", "2147483647", "256"]),
                         (["--timeout", "nan"], ["--timeout", "nan", "finite"]),
                         (["--timeout", "-1"], ["--timeout", "-1", "minimum of 0"]),
                         (["--launch-depth", "1025"], ["--launch-depth", "1025", "1024"])):
        p = expect_refused_by_parser(ctx, gen(base, "--prompt-ids", "1,2", *flags),
                                     f"4. generate {' '.join(flags)}", names)
        pb.check("1797" not in p.stderr and "WorkerOptions" not in p.stderr,
                 f"4. {' '.join(flags)}: {tail(p.stderr, 300)!r}")

    # 5. Token ids beyond 32 bits are refused with their value, never wrapped.
    for ids in ("4294967301", "10000000000"):
        pf = ctx.path(f"wide_{ids}.jsonl")
        with open(pf, "w") as f:
            f.write('{"prompt_ids": [%s]}\n' % ids)
        expect_error(ctx, gen(base, "--prompts-file", pf), f"5. prompt_ids [{ids}]",
                     [f"{pf}:1: token id {ids} outside the vocabulary"])
    expect_error(ctx, gen(base, "--prompt-ids", "1,10000000000"), "5. --prompt-ids 10000000000",
                 ["token id 10000000000 outside the vocabulary"])

    # 6. Requests are validated before the KV pool is sized (no 2 GB pool, no 41 GB error).
    pf = ctx.path("million.jsonl")
    with open(pf, "w") as f:
        f.write('{"prompt_ids": [%s]}\n' % ",".join(["1"] * 1000000))
    # Peak memory of the refused command alone, measured by a fresh Python parent.
    rss = ("import resource, subprocess, sys\n"
           "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
           "sys.stderr.write(p.stderr)\n"
           "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    p, wall = ctx.run([ctx.python, "-c", rss, *gen(base, "--prompts-file", pf)],
                      label="6. a 10^6-token prompt")
    rc, max_kb = (int(v) for v in p.stdout.split())
    pb.check(rc == 1 and "prompt of 1000000 tokens + 4 new tokens exceeds "
             "max_position_embeddings 4096" in p.stderr, f"6. 10^6 tokens: exit {rc}: "
             f"{tail(p.stderr, 300)!r}")
    pb.check(max_kb < 1_000_000, f"6. 10^6 tokens: peak RSS {max_kb / 1e6:.2f} GB before the "
                                 "refusal (a KV pool was sized first)")
    pb.check(wall < 20, f"6. 10^6 tokens took {wall:.1f} s to be refused")
    expect_error(ctx, gen(base, "--prompt-ids", ",".join(["1"] * 5000), "--requests", "4000"),
                 "6. 5000 ids x 4000 requests",
                 ["request 0: prompt of 5000 tokens", "max_position_embeddings 4096"])
    expect_error(ctx, [ctx.simpler, "generate", "--model", base, "--prompt-ids", "1,2",
                       "--max-new-tokens", "2147483647"],
                 "6. --max-new-tokens 2147483647",
                 ["2147483647 new tokens exceeds max_position_embeddings 4096"])

    expect_error(ctx, [ctx.simpler, "bench", "decode", "--model", base, "--steps", "1000000"],
                 "6. bench decode --steps 1000000",
                 ["--steps: prompt of 1 tokens + 1000000 new tokens exceeds "
                  "max_position_embeddings 4096"])

    # 7. A FIFO in place of a file is refused at once.
    for name in ("model.safetensors", "config.json"):
        d = copy("fifo_" + name.split(".")[0])
        os.remove(os.path.join(d, name))
        os.mkfifo(os.path.join(d, name))
        try:
            p, _ = ctx.run(gen(d, "--prompt-ids", "1,2"), timeout=30, label=f"7. {name} FIFO")
        except Failure as e:  # a hang: report it and go on with the other checks
            pb.add(f"7. {name} is a FIFO: {e}")
            continue
        last = (p.stderr.strip().splitlines() or [""])[-1]
        pb.check(p.returncode == 1 and os.path.join(d, name) in last
                 and "not a regular file" in last,
                 f"7. {name} is a FIFO: exit {p.returncode}: {last!r}")

    # 8. Floats that are not positive normal float32 values are refused at load.
    for field, value in (("rms_norm_eps", 1e300), ("rope_theta", 1e300), ("rope_theta", 1e-300)):
        d = copy(f"float_{field}")
        edit_json(os.path.join(d, "config.json"), **{field: value})
        expect_error(ctx, gen(d, "--prompt-ids", "1,2"), f"8. {field} {value}",
                     ["config.json", f"field '{field}'", "float32", str(value)])

    # 9. Checkpoints that do not match the config exactly.
    d = copy("one_layer")
    edit_json(os.path.join(d, "config.json"), num_hidden_layers=1)
    expect_error(ctx, gen(d, "--prompt-ids", "1,2"), "9. config 1 layer, checkpoint 2",
                 ["model.layers.1.", "model.safetensors", "num_hidden_layers 1",
                  "--allow-unused-tensors"])
    p, _ = ctx.run(gen(d, "--prompt-ids", "1,2", "--allow-unused-tensors"),
                   label="9. --allow-unused-tensors")
    pb.check(p.returncode == 0, f"9. --allow-unused-tensors: exit {p.returncode}: "
                                f"{tail(p.stderr, 300)!r}")
    d = ctx.make_model(ctx.path("untied"), "--preset", "tiny", "--untied", "--tokenizer-dir",
                       ctx.tokenizer_dir)
    edit_json(os.path.join(d, "config.json"), tie_word_embeddings=True)
    expect_error(ctx, gen(d, "--prompt-ids", "1,2"), "9. lm_head with tied embeddings",
                 ["lm_head.weight", "tie_word_embeddings true"])
    d = copy("extra")
    st = os.path.join(d, "model.safetensors")
    header, buf = read_st(st)
    h = json.loads(header)
    h["extra.weight"] = {"dtype": "F32", "shape": [1], "data_offsets": [len(buf), len(buf) + 4]}
    text = json.dumps(h)
    write_st(st, text + " " * (-len(text) % 8), buf + b"\0" * 4)
    expect_error(ctx, gen(d, "--prompt-ids", "1,2"), "9. an extra tensor",
                 ["extra.weight", "model.safetensors"])
    d = ctx.make_model(ctx.path("sharded"), "--preset", "tiny", "--shards", "2", "--tokenizer-dir",
                       ctx.tokenizer_dir)
    idx = os.path.join(d, "model.safetensors.index.json")
    with open(idx) as f:
        index = json.load(f)
    name, shard = next(iter(index["weight_map"].items()))
    other = [s for s in set(index["weight_map"].values()) if s != shard][0]
    text = json.dumps(index)
    text = text.replace('"weight_map": {', '"weight_map": {"%s": "%s", ' % (name, other), 1)
    with open(idx, "w") as f:
        f.write(text)
    expect_error(ctx, gen(d, "--prompt-ids", "1,2"), "9. a weight_map listing a tensor twice",
                 [idx, f"duplicate key '{name}'", "/weight_map"])

    # 10. Bytes after the JSON value.
    d = copy("trailing_cfg")
    with open(os.path.join(d, "config.json"), "ab") as f:
        f.write(b"\0garbage")
    expect_error(ctx, gen(d, "--prompt-ids", "1,2"), "10. config.json + NUL + garbage",
                 ["config.json", "NUL byte at offset"])
    d = copy("trailing_st")
    st = os.path.join(d, "model.safetensors")
    header, buf = read_st(st)
    write_st(st, header.rstrip(b" ") + b"\0garbage", buf)
    expect_error(ctx, gen(d, "--prompt-ids", "1,2"), "10. safetensors header + NUL + garbage",
                 [st, "NUL byte at offset"])

    # 11. make-model refuses bad values like every other flag.
    for flags in (["--vocab-size", "-5"], ["--layers", "0"]):
        expect_refused_by_parser(ctx, [ctx.simpler, "make-model", "--out", ctx.path("never"),
                                       *flags], f"11. make-model {' '.join(flags)}",
                                 [flags[0], flags[1], "minimum of 1"])

    # 12. Shape products that overflow 64 bits are refused before use.
    d = copy("overflow")
    edit_json(os.path.join(d, "config.json"), num_attention_heads=2**40,
              num_key_value_heads=2**40, head_dim=2**40)
    p = expect_error(ctx, gen(d, "--prompt-ids", "1,2"), "12. heads = head_dim = 2^40",
                     ["config.json", "overflows"])
    pb.check("expected [" not in p.stderr, f"12. {tail(p.stderr, 300)!r}")

    # 13. A directory given as the prompts file.
    expect_error(ctx, gen(base, "--prompts-file", ctx.work), "13. --prompts-file DIR",
                 [ctx.work, "is a directory"])

    expect_refused_by_parser(ctx, gen(os.path.join(base, "config.json"), "--prompt-ids", "1,2"),
                             "13. --model FILE", ["--model", os.path.join(base, "config.json"),
                                                  "is neither a model directory nor a GGUF file",
                                                  "not GGUF's magic"])
    expect_refused_by_parser(ctx, gen(base, "--prompt-ids", "1,2", "--trace", ctx.work),
                             "13. --trace DIR", ["--trace", ctx.work, "is a directory"])

    # 14. A fault plan entry that never fires is warned about at close.
    env = dict(ctx.env, SIMPLER_SIM_FAULTS="run=0:task=7:kind=kernel_error")
    p, _ = ctx.run(matmul_argv(ctx), env=env, label="14. a fault that never fires")
    pb.check(p.returncode == 0, f"14. exit {p.returncode}")
    pb.check("run=0:task=7:kind=kernel_error:code=1 never fired" in p.stderr,
             f"14. no warning naming the entry: {tail(p.stderr, 400)!r}")

    # Messages to mend.
    for i, line in enumerate(('{"prompt_ids": [1, 2\n', '{"prompt": "\xff"}\n',
                              '{"prompt": "\\ud800"}\n')):
        pf = ctx.path(f"bad_line{i}.jsonl")
        with open(pf, "wb") as f:
            f.write(line.encode("latin-1"))
        expect_error(ctx, gen(base, "--prompts-file", pf), f"messages: prompts-file line {i}",
                     [f"{pf}:1: malformed JSON: parse error at column "])
    d = copy("u64")
    edit_json(os.path.join(d, "config.json"), hidden_size=18446744073709551615)
    expect_error(ctx, gen(d, "--prompt-ids", "1,2"), "messages: hidden_size 2^64-1",
                 ["18446744073709551615 is above the largest integer"])
    env = dict(ctx.env, SIMPLER_SIM_FAULTS="run=0:task=0:kind=device_fault:"
                                           "code=18446744073709551615")
    expect_error(ctx, matmul_argv(ctx), "messages: fault code 2^64-1",
                 ["code=18446744073709551615 is above the largest error code"], env=env)
    for mode, words in (("no_checks", ["has no self-checks"]),
                        ("duplicate", [odd_lib, "two callables named 'twice'"])):
        expect_error(ctx, [ctx.simpler, "run", odd_lib], f"messages: library {mode}", words,
                     env=dict(ctx.env, SIMPLER_TEST_ODD_PROGRAM=mode))
    p = expect_error(ctx, [ctx.simpler, "make-model", "--out", "/proc/simpler/none",
                           "--tokenizer-dir", ctx.tokenizer_dir], "messages: make-model prefix",
                     ["simpler make-model: cannot create /proc/simpler/none"])
    # The copies' hard links left the base's large files as they were (sizes, times).
    pb.check(stamp() == base_stamp, f"the base checkpoint's {LARGE_FILES} changed: "
                                    f"{base_stamp} -> {stamp()}")


def scenario_bench_mailbox(ctx):
    """The --json contract of `simpler bench mailbox` (the L3 hierarchy's keys; numbers are recorded in
    docs/benchmarks.md, not asserted, except the mailbox sizes, which are arithmetic)."""
    pb = ctx.problems
    p, _ = ctx.run_ok([ctx.simpler, "bench", "mailbox", "--json", "--runs", "40"],
                      label="bench mailbox --json")
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    pb.check(len(lines) == 1, f"expected one JSON object, got {len(lines)} lines")
    if len(lines) != 1:
        return
    j = json.loads(lines[0])
    for k in ("bare_rtt_us_p50", "l2_run_us_p50"):
        pb.check(isinstance(j.get(k), (int, float)) and j[k] > 0, f"{k}: {j.get(k)!r}")
    l3 = j.get("l3_run_us_p50", {})
    pb.check(set(l3) == {"process", "thread"}, f"l3_run_us_p50 keys {sorted(l3)}")
    pb.check(all(isinstance(v, (int, float)) and v > 0 for v in l3.values()), f"l3 {l3}")
    marginal = j.get("marginal_us_per_task", {})
    pb.check(set(marginal) == {"1", "16", "256"}, f"marginal_us_per_task keys {sorted(marginal)}")
    sizes = j.get("mailbox_bytes", {})
    pb.check(set(sizes) == {"1", "2", "64", "1024"}, f"mailbox_bytes keys {sorted(sizes)}")
    if set(sizes) == {"1", "2", "64", "1024"}:
        entry = (sizes["64"] - sizes["2"]) / 62
        pb.check(entry == int(entry) and sizes["1024"] - sizes["1"] == 1023 * entry,
                 f"mailbox_bytes does not grow by one entry per grant: {sizes}")
        pb.check(sizes["1024"] <= 600_000, f"mailbox at grant 1024 is {sizes['1024']} bytes")
    pb.check("staged_gap_us_p50" in j, "staged_gap_us_p50 missing")
    p, _ = ctx.run([ctx.simpler, "bench", "mailbox", "--runs", "1"], label="bench mailbox --runs 1")
    pb.check(0 < p.returncode < 128 and "--runs" in p.stderr,
             f"bench mailbox --runs 1: exit {p.returncode}, stderr {tail(p.stderr, 300)!r}")


def check_children_gone(pb, stderr, count, label):
    """The `count` process children a command named on stderr ("children: child 0 (process N),
    ...") are gone (or zombies awaiting their reaper) within 5 s of its exit."""
    m = re.search(r"children: (.*)", stderr)
    pids = [int(x) for x in re.findall(r"process (\d+)", m.group(1))] if m else []
    pb.check(len(pids) == count, f"{label}: child pids not printed: {tail(stderr, 400)!r}")
    deadline = time.monotonic() + 5
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        alive.append(pid)
            except OSError:
                pass
        if alive:
            time.sleep(0.05)
    pb.check(not alive, f"{label}: children {alive} outlived the command")


def scenario_l3_example(ctx):
    """`simpler l3-example`: the tensor-parallel MLP across two sim chips in thread and
    process mode — every run within tolerance of the float64 reference and identical results in
    both modes; with SIMPLER_SIM_FAULTS=...process_kill a child SIGKILLs itself: the command fails
    promptly naming the child and the signal, exits non-zero and leaves no process behind."""
    pb = ctx.problems
    sums = {}
    for mode in ("thread", "process"):
        p, _ = ctx.run_ok([ctx.simpler, "l3-example", "--child-mode", mode, "--runs", "3",
                           "--json"], label=f"l3-example {mode}")
        j = json.loads(p.stdout.strip().splitlines()[-1])
        pb.check(j.get("passed") is True, f"{mode}: not passed: {j}")
        pb.check(len(j.get("runs", [])) == 3, f"{mode}: runs {j.get('runs')}")
        sums[mode] = j.get("y_abs_sum")
    pb.check(sums["thread"] == sums["process"],
             f"thread and process modes differ: y abs-sums {sums}")
    for chips, inter in ((1, 64), (3, 255)):  # any number of children; shards of 64 / 85 columns
        p, _ = ctx.run_ok([ctx.simpler, "l3-example", "--child-mode", "process", "--chips",
                           str(chips), "--intermediate", str(inter), "--runs", "2", "--json"],
                          label=f"l3-example --chips {chips}")
        j = json.loads(p.stdout.strip().splitlines()[-1])
        pb.check(j.get("passed") is True and j.get("chips") == chips,
                 f"--chips {chips}: {j}")
    env = dict(ctx.env, SIMPLER_SIM_FAULTS="run=1:task=0:kind=process_kill")
    t0 = time.monotonic()
    p, _ = ctx.run([ctx.simpler, "l3-example", "--child-mode", "process", "--runs", "3"],
                   label="l3-example process_kill", env=env)
    took = time.monotonic() - t0
    pb.check(0 < p.returncode < 128, f"process_kill: exit {p.returncode}, expected an error exit")
    pb.check("killed by signal 9 (Killed)" in p.stderr and "child " in p.stderr,
             f"process_kill: stderr does not name the child and the signal: {tail(p.stderr, 600)!r}")
    pb.check(took < 30, f"process_kill: took {took:.1f} s")
    check_children_gone(pb, p.stderr, 2, "process_kill")
    # A child that stops answering (SIGSTOP; its own --timeout cannot fire): the parent fails its
    # run at twice the timeout plus 1 s, names the stall and kills it; nothing hangs.
    env = dict(ctx.env, SIMPLER_SIM_FAULTS="run=1:task=0:kind=process_stop")
    t0 = time.monotonic()
    p, _ = ctx.run([ctx.simpler, "l3-example", "--child-mode", "process", "--runs", "3",
                    "--timeout", "1"], label="l3-example process_stop", env=env)
    took = time.monotonic() - t0
    pb.check(0 < p.returncode < 128 and "it is stopped or hung; killed" in p.stderr,
             f"process_stop: exit {p.returncode}, stderr {tail(p.stderr, 600)!r}")
    pb.check(took < 30, f"process_stop: took {took:.1f} s")
    check_children_gone(pb, p.stderr, 2, "process_stop")
    expect_error(ctx, [ctx.simpler, "l3-example", "--intermediate", "255"],
                 "l3-example bad shape", ["--intermediate 255 is not a multiple of --chips 2"])
    # No trace is recorded where the runs execute on the children: the flag is not offered.
    for argv in (["l3-example"], ["bench", "mailbox"]):
        expect_refused_by_parser(ctx, [ctx.simpler] + argv + ["--trace", ctx.path("t.json")],
                                 " ".join(argv) + " --trace", ["--trace", "not expected"])


def scenario_generate_chips(ctx):
    """`simpler generate --chips N`: data parallel over an L3 worker's children —
    distinct requests dealt out across two or three sim chips, each child loading the model
    itself, in process and thread mode — gives every request the tokens (and logits) of the
    single-chip run. With SIMPLER_SIM_FAULTS=...process_kill a child SIGKILLs itself: the command
    fails promptly naming the child and the signal, exits non-zero and leaves no process
    behind."""
    pb = ctx.problems
    model = ctx.write_model(ctx.path("model"), "--vocab", "4096", "--seed", "29",
                            tokenizer=False)
    rng = np.random.default_rng(29)
    prompts = [random_prompt(rng, int(n), 4096) for n in rng.integers(1, 61, size=12)]
    path = ctx.path("prompts.jsonl")
    with open(path, "w") as f:
        for pr in prompts:
            f.write(json.dumps({"prompt_ids": pr}) + "\n")
    common = ["--prompts-file", path, "--max-new-tokens", "8", "--ignore-eos",
              "--dump-logits-steps", "0,7"]
    single, _, _ = ctx.generate(model, common + ["--launch-depth", "2"], "generate --chips 1")
    want = single.get("requests", [])
    pb.check(len(want) == len(prompts), f"--chips 1: {len(want)} requests")
    for i, w in enumerate(want):
        pb.check(len(w.get("tokens", [])) == 8 and sorted(w.get("logits", {})) == ["0", "7"],
                 f"--chips 1 request {i}: {len(w.get('tokens', []))} tokens, logits at "
                 f"{sorted(w.get('logits', {}))}")
    runs = [("2 chips, process, depth 2", ["--chips", "2", "--child-mode", "process",
                                            "--launch-depth", "2"], 2),
            ("2 chips, thread, depth 1", ["--chips", "2", "--child-mode", "thread"], 2),
            ("3 chips, process, host sampling", ["--chips", "3", "--child-mode", "process",
                                                 "--host-sampling"], 3)]
    for label, extra, chips in runs:
        out, err, _ = ctx.generate(model, common + extra, f"generate {label}")
        got = out.get("requests", [])
        if not pb.check(len(got) == len(want), f"{label}: {len(got)} requests"):
            continue
        pb.check(out.get("chips") == chips, f"{label}: chips {out.get('chips')}")
        pb.check("children: child 0 (" in err, f"{label}: children not named: {tail(err, 300)!r}")
        for i, (g, w) in enumerate(zip(got, want)):
            pb.check(g.get("chip") == i % chips, f"{label} request {i}: chip {g.get('chip')}")
            pb.check(g.get("tokens") == w.get("tokens"),
                     f"{label} request {i}: tokens {g.get('tokens')} != single chip "
                     f"{w.get('tokens')}")
            pb.check(g.get("logits") == w.get("logits"),
                     f"{label} request {i}: logits differ from the single-chip run")
    check_prefix_caching_chips(ctx, model, rng)
    p, _ = ctx.run([ctx.simpler, "generate", "--model", model, "--prompts-file", path,
                    "--chips", "2", "--dump-kv-positions", "0"], label="kv dump on 2 chips")
    pb.check(0 < p.returncode < 128 and "lives in a child's device memory" in p.stderr,
             f"--dump-kv-positions --chips 2: exit {p.returncode}, {tail(p.stderr, 300)!r}")
    env = dict(ctx.env, SIMPLER_SIM_FAULTS="run=2:task=0:kind=process_kill")
    t0 = time.monotonic()
    p, _ = ctx.run([ctx.simpler, "generate", "--model", model, "--prompts-file", path,
                    "--max-new-tokens", "8", "--chips", "2", "--child-mode", "process"],
                   label="generate process_kill", env=env)
    took = time.monotonic() - t0
    pb.check(0 < p.returncode < 128, f"process_kill: exit {p.returncode}, expected an error exit")
    pb.check("killed by signal 9 (Killed)" in p.stderr and "child 0 (process" in p.stderr,
             f"process_kill: stderr does not name the child and the signal: "
             f"{tail(p.stderr, 600)!r}")
    pb.check(took < 30, f"process_kill: took {took:.1f} s")
    check_children_gone(pb, p.stderr, 2, "process_kill")


def check_prefix_caching_chips(ctx, model, rng):
    """Prefix caching on 2 chips: each chip has its own cache. Six prompts share a 64-token
    prefix (4 pages of 16) and are dealt out in turn: each chip's first request computes the
    prefix (nothing crosses between chips), the later ones take it from their chip's cache, and
    every request's tokens equal the single-chip run's."""
    pb = ctx.problems
    prefix = random_prompt(rng, 64, 4096)
    prompts = [prefix + random_prompt(rng, n, 4096) for n in (3, 9, 14, 20, 26, 31)]
    path = ctx.path("prefix_prompts.jsonl")
    with open(path, "w") as f:
        for pr in prompts:
            f.write(json.dumps({"prompt_ids": pr}) + "\n")
    common = ["--prompts-file", path, "--max-new-tokens", "6", "--ignore-eos", "--page-size", "16"]
    single, _, _ = ctx.generate(model, common, "generate shared prefixes, 1 chip")
    two, _, _ = ctx.generate(model, common + ["--chips", "2", "--child-mode", "process"],
                             "generate shared prefixes, 2 chips")
    want, got = single.get("requests", []), two.get("requests", [])
    if not pb.check(len(want) == len(got) == len(prompts),
                    f"shared prefixes: {len(want)} and {len(got)} requests"):
        return
    cached = [g.get("cached_tokens") for g in got]
    for i, (g, w) in enumerate(zip(got, want)):
        pb.check(g.get("tokens") == w.get("tokens"),
                 f"shared prefixes, 2 chips, request {i}: tokens {g.get('tokens')} != single chip "
                 f"{w.get('tokens')}")
    pb.check(cached[0] == 0 and cached[1] == 0 and all(c >= 64 for c in cached[2:]),
             f"shared prefixes, 2 chips: cached tokens {cached}; expected 0 for each chip's first "
             f"request and at least the 64-token prefix for the others")


def scenario_gguf(ctx):
    """`--model FILE.gguf`: the tiny preset exported by `simpler export-gguf` gives, through
    generate (text prompts, ids, --chat, a stop string, --chips 2), serve (a chat completion and
    a completion) and bench load, what the model directory gives: the same tokens, text and
    first-step logits; a truncated file is refused naming it, and so is the file given back to
    export-gguf as its source."""
    pb = ctx.problems
    model = ctx.make_model(ctx.path("model"), "--preset", "tiny", "--seed", "16",
                           "--dtype", "bf16")
    gguf = ctx.path("model.gguf")
    ctx.run_ok([ctx.simpler, "export-gguf", "--model", model, "--out", gguf], label="export-gguf")
    # export-gguf reads a checkpoint's own files: a .gguf as its source is refused by the flag
    # parser, naming it (it used to fail later, on "FILE.gguf/tokenizer.json: Not a directory").
    again = ctx.path("again.gguf")
    expect_refused_by_parser(ctx, [ctx.simpler, "export-gguf", "--model", gguf, "--out", again],
                             "export-gguf --model FILE.gguf",
                             ["--model", gguf, "is not a model directory", "a GGUF file already"])
    pb.check(not os.path.exists(again), "export-gguf --model FILE.gguf: wrote its --out file")
    path = ctx.path("prompts.jsonl")
    with open(path, "w") as f:
        for line in ({"prompt": "The quick brown fox"}, {"prompt": "Qwen3 \u8bf4\u4e2d\u6587"},
                     {"prompt_ids": [9707, 11, 1879]}, {"prompt": "<|im_start|>user\nHi"}):
            f.write(json.dumps(line) + "\n")
    runs = [("prompts file", ["--prompts-file", path, "--max-new-tokens", "8", "--ignore-eos",
                              "--dump-logits-steps", "0"]),
            ("chat", ["--prompt", "Hello!", "--chat", "--max-new-tokens", "6"]),
            ("stop string", ["--prompt", "Once upon a time", "--max-new-tokens", "12",
                             "--stop", "e"])]
    wanted = []
    for label, extra in runs:
        want, _, _ = ctx.generate(model, extra, f"generate {label} (directory)")
        wanted.append(want)
        got, _, _ = ctx.generate(gguf, extra, f"generate {label} (GGUF)")
        w, g = want.get("requests", []), got.get("requests", [])
        if not pb.check(len(g) == len(w) and w, f"{label}: {len(g)} requests, {len(w)} wanted"):
            continue
        check_same_requests(pb, label, g, w, ("prompt_ids", "tokens", "text", "finish_reason",
                                              "logits"), "the directory")
    single = wanted[0]
    chips, _, _ = ctx.generate(gguf, runs[0][1] + ["--chips", "2"], "generate --chips 2 (GGUF)")
    pb.check([r.get("tokens") for r in chips.get("requests", [])] ==
             [r.get("tokens") for r in single.get("requests", [])],
             "--chips 2 on the GGUF file: tokens differ from one chip on the directory")
    answers = {}
    for name, m in (("directory", model), ("GGUF", gguf)):
        proc, _, port = start_server(ctx, m, "--served-model-name", "tiny")
        try:
            chat = {"model": "tiny", "max_tokens": 8, "temperature": 0,
                    "messages": [{"role": "user", "content": "Hi"}]}
            comp = {"model": "tiny", "max_tokens": 8, "temperature": 0,
                    "prompt": "The quick brown fox"}
            answers[name] = [http(port, "POST", "/v1/chat/completions", json.dumps(chat))[:2],
                             http(port, "POST", "/v1/completions", json.dumps(comp))[:2]]
        finally:
            stop_server(proc)
    for i, what in enumerate(("chat completion", "completion")):
        a, b = answers["GGUF"][i], answers["directory"][i]
        text = lambda body, k: [c.get(k) for c in json.loads(body).get("choices", [])]
        key = "message" if i == 0 else "text"
        pb.check(a[0] == 200 and b[0] == 200 and text(a[1], key) == text(b[1], key),
                 f"serve {what}: GGUF {a[0]} {a[1][:300]!r} != directory {b[0]} {b[1][:300]!r}")
    p, _ = ctx.run_ok([ctx.simpler, "bench", "load", "--model", gguf, "--json"],
                      label="bench load (GGUF)")
    row = parse_one_json_object(p.stdout, "bench load")
    pb.check(row.get("checkpoint_bytes") == os.path.getsize(gguf),
             f"bench load: checkpoint_bytes {row.get('checkpoint_bytes')} != the file's "
             f"{os.path.getsize(gguf)}")
    cut = ctx.path("cut.gguf")
    with open(gguf, "rb") as f, open(cut, "wb") as out:
        out.write(f.read()[:os.path.getsize(gguf) - 100])
    expect_error(ctx, [ctx.simpler, "generate", "--model", cut, "--prompt-ids", "1"],
                 "truncated GGUF", [cut, "truncated GGUF file", "goes past the end"])
    check_gguf_names_and_chat_template(ctx, gguf)
    check_export_gguf_output_path(ctx, model)


def check_gguf_names_and_chat_template(ctx, gguf):
    """The GGUF file under any name (GGUF's magic decides, not the suffix) gives the same tokens;
    a file whose tokenizer.chat_template differs from Qwen3's by one byte is refused by
    `generate --chat` as serve refuses its chat completions, and still runs without --chat."""
    pb = ctx.problems
    with open(gguf, "rb") as f:
        data = f.read()
    prompt_ids = ["--prompt-ids", "9707,11,1879", "--max-new-tokens", "6", "--ignore-eos"]
    want, _, _ = ctx.generate(gguf, prompt_ids, "generate (model.gguf)")
    for name in ("MODEL.GGUF", "model.bin", "model"):
        path = ctx.path("names", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        got, _, _ = ctx.generate(path, prompt_ids, f"generate (the GGUF file as {name})")
        pb.check([r.get("tokens") for r in got.get("requests", [])] ==
                 [r.get("tokens") for r in want.get("requests", [])],
                 f"the GGUF file as {name}: tokens differ from model.gguf's")
        os.remove(path)
    at = data.find(b"{%- if")
    if not pb.check(at > 0, "the exported GGUF file holds no chat template ('{%- if')"):
        return
    edited = ctx.path("template.gguf")
    with open(edited, "wb") as f:
        f.write(data[:at] + b"{%- iX" + data[at + 6:])
    expect_error(ctx, [ctx.simpler, "generate", "--model", edited, "--prompt", "Hello!", "--chat"],
                 "generate --chat, a chat template one byte off",
                 ["--chat: ", edited, "tokenizer.chat_template differs from the chat template "
                  "simpler renders natively"])
    text = ["--prompt", "The quick brown fox", "--max-new-tokens", "6", "--ignore-eos"]
    want, _, _ = ctx.generate(gguf, text, "generate (model.gguf)")
    got, _, _ = ctx.generate(edited, text, "generate, a chat template one byte off")
    pb.check([r.get("tokens") for r in got.get("requests", [])] ==
             [r.get("tokens") for r in want.get("requests", [])],
             "without --chat, the file with another chat template generates other tokens")


def check_export_gguf_output_path(ctx, model):
    """export-gguf's --out: never one of the model directory's own files (a mistyped --out used to
    replace model.safetensors with the export), checked before the export as a missing folder and
    a directory are; a SIGINT during the export leaves neither the file nor its temporary file."""
    pb = ctx.problems
    weights = os.path.join(model, "model.safetensors")
    with open(weights, "rb") as f:
        before = f.read()
    export = [ctx.simpler, "export-gguf", "--model", model, "--type", "q8_0", "--out"]
    expect_error(ctx, export + [weights], "export-gguf --out MODEL/model.safetensors",
                 [weights, "lies in the model directory", "is not named *.gguf",
                  "never replaces a file of the model directory"])
    with open(weights, "rb") as f:
        pb.check(f.read() == before, "export-gguf --out MODEL/model.safetensors changed the file")
    missing = ctx.path("no-such-dir", "x.gguf")
    expect_error(ctx, export + [missing], "export-gguf --out NODIR/x.gguf",
                 ["cannot write " + missing + ": there is no directory"])
    os.makedirs(ctx.path("dir.gguf"))
    expect_error(ctx, export + [ctx.path("dir.gguf")], "export-gguf --out DIR",
                 ["dir.gguf is a directory, not a file to write"])
    # SIGINT once the first tensor is written (32 layers: ~0.2 s of export left then).
    deep = ctx.make_model(ctx.path("deep"), "--preset", "tiny", "--seed", "5", "--layers", "32")
    out = ctx.path("deep.gguf")
    argv = [ctx.simpler, "export-gguf", "--model", deep, "--type", "q4_k_m", "--out", out]
    log("$ " + " ".join(argv) + "  (SIGINT after its first progress line)")
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=ctx.env)
    watchdog = threading.Timer(CLI_TIMEOUT_S, p.kill)  # a hung export fails, not the suite
    watchdog.start()
    try:
        first = p.stderr.readline()
        p.send_signal(signal.SIGINT)
        _, rest = p.communicate(timeout=CLI_TIMEOUT_S)
    finally:
        watchdog.cancel()
        if p.poll() is None:
            p.kill()
            p.wait()
    log(f"  -> exit {p.returncode}; stderr {first + rest!r}")
    left = [f for f in os.listdir(ctx.work) if f.startswith("deep.gguf.tmp")]
    pb.check(not left, f"export-gguf after SIGINT: left {left}")
    if p.returncode == 0:  # it finished before the signal: the whole file, as without it
        log("  (the export finished before the signal arrived)")
        pb.check(os.path.exists(out), "export-gguf exited 0 without writing its file")
    else:  # the message, then death by the signal (so a shell loop of exports stops too)
        pb.check(p.returncode == -signal.SIGINT and not os.path.exists(out) and
                 re.search(r"cancelled after \d+ of \d+ tensors; nothing was written at ", rest),
                 f"export-gguf after SIGINT: exit {p.returncode}, file left: "
                 f"{os.path.exists(out)}, stderr {rest!r}")



# ggml tensor names -> the checkpoint's (llama.cpp's convert_hf_to_gguf.py mapping for Qwen3).
GGUF_TO_HF = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head", "attn_norm": "input_layernorm",
              "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
              "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
              "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def dequantize_q4_k(raw):
    """ggml's dequantize_row_q4_K on super-blocks of 144 bytes: d, dmin (f16), 12 bytes of 6-bit
    scales and mins (get_scale_min_k4), 128 bytes qs whose low then high nibbles of each 32 bytes
    are two sub-blocks of 32; value (d·sc)·q - dmin·m, in float32 as ggml computes it."""
    blocks = raw.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)
    dmin = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
    sc = blocks[:, 4:16].astype(np.int32)
    qs = blocks[:, 16:144].reshape(-1, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)
    scale = np.empty((len(blocks), 8), dtype=np.int32)
    mins = np.empty((len(blocks), 8), dtype=np.int32)
    for j in range(8):
        if j < 4:
            scale[:, j], mins[:, j] = sc[:, j] & 63, sc[:, j + 4] & 63
        else:
            scale[:, j] = (sc[:, j + 4] & 15) | ((sc[:, j - 4] >> 6) << 4)
            mins[:, j] = (sc[:, j + 4] >> 4) | ((sc[:, j] >> 6) << 4)
    a = (d * scale.astype(np.float32))[:, :, None]
    m = (dmin * mins.astype(np.float32))[:, :, None]
    return (a * q - m).astype(np.float32).reshape(-1)


def dequantize_q6_k(raw):
    """ggml's dequantize_row_q6_K on super-blocks of 210 bytes: ql[128], qh[64], 16 int8
    scales, d (f16); each half of 128 takes 64 bytes of ql and 32 of qh, weight 32c + l
    (c < 4) the low (c < 2) or high nibble of ql[32·(c % 2) + l] with bits 2c of qh[l] above
    it, less 32, times d·scales[8h + 2c + l / 16]."""
    blocks = raw.reshape(-1, 210)
    d = blocks[:, 208:210].copy().view("<f2").astype(np.float32)
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    out = np.empty((len(blocks), 256), dtype=np.float32)
    for h in range(2):
        ql = blocks[:, 64 * h:64 * h + 64].astype(np.int32)
        qh = blocks[:, 128 + 32 * h:160 + 32 * h].astype(np.int32)
        for c in range(4):
            lo = ql[:, 32 * (c % 2):32 * (c % 2) + 32]
            lo = lo & 15 if c < 2 else lo >> 4
            q = (lo | (((qh >> (2 * c)) & 3) << 4)) - 32
            for g in range(2):
                s = (d[:, 0] * sc[:, 8 * h + 2 * c + g])[:, None]
                out[:, 128 * h + 32 * c + 16 * g:128 * h + 32 * c + 16 * g + 16] = \
                    s * q[:, 16 * g:16 * g + 16].astype(np.float32)
    return out.reshape(-1)


def read_gguf_dequantized(path):
    """{checkpoint name: f32 array} of a GGUF file of F32, Q8_0, Q4_0, Q4_K and Q6_K tensors, read
    by this test's own reader (ggml's docs/gguf.md) and dequantized as ggml defines them (blocks of
    32: an f16 scale d, then 32 int8 q, value d·q, or 16 bytes whose low then high nibbles n give
    d·(n - 8); super-blocks of 256: dequantize_q4_k, dequantize_q6_k); also the ggml type of each
    tensor by its GGUF name."""
    with open(path, "rb") as f:
        data = f.read()  # bytes: struct and slices on them are fast (a memmap's are not)
    at = 0

    def take(fmt):
        nonlocal at
        v = struct.unpack_from("<" + fmt, data, at)
        at += struct.calcsize("<" + fmt)
        return v[0]

    def string():
        nonlocal at
        n = take("Q")
        at += n
        return data[at - n:at].decode("utf-8")

    sizes = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q",
             12: "d"}

    def skip_value(t):
        nonlocal at
        if t == 8:
            at += 8 + struct.unpack_from("<Q", data, at)[0]  # skipped without decoding
        elif t == 9:
            et, n = take("I"), take("Q")
            if et in sizes:
                at += n * struct.calcsize("<" + sizes[et])
            elif et == 8:  # the vocabulary and merges: 150k strings and more
                length = struct.Struct("<Q").unpack_from
                for _ in range(n):
                    at += 8 + length(data, at)[0]
            else:
                for _ in range(n):
                    skip_value(et)
        else:
            take(sizes[t])

    assert bytes(data[:4]) == b"GGUF", path
    at = 8
    n_tensors, n_kv = take("Q"), take("Q")
    alignment = 32
    for _ in range(n_kv):
        key, t = string(), take("I")
        if key == "general.alignment":
            alignment = take("I")
        else:
            skip_value(t)
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        infos.append((name, dims[::-1], take("I"), take("Q")))
    start = (at + alignment - 1) // alignment * alignment
    out, types = {}, {}
    for name, shape, ggml_type, offset in infos:
        n = int(np.prod(shape))
        if ggml_type == 0:
            arr = np.frombuffer(data, dtype="<f4", count=n, offset=start + offset)
        elif ggml_type == 8:
            blocks = np.frombuffer(data, dtype=np.uint8, count=n // 32 * 34,
                                   offset=start + offset).reshape(-1, 34)
            d = blocks[:, :2].copy().view("<f2").astype(np.float32)
            q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
            arr = (d * q).reshape(-1)
        elif ggml_type == 2:
            blocks = np.frombuffer(data, dtype=np.uint8, count=n // 32 * 18,
                                   offset=start + offset).reshape(-1, 18)
            d = blocks[:, :2].copy().view("<f2").astype(np.float32)
            qs = blocks[:, 2:]
            q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32) - 8
            arr = (d * q).reshape(-1)
        elif ggml_type in (12, 14):
            size = 144 if ggml_type == 12 else 210
            raw = np.frombuffer(data, dtype=np.uint8, count=n // 256 * size, offset=start + offset)
            arr = dequantize_q4_k(raw) if ggml_type == 12 else dequantize_q6_k(raw)
        else:
            raise Failure(f"{path}: tensor {name} has ggml type {ggml_type}, not F32, Q8_0, "
                          f"Q4_0, Q4_K or Q6_K")
        types[name] = ggml_type
        base, _, _ = name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk":
            hf = f"model.layers.{parts[1]}.{GGUF_TO_HF[parts[2]]}.weight"
        else:
            hf = GGUF_TO_HF[parts[0]] + ".weight"
        out[hf] = np.asarray(arr, dtype=np.float32).reshape(shape)
    return out, types


def expected_gguf_type(qtype, name, head):
    """The ggml type export-gguf writes for GGUF tensor `name` of the scenario's models: 0 for
    the norms; q8_0 every matrix Q8_0; q4_0 Q4_0 but the LM head (Q8_0); q4_k_m (the model of 4
    layers, rows of 256 and 512) Q6_K for the head and for attn_v / ffn_down of layers 2 and 3
    (llama.cpp's use_more_bits for 4 layers), Q4_K for the rest."""
    matrix = name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight",
                            "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
                            "ffn_down.weight", "token_embd.weight", "output.weight"))
    if not matrix:
        return 0
    if qtype == "q4_k_m":
        more_bits = name.startswith(("blk.2.", "blk.3.")) and \
            name.endswith(("attn_v.weight", "ffn_down.weight"))
        return 14 if name == head or more_bits else 12
    return 8 if qtype == "q8_0" or name == head else 2


def scenario_gguf_quantized(ctx):
    """`simpler export-gguf --type q8_0|q4_0|q4_k_m`: q8_0 makes every 2-D tensor Q8_0 (token_embd
    and output, tied or not), q4_0 every one Q4_0 but the LM head (Q8_0), q4_k_m llama.cpp's
    Q4_K / Q6_K mix (on a model whose rows are whole super-blocks), the norms F32; decoding the
    file gives bitwise the tokens and logits of the f32 checkpoint of its dequantized weights
    (the dequantized value is the same f32 on every path, so the numerics contract holds for
    them), and the float64 reference on that checkpoint agrees within the usual tolerance."""
    pb = ctx.problems
    qwen3_ref = ctx.reference()  # the reference's own safetensors reader and writer
    max_new, steps = 24, (0, 1, 23)
    for qtype, tie in (("q8_0", "tied"), ("q8_0", "untied"), ("q4_0", "tied"),
                       ("q4_k_m", "wide")):
        label = f"{qtype} {tie}"
        model = ctx.path(f"model_{tie}")
        if tie == "wide" and not os.path.exists(model):  # rows of 256 and 512, tied
            ctx.write_model(model, "--seed", "33", "--dtype", "bf16", "--layers", "4",
                            "--hidden", "256", "--intermediate", "512")
        if not os.path.exists(model):
            ctx.write_model(model, "--seed", "31", "--dtype", "bf16", "--layers", "2",
                            *(("--untied",) if tie == "untied" else ()))
        gguf = ctx.path(f"model_{qtype}_{tie}.gguf")
        ctx.run_ok([ctx.simpler, "export-gguf", "--model", model, "--out", gguf, "--type",
                    qtype], label=f"export-gguf ({label})")
        weights, types = read_gguf_dequantized(gguf)
        head = "output.weight" if tie == "untied" else "token_embd.weight"
        for name, t in types.items():
            want = expected_gguf_type(qtype, name, head)
            pb.check(t == want, f"{label}: {name} has ggml type {t}, expected {want}")
        pb.check(("output.weight" in types) == (tie == "untied"),
                 f"{label}: output.weight {'present' if 'output.weight' in types else 'absent'}")
        # The checkpoint's other files, the tokenizer hard-linked; the weights written anew.
        deq = ctx.path(f"dequantized_{qtype}_{tie}")
        shutil.copytree(model, deq, copy_function=link_large,
                        ignore=shutil.ignore_patterns("model.safetensors"))
        qwen3_ref.write_safetensors(os.path.join(deq, "model.safetensors"),
                                    [(n, "F32", a) for n, a in sorted(weights.items())])
        with open(os.path.join(deq, "config.json")) as f:
            cfg = json.load(f)
        cfg["torch_dtype"] = "float32"
        with open(os.path.join(deq, "config.json"), "w") as f:
            json.dump(cfg, f)
        rng = np.random.default_rng(7)
        prompts = [random_prompt(rng, n, cfg["vocab_size"]) for n in (1, 9, 40)]
        pfile = ctx.path(f"prompts_{qtype}_{tie}.jsonl")
        with open(pfile, "w") as f:
            for p in prompts:
                f.write(json.dumps({"prompt_ids": p}) + "\n")
        # Precision exact: f32 activations, so the quantized file decodes to the bits of the f32
        # checkpoint of its dequantized weights (the default, int8, quantizes the activations).
        args = ["--prompts-file", pfile, "--max-new-tokens", str(max_new), "--ignore-eos",
                "--dump-logits-steps", csv(steps), "--precision", "exact"]
        got, _, _ = ctx.generate(gguf, args, f"generate {qtype} GGUF ({label})")
        want, _, _ = ctx.generate(deq, args, f"generate dequantized f32 ({label})")
        g, w = got.get("requests", []), want.get("requests", [])
        if not pb.check(len(g) == len(w) == len(prompts), f"{label}: {len(g)} requests"):
            continue
        check_same_requests(pb, f"{label}: the {qtype} file's", g, w, ("tokens", "logits"),
                            "the dequantized f32 checkpoint")
        ref, _ = ctx.reference_generate(deq, prompts, max_new, steps, [])
        diag = TokenDiagnosis(ctx, deq)
        for i, r in enumerate(g):
            compare_request(pb, f"{label} request {i}", r, ref["requests"][i],
                            max_new=max_new, logits_steps=steps, kv_positions=[], diag=diag)
    # The type mix: bench load and /v1/models count the last file's tensors by type.
    mix = {}
    for t in types.values():
        name = {0: "f32", 2: "q4_0", 8: "q8_0", 12: "q4_k", 14: "q6_k"}[t]
        mix[name] = mix.get(name, 0) + 1
    p, _ = ctx.run_ok([ctx.simpler, "bench", "load", "--model", gguf, "--json"],
                      label="bench load (q4_k_m)")
    row = parse_one_json_object(p.stdout, "bench load")
    pb.check(row.get("weight_types") == mix,
             f"bench load: weight_types {row.get('weight_types')} != the file's {mix}")
    proc, _, port = start_server(ctx, gguf, "--served-model-name", "q8")
    try:
        status, body = http(port, "GET", "/v1/models")[:2]
    finally:
        stop_server(proc)
    got_mix = None
    if status == 200:
        got_mix = (json.loads(body).get("data") or [{}])[0].get("weight_types")
    pb.check(got_mix == mix, f"/v1/models: weight_types {got_mix} != the file's {mix} ({status})")


SCENARIOS = {
    "writer_headdim_kv1": scenario_writer_headdim_kv1,
    "writer_untied_f32": scenario_writer_untied_f32,
    "writer_launch_depth2": scenario_writer_launch_depth2,
    "writer_host_built": scenario_writer_host_built,
    "make_model_tiny": scenario_make_model_tiny,
    "long_prompt": scenario_long_prompt,
    "continuous_batching": scenario_continuous_batching,
    "serve": scenario_serve,
    "cli_errors": scenario_cli_errors,
    "run_matmul": scenario_run_matmul,
    "run_matmul_fault": scenario_run_matmul_fault,
    "bench_pipeline": scenario_bench_pipeline,
    "bench_mailbox": scenario_bench_mailbox,
    "l3_example": scenario_l3_example,
    "generate_chips": scenario_generate_chips,
    "trace": scenario_trace,
    "bench_decode": scenario_bench_decode,
    "bench_prefill_load": scenario_bench_prefill_load,
    "run_defects": scenario_run_defects,
    "generate_faults": scenario_generate_faults,
    "bad_input": scenario_bad_input,
    "cli_input": scenario_cli_input,
    "gguf": scenario_gguf,
    "gguf_quantized": scenario_gguf_quantized,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--list", action="store_true", help="print the scenario names")
    ap.add_argument("--simpler", help="path of the simpler CLI")
    ap.add_argument("--reference", help="path of tests/reference/qwen3_ref.py")
    ap.add_argument("--matmul-lib", help="path of libsimpler_example_matmul.so")
    ap.add_argument("--spin-lib", help="path of libsimpler_test_spin.so (a kernel that never "
                                       "returns)")
    ap.add_argument("--tokenizer-dir", help="directory with Qwen3's tokenizer.json")
    ap.add_argument("--work", help="scratch directory (wiped at start)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory on success")
    args = ap.parse_args()
    if args.list:
        print("\n".join(sorted(SCENARIOS)))
        return 0
    if not (args.scenario and args.simpler and args.reference and args.work):
        ap.error("--scenario, --simpler, --reference and --work are required")
    ctx = Ctx(args)
    shutil.rmtree(ctx.work, ignore_errors=True)
    os.makedirs(ctx.work)
    t0 = time.monotonic()
    try:
        SCENARIOS[args.scenario](ctx)
    except Failure as e:
        ctx.problems.add(str(e))
    elapsed = time.monotonic() - t0
    if ctx.problems.items:
        print(f"\n{args.scenario}: FAILED after {elapsed:.1f} s with "
              f"{len(ctx.problems.items)} problem(s) (scratch kept in {ctx.work}):",
              file=sys.stderr)
        for i, msg in enumerate(ctx.problems.items[:40]):
            print(f"  {i + 1}. {msg}", file=sys.stderr)
        if len(ctx.problems.items) > 40:
            print(f"  ... and {len(ctx.problems.items) - 40} more", file=sys.stderr)
        return 1
    log(f"{args.scenario}: passed in {elapsed:.1f} s")
    if not args.keep:
        shutil.rmtree(ctx.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
