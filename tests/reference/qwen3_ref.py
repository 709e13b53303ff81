#!/usr/bin/python3
"""Qwen3 reference in plain numpy (float64), independent of the C++ code.

Subcommands:
  write-model  write a random Qwen3 checkpoint (config.json, generation_config.json,
               model.safetensors or shards + model.safetensors.index.json) with this file's
               own safetensors writer
  generate     greedy-decode prompts with a model directory, token by token (the math of a
               decode path), writing tokens and optionally logits and K/V to JSON
  inspect      load a model directory and write its parsed config and per-tensor statistics
               (dtype, shape, float64 sum, sum of squares, first values) to JSON
  sample       vLLM's sampler math for given logits, history and parameters (penalties,
               temperature, min_p, top-k, top-p, raw logprobs), in float64, as JSON

Math (Hugging Face Qwen3ForCausalLM):
  weights are stored [out, in] and y = W x;
  RMSNorm(x) = x / sqrt(mean(x^2) + eps) * w;
  attention: q = Wq h, k = Wk h, v = Wv h split into heads; per-head RMSNorm of q and k
  (weights [head_dim]) before RoPE; RoPE rotate-half (first half / second half) with
  inv_freq_i = theta^(-2i/head_dim), angle = pos * inv_freq, cos/sin duplicated over both halves,
  q' = q cos + rotate_half(q) sin, rotate_half([a, b]) = [-b, a]; GQA: query head h reads KV head
  h // (heads / kv_heads); scores scaled by 1/sqrt(head_dim); causal over positions <= current;
  MLP down(silu(gate h) * up h); pre-norm residual blocks; final norm; lm_head (tied: the
  embedding matrix).

Run with Debian's /usr/bin/python3 (numpy is the only dependency).
"""

import argparse
import json
import math
import os
import shutil
import struct
import sys

# One BLAS thread: the tests run two at a time on machines shared with other builds, where
# OpenBLAS's second thread, spinning while it waits for work, doubled the CPU time of a generate
# run and left its wall time no shorter; one thread also fixes the order of every float64 sum.
# Set before numpy loads OpenBLAS; a value already in the environment wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402  (after the BLAS thread count)

# ---------------------------------------------------------------------------------------------
# safetensors

_NP_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # raw bits
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "U8": np.dtype("u1"),
}


def read_safetensors(path):
    """Returns ({name: (dtype, shape, raw array)}, metadata). Arrays view a read-only memmap."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: truncated: shorter than 8 bytes")
        (n,) = struct.unpack("<Q", prefix)
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} beyond the end of the file")
        header = json.loads(f.read(n).decode("utf-8"))
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size > 8 + n else None
    metadata = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, info in header.items():
        dtype = info["dtype"]
        if dtype not in _NP_DTYPES:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dtype}")
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        np_dtype = _NP_DTYPES[dtype]
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end - begin != count * np_dtype.itemsize:
            raise ValueError(f"{path}: tensor {name}: data_offsets do not match shape and dtype")
        if 8 + n + end > size:
            raise ValueError(f"{path}: tensor {name}: data beyond the end of the file")
        if count == 0:
            raw = np.zeros(shape, dtype=np_dtype)
        else:
            raw = np.frombuffer(mm, dtype=np_dtype, count=count, offset=8 + n + begin)
            raw = raw.reshape(shape)
        tensors[name] = (dtype, shape, raw)
    return tensors, metadata


def to_f64(dtype, raw):
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype in ("F32", "F16"):
        return raw.astype(np.float64)
    raise ValueError(f"cannot convert {dtype} to float")


def from_f64(dtype, values):
    """Encodes float values as `dtype` (round to nearest even for BF16 and F16)."""
    if dtype == "F32":
        return values.astype("<f4")
    if dtype == "F16":
        return values.astype("<f2")
    if dtype == "BF16":
        bits = values.astype(np.float32).view(np.uint32)
        rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
        return ((bits + rounding) >> 16).astype("<u2")
    raise ValueError(f"cannot encode floats as {dtype}")


def write_safetensors(path, tensors, metadata=None):
    """tensors: list of (name, dtype string, encoded numpy array). Written in the order given."""
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, arr in tensors:
        nbytes = arr.size * _NP_DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, dtype, arr in tensors:
            # The array's own buffer (no copy where it is already contiguous of that type).
            f.write(np.ascontiguousarray(arr, dtype=_NP_DTYPES[dtype]).data)
    os.replace(tmp, path)


def read_weights(model_dir):
    """{name: (dtype, shape, raw, file name)} from model.safetensors or a sharded index."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    out = {}
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        shards = {}
        for name, shard in weight_map.items():
            if shard not in shards:
                shards[shard], _ = read_safetensors(os.path.join(model_dir, shard))
            if name not in shards[shard]:
                raise ValueError(f"{index_path}: {name} mapped to {shard}, which lacks it")
            out[name] = shards[shard][name] + (shard,)
        return out
    single = os.path.join(model_dir, "model.safetensors")
    tensors, _ = read_safetensors(single)
    return {name: t + ("model.safetensors",) for name, t in tensors.items()}


# ---------------------------------------------------------------------------------------------
# Config

def _ids(value):
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def load_config(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    if "Qwen3ForCausalLM" not in archs and raw.get("model_type") != "qwen3":
        raise ValueError(f"config.json: unknown architecture {archs}")
    c = {
        "hidden_size": int(raw["hidden_size"]),
        "intermediate_size": int(raw["intermediate_size"]),
        "num_hidden_layers": int(raw["num_hidden_layers"]),
        "num_attention_heads": int(raw["num_attention_heads"]),
        "num_key_value_heads": int(raw["num_key_value_heads"]),
        "vocab_size": int(raw["vocab_size"]),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(raw.get("rope_theta", 10000.0)),
        "max_position_embeddings": int(raw.get("max_position_embeddings", 32768)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
    }
    head_dim = raw.get("head_dim")
    c["head_dim"] = int(head_dim) if head_dim is not None else (
        c["hidden_size"] // c["num_attention_heads"])
    if c["num_attention_heads"] % c["num_key_value_heads"] != 0:
        raise ValueError("config.json: num_key_value_heads does not divide num_attention_heads")
    stop = _ids(raw.get("eos_token_id"))
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            stop += _ids(json.load(f).get("eos_token_id"))
    c["stop_ids"] = list(dict.fromkeys(stop))
    c["bos_token_id"] = raw.get("bos_token_id")
    return c


def expected_weights(c):
    """[(name, shape)] in checkpoint order."""
    H, I, V, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    out = [("model.embed_tokens.weight", (V, H))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (H,)),
            (p + "self_attn.q_proj.weight", (nh * hd, H)),
            (p + "self_attn.k_proj.weight", (nkv * hd, H)),
            (p + "self_attn.v_proj.weight", (nkv * hd, H)),
            (p + "self_attn.o_proj.weight", (H, nh * hd)),
            (p + "self_attn.q_norm.weight", (hd,)),
            (p + "self_attn.k_norm.weight", (hd,)),
            (p + "post_attention_layernorm.weight", (H,)),
            (p + "mlp.gate_proj.weight", (I, H)),
            (p + "mlp.up_proj.weight", (I, H)),
            (p + "mlp.down_proj.weight", (H, I)),
        ]
    out.append(("model.norm.weight", (H,)))
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", (V, H)))
    return out


# ---------------------------------------------------------------------------------------------
# write-model

QWEN3_ENDOFTEXT = 151643
QWEN3_IM_END = 151645


def cmd_write_model(args):
    H, nh, nkv = args.hidden, args.heads, args.kv_heads
    hd = args.head_dim if args.head_dim else H // nh
    V = args.vocab
    if V > QWEN3_IM_END:
        bos, eos, gen_eos = QWEN3_ENDOFTEXT, QWEN3_IM_END, [QWEN3_IM_END, QWEN3_ENDOFTEXT]
    else:
        bos, eos, gen_eos = V - 2, V - 1, [V - 1, V - 2]
    torch_dtype = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}[args.dtype]
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "head_dim": hd,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": args.intermediate,
        "max_position_embeddings": args.max_position,
        "max_window_layers": args.layers,
        "model_type": "qwen3",
        "num_attention_heads": nh,
        "num_hidden_layers": args.layers,
        "num_key_value_heads": nkv,
        "rms_norm_eps": args.eps,
        "rope_scaling": None,
        "rope_theta": args.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": not args.untied,
        "torch_dtype": torch_dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": V,
    }
    if args.omit_head_dim:
        del config["head_dim"]
    os.makedirs(args.out, exist_ok=True)
    for name in os.listdir(args.out):
        if name in ("model.safetensors", "model.safetensors.index.json") or (
                name.startswith("model-") and name.endswith(".safetensors")):
            os.remove(os.path.join(args.out, name))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": gen_eos, "pad_token_id": bos}, f,
                  indent=2)

    c = load_config(args.out)
    rng = np.random.default_rng(args.seed)
    st_dtype = {"f32": "F32", "bf16": "BF16", "f16": "F16"}[args.dtype]
    tensors = []
    for name, shape in expected_weights(c):
        if name.endswith("norm.weight"):
            values = 1.0 + 0.1 * rng.standard_normal(shape)
        else:  # linear [out, in], embedding and lm_head [vocab, hidden]
            values = rng.standard_normal(shape) / math.sqrt(shape[1])
        dtype = st_dtype
        if name == "lm_head.weight" and args.lm_head_dtype:
            dtype = {"f32": "F32", "bf16": "BF16", "f16": "F16"}[args.lm_head_dtype]
        tensors.append((name, dtype, from_f64(dtype, values)))

    metadata = {"format": "pt"}
    if args.shards <= 1:
        write_safetensors(os.path.join(args.out, "model.safetensors"), tensors, metadata)
    else:
        n = args.shards
        if n > len(tensors):
            raise SystemExit(f"--shards {n} exceeds the number of tensors {len(tensors)}")
        # Round-robin over contiguous runs: shard i gets tensors [i*T/n, (i+1)*T/n).
        weight_map, total = {}, 0
        for i in range(n):
            part = tensors[i * len(tensors) // n:(i + 1) * len(tensors) // n]
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            write_safetensors(os.path.join(args.out, fname), part, metadata)
            for name, dtype, arr in part:
                weight_map[name] = fname
                total += arr.nbytes
        with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if args.tokenizer_dir:
        for fname in ("tokenizer.json", "tokenizer_config.json"):
            src = os.path.join(args.tokenizer_dir, fname)
            if not os.path.exists(src):
                raise SystemExit(f"tokenizer file {src} not found")
            shutil.copyfile(src, os.path.join(args.out, fname))
    return 0


# ---------------------------------------------------------------------------------------------
# Forward

class Qwen3:
    """A model directory loaded as float64 arrays."""

    def __init__(self, model_dir):
        self.c = load_config(model_dir)
        c = self.c
        raw = read_weights(model_dir)
        self.w = {}
        for name, shape in expected_weights(c):
            if name not in raw:
                raise ValueError(f"{model_dir}: missing tensor {name}")
            dtype, got_shape, arr, fname = raw[name]
            if tuple(got_shape) != tuple(shape):
                raise ValueError(f"{name} in {fname}: shape {list(got_shape)}, "
                                 f"expected {list(shape)}")
            self.w[name] = to_f64(dtype, arr)
        self.lm_head = self.w["model.embed_tokens.weight"] if c["tie_word_embeddings"] \
            else self.w["lm_head.weight"]
        hd = c["head_dim"]
        self.inv_freq = c["rope_theta"] ** (-(np.arange(0, hd // 2, dtype=np.float64) * 2.0) / hd)

    def rms_norm(self, x, w):
        # x [..., n], normalized over the last axis.
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.c["rms_norm_eps"]) * w

    def rope(self, x, pos):
        # x [heads, head_dim] at position `pos`, or [n, heads, head_dim] with one position per row
        angle = np.multiply.outer(np.asarray(pos, dtype=np.float64), self.inv_freq)
        cos = np.concatenate([np.cos(angle), np.cos(angle)], axis=-1)
        sin = np.concatenate([np.sin(angle), np.sin(angle)], axis=-1)
        if np.ndim(pos) > 0:
            cos, sin = cos[:, None, :], sin[:, None, :]
        half = x.shape[-1] // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin

    def new_cache(self, length):
        c = self.c
        shape = (c["num_hidden_layers"], length, c["num_key_value_heads"], c["head_dim"])
        return {"k": np.zeros(shape), "v": np.zeros(shape)}

    def step(self, token, pos, cache):
        """Runs one token at `pos`, appending its K/V to `cache`; returns the logits [V]."""
        return self.step_rows([token], [pos], [cache], [True])[0]

    def step_rows(self, tokens, positions, caches, want_logits):
        """Runs one token of each of n requests at once (row r: token tokens[r] at
        positions[r], its K/V appended to caches[r]; the projections as one [n, in] x [in, out]
        product, each row's attention over its own cache); returns the logits [m, V] of the m
        rows where want_logits[r], in row order (the others' LM head is not computed)."""
        c, w = self.c, self.w
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        group = nh // nkv
        n = len(tokens)
        x = w["model.embed_tokens.weight"][np.asarray(tokens, dtype=np.int64)]  # a copy, [n, H]
        pos = np.asarray(positions, dtype=np.int64)
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = self.rms_norm(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(n, nh, hd)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(n, nkv, hd)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(n, nkv, hd)
            q = self.rope(self.rms_norm(q, w[p + "self_attn.q_norm.weight"]), pos)
            k = self.rope(self.rms_norm(k, w[p + "self_attn.k_norm.weight"]), pos)
            attn = np.empty((n, nh * hd))
            for r, cache in enumerate(caches):
                at = int(pos[r])
                cache["k"][i, at] = k[r]
                cache["v"][i, at] = v[r]
                keys = cache["k"][i, :at + 1]    # [T, nkv, hd]
                values = cache["v"][i, :at + 1]  # [T, nkv, hd]
                qg = q[r].reshape(nkv, group, hd)
                scores = np.matmul(qg, keys.transpose(1, 2, 0)) / math.sqrt(hd)  # [nkv, group, T]
                scores -= scores.max(axis=-1, keepdims=True)
                probs = np.exp(scores)
                probs /= probs.sum(axis=-1, keepdims=True)
                attn[r] = np.matmul(probs, values.transpose(1, 0, 2)).reshape(nh * hd)
            x = x + attn @ w[p + "self_attn.o_proj.weight"].T
            h = self.rms_norm(x, w[p + "post_attention_layernorm.weight"])
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            up = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        rows = [r for r in range(n) if want_logits[r]]
        x = self.rms_norm(x[rows], w["model.norm.weight"])
        return x @ self.lm_head.T

    def generate(self, prompt, max_new_tokens, stop_ids, logits_steps=(), kv_positions=()):
        """Greedy decode of one prompt (generate_all of it alone)."""
        return self.generate_all([prompt], max_new_tokens, stop_ids, logits_steps,
                                 kv_positions)[0]

    def generate_all(self, prompts, max_new_tokens, stop_ids, logits_steps=(), kv_positions=()):
        """Greedy decode of each prompt on its own, the requests run side by side: each step
        runs the next token of every unfinished request (step_rows), so the LM head, the largest
        matrix, is read once a step for all of them. Request r's step s picks its generated
        token s from the logits after its token at position len(prompt) - 1 + s; the logits of
        the prompt's earlier positions are not computed (nothing reads them). The last generated
        token is not run through the model, so K/V exist for positions
        [0, len(prompt) + len(tokens) - 1). Returns one result per prompt, in order."""
        if any(not p for p in prompts):
            raise ValueError("empty prompt")
        reqs = [{"prompt": list(p), "cache": self.new_cache(len(p) + max_new_tokens),
                 "tokens": [], "logits": {}, "finish": "length", "pos": 0} for p in prompts]
        # Live: a request with prompt tokens left to run, or still decoding.
        live = list(reqs)
        while live:
            # Each live request's next token: a prompt token, or its last generated one.
            toks = [r["prompt"][r["pos"]] if r["pos"] < len(r["prompt"]) else r["tokens"][-1]
                    for r in live]
            want = [r["pos"] >= len(r["prompt"]) - 1 and max_new_tokens > 0 for r in live]
            logits = self.step_rows(toks, [r["pos"] for r in live], [r["cache"] for r in live],
                                    want)
            row = 0
            for r, wanted in zip(live, want):
                r["pos"] += 1
                if not wanted:
                    continue
                lg, row = logits[row], row + 1
                s = len(r["tokens"])
                if s in logits_steps:
                    r["logits"][str(s)] = lg.tolist()
                nxt = int(np.argmax(lg))
                r["tokens"].append(nxt)
                if nxt in stop_ids:
                    r["finish"] = "stop"
            live = [r for r in live if r["pos"] < len(r["prompt"]) or
                    (r["finish"] == "length" and len(r["tokens"]) < max_new_tokens)]
        out = []
        for r in reqs:
            prompt, tokens, cache = r["prompt"], r["tokens"], r["cache"]
            processed = len(prompt) + max(len(tokens) - 1, 0)
            kv = {}
            for p in kv_positions:
                if 0 <= p < processed:
                    kv[str(p)] = {"k": cache["k"][:, p].tolist(), "v": cache["v"][:, p].tolist()}
            out.append({"prompt_ids": prompt, "tokens": tokens, "finish_reason": r["finish"],
                        "logits": r["logits"], "kv": kv})
        return out


def write_json(path, value):
    """Writes `value` as JSON to `path`. json.dumps encodes in C; json.dump to a file takes
    Python's pure-Python encoder, which took half of a generate run with logits of a vocabulary
    of 151936 (the same bytes either way)."""
    with open(path, "w") as f:
        f.write(json.dumps(value))


def _int_list(text):
    text = text.strip()
    return [int(t) for t in text.split(",") if t.strip()] if text else []


def cmd_generate(args):
    model = Qwen3(args.model)
    stop_ids = [] if args.ignore_eos else model.c["stop_ids"]
    logits_steps = set(_int_list(args.dump_logits_steps or ""))
    kv_positions = _int_list(args.dump_kv_positions or "")
    requests = model.generate_all([_int_list(p) for p in args.prompt_ids], args.max_new_tokens,
                                  stop_ids, logits_steps, kv_positions)
    result = {
        "model": os.path.abspath(args.model),
        "config": {k: v for k, v in model.c.items()},
        "stop_ids": stop_ids,
        "requests": requests,
    }
    write_json(args.out, result)
    return 0


def cmd_inspect(args):
    c = load_config(args.model)
    raw = read_weights(args.model)
    tensors = {}
    for name, (dtype, shape, arr, fname) in raw.items():
        entry = {"dtype": dtype, "shape": list(shape), "file": fname}
        if dtype in ("F32", "F16", "BF16"):
            v = to_f64(dtype, arr).reshape(-1)
            entry.update(sum=float(v.sum()), sum_sq=float((v * v).sum()),
                         first=v[:4].tolist())
        tensors[name] = entry
    missing = [n for n, _ in expected_weights(c) if n not in raw]
    write_json(args.out, {"config": c, "expected": [[n, list(s)] for n, s in expected_weights(c)],
                          "missing": missing, "tensors": tensors})
    return 0


# ---------------------------------------------------------------------------------------------
# sampling (vLLM v1 sampler semantics; see include/simpler/kernels/sampling.h)


def sample_case(case):
    """One row: {"logits": [V], "prompt_ids": [...], "output_ids": [...], "params": {...}}.

    Returns the raw log_softmax top-k, the penalized logits, the greedy id and the final
    sampling distribution (None when greedy), all computed in float64 on float32 inputs."""
    logits = np.asarray(case["logits"], dtype=np.float32).astype(np.float64)
    p = case["params"]
    v = logits.shape[0]
    out_count = np.zeros(v, dtype=np.int64)
    for t in case.get("output_ids", []):
        out_count[t] += 1
    seen = out_count > 0
    for t in case.get("prompt_ids", []):
        seen[t] = True
    raw_lp = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
    n_top = int(p.get("logprobs", 0))
    top = sorted(range(v), key=lambda t: (-raw_lp[t], t))[:n_top]

    pen = logits.copy()
    if len(case.get("output_ids", [])) < int(p.get("min_tokens", 0)):
        for t in p.get("stop_ids", []):
            pen[t] = -np.inf
    r = float(p.get("repetition_penalty", 1.0))
    pen = np.where(seen, np.where(pen > 0, pen / r, pen * r), pen)
    pen = pen - float(p.get("frequency_penalty", 0.0)) * out_count
    pen = pen - float(p.get("presence_penalty", 0.0)) * (out_count > 0)
    greedy = int(np.argmax(pen))

    # JSON has no infinities: a masked (-inf) logit is written as null.
    result = {"penalized": [None if math.isinf(x) else x for x in pen.tolist()], "greedy": greedy, "raw_logprobs": raw_lp.tolist(),
              "top_ids": top, "top_logprobs": [float(raw_lp[t]) for t in top], "probs": None}
    temperature = float(p.get("temperature", 1.0))
    if temperature < 1e-5:
        return result
    x = pen / temperature
    prob = np.exp(x - x.max())
    prob /= prob.sum()
    min_p = float(p.get("min_p", 0.0))
    if min_p > 0:
        x = np.where(prob < min_p * prob.max(), -np.inf, x)
    k = int(p.get("top_k", 0))
    if 0 < k < v:
        kth = np.sort(x)[::-1][k - 1]
        x = np.where(x < kth, -np.inf, x)
    top_p = float(p.get("top_p", 1.0))
    if top_p < 1.0:
        # Ascending order, ties: higher index first; drop while the inclusive cumsum <= 1 - p.
        order = sorted(range(v), key=lambda t: (x[t], -t))
        prob = np.exp(x - x.max())
        prob /= prob.sum()
        cum = np.cumsum(prob[order])
        drop = cum <= 1.0 - top_p
        drop[-1] = False
        for j, t in enumerate(order):
            if drop[j]:
                x[t] = -np.inf
    prob = np.exp(x - x.max())
    prob /= prob.sum()
    result["probs"] = prob.tolist()
    return result


def cmd_sample(args):
    with open(args.cases) as f:
        cases = json.load(f)["cases"]
    write_json(args.out, {"results": [sample_case(c) for c in cases]})
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("write-model", help="write a random Qwen3 checkpoint")
    w.add_argument("--out", required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="bf16")
    w.add_argument("--shards", type=int, default=1)
    w.add_argument("--hidden", type=int, default=128)
    w.add_argument("--heads", type=int, default=4)
    w.add_argument("--kv-heads", type=int, default=2)
    w.add_argument("--head-dim", type=int, default=64)
    w.add_argument("--omit-head-dim", action="store_true",
                   help="leave head_dim out of config.json (readers default to hidden/heads)")
    w.add_argument("--layers", type=int, default=2)
    w.add_argument("--intermediate", type=int, default=384)
    w.add_argument("--vocab", type=int, default=151936)
    w.add_argument("--max-position", type=int, default=4096)
    w.add_argument("--rope-theta", type=float, default=1e6)
    w.add_argument("--eps", type=float, default=1e-6)
    w.add_argument("--untied", action="store_true", help="separate lm_head.weight")
    w.add_argument("--lm-head-dtype", choices=["f32", "bf16", "f16"],
                   help="dtype of lm_head.weight (with --untied)")
    w.add_argument("--tokenizer-dir", help="copy tokenizer.json and tokenizer_config.json")
    w.set_defaults(fn=cmd_write_model)

    g = sub.add_parser("generate", help="greedy-decode with a model directory")
    g.add_argument("--model", required=True)
    g.add_argument("--prompt-ids", action="append", required=True,
                   help="comma-separated token ids; repeat for several requests")
    g.add_argument("--max-new-tokens", type=int, required=True)
    g.add_argument("--dump-logits-steps", help="comma-separated decode steps (0 = first token)")
    g.add_argument("--dump-kv-positions", help="comma-separated positions")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at stop ids")
    g.add_argument("--out", required=True)
    g.set_defaults(fn=cmd_generate)

    i = sub.add_parser("inspect", help="config and per-tensor statistics as JSON")
    i.add_argument("--model", required=True)
    i.add_argument("--out", required=True)
    i.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("sample", help="vLLM sampler math (float64) for JSON cases")
    s.add_argument("--cases", required=True, help='{"cases": [{"logits", "prompt_ids", '
                   '"output_ids", "params"}]}')
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_sample)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
