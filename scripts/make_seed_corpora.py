#!/usr/bin/env python3
"""Writes the seed corpora of the model, tokenizer, CLI and device fuzz targets
(src/<room>/fuzz/<target>/corpus/; docs/fuzzing.md).

Run from anywhere: python3 scripts/make_seed_corpora.py. Deterministic; the output is
committed. Inputs are small valid (and a few near-valid) files in each format.
"""
import json
import os
import struct

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
MODEL = os.path.join(SRC, "model", "fuzz")
TOKENIZER = os.path.join(SRC, "tokenizer", "fuzz")
CLI = os.path.join(SRC, "cli", "fuzz")
DEVICE = os.path.join(SRC, "device", "fuzz")
# The room of each target's data.
ROOT = {
    "safetensors_fuzz": MODEL,
    "model_weights_index_fuzz": MODEL,
    "model_config_fuzz": MODEL,
    "gguf_fuzz": MODEL,
    "tokenizer_load_fuzz": TOKENIZER,
    "tokenizer_encode_fuzz": TOKENIZER,
    "prompts_file_fuzz": CLI,
    "fault_plan_fuzz": DEVICE,
}


def write(target, name, data):
    root = ROOT[target]
    d = os.path.join(root, target, "corpus")
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def write_all(target, inputs):
    """Writes each named input of `inputs` (a dict name -> str or bytes) to `target`'s corpus."""
    for name, data in inputs.items():
        write(target, name, data)


# --- safetensors ---------------------------------------------------------------------------
SIZES = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4, "I64": 8, "U8": 1}


def safetensors(tensors, metadata=None, pad=True, extra=b""):
    header, buf = {}, b""
    for name, dtype, shape in tensors:
        n = 1
        for d in shape:
            n *= d
        size = n * SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(buf), len(buf) + size]}
        buf += bytes((i * 7 + 3) % 256 for i in range(size))
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + buf + extra


def qwen3_tiny(hidden=4, inter=8, layers=1, heads=2, kv=1, head_dim=2, vocab=6, tied=True):
    t = [("model.embed_tokens.weight", "BF16", [vocab, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        t += [(p + "input_layernorm.weight", "BF16", [hidden]),
              (p + "self_attn.q_proj.weight", "BF16", [heads * head_dim, hidden]),
              (p + "self_attn.k_proj.weight", "BF16", [kv * head_dim, hidden]),
              (p + "self_attn.v_proj.weight", "BF16", [kv * head_dim, hidden]),
              (p + "self_attn.o_proj.weight", "BF16", [hidden, heads * head_dim]),
              (p + "self_attn.q_norm.weight", "BF16", [head_dim]),
              (p + "self_attn.k_norm.weight", "BF16", [head_dim]),
              (p + "post_attention_layernorm.weight", "BF16", [hidden]),
              (p + "mlp.gate_proj.weight", "BF16", [inter, hidden]),
              (p + "mlp.up_proj.weight", "BF16", [inter, hidden]),
              (p + "mlp.down_proj.weight", "BF16", [hidden, inter])]
    t.append(("model.norm.weight", "BF16", [hidden]))
    if not tied:
        t.append(("lm_head.weight", "BF16", [vocab, hidden]))
    return t


st = "safetensors_fuzz"
write(st, "empty_header", safetensors([]))
write(st, "empty_header_unpadded", safetensors([], pad=False))
write(st, "metadata_only", safetensors([], {"format": "pt"}))
for dtype in SIZES:
    write(st, f"one_{dtype.lower()}", safetensors([("w", dtype, [2, 3])]))
write(st, "scalar", safetensors([("s", "F32", [])]))
write(st, "zero_size", safetensors([("z", "F32", [0, 5]), ("a", "U8", [3])]))
write(st, "two_tensors_meta", safetensors([("a.weight", "F16", [4]), ("b.bias", "I64", [2])],
                                          {"format": "pt", "k": "v"}))
write(st, "qwen3_tiny_tied", safetensors(qwen3_tiny(), {"format": "pt"}))
write(st, "qwen3_tiny_untied", safetensors(qwen3_tiny(tied=False, layers=2)))
write(st, "trailing_bytes", safetensors([("w", "U8", [2])], extra=b"\0\0"))
write(st, "truncated", safetensors([("w", "F32", [4])])[:-3])

# --- model.safetensors.index.json (shards: model-0000{1,2}-of-00002.safetensors, see the target)
wi = "model_weights_index_fuzz"
A, B = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
write(wi, "two_shards", json.dumps({"metadata": {"total_size": 6},
                                    "weight_map": {"a": A, "b": A, "c": B}}, indent=2))
write(wi, "one_shard_subset", json.dumps({"weight_map": {"b": A}}))
write(wi, "empty_map", json.dumps({"metadata": {}, "weight_map": {}}))
write(wi, "missing_shard", json.dumps({"weight_map": {"a": "model-00003-of-00003.safetensors"}}))
write(wi, "wrong_shard", json.dumps({"weight_map": {"c": A}}))
write(wi, "parent_path", json.dumps({"weight_map": {"a": "../" + A}}))

# --- GGUF (ggml's docs/gguf.md, version 3) ----------------------------------------------------
GGUF_SCALARS = {"u8": (0, "<B"), "i8": (1, "<b"), "u16": (2, "<H"), "i16": (3, "<h"),
                "u32": (4, "<I"), "i32": (5, "<i"), "f32": (6, "<f"), "bool": (7, "<B"),
                "u64": (10, "<Q"), "i64": (11, "<q"), "f64": (12, "<d")}
# ggml type: (block elements, block bytes)
GGML_BLOCKS = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 8: (32, 34), 12: (256, 144),
               14: (256, 210)}


def gguf_str(text):
    data = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def gguf_value(kind, value):
    """(type id, encoded value) of ("u32", 7), ("string", "x") or ("array", (kind, [values]))."""
    if kind == "string":
        return 8, gguf_str(value)
    if kind == "array":
        element, items = value
        etype = 8 if element == "string" else GGUF_SCALARS[element][0]
        body = b"".join(gguf_value(element, v)[1] for v in items)
        return 9, struct.pack("<IQ", etype, len(items)) + body
    tid, fmt = GGUF_SCALARS[kind]
    return tid, struct.pack(fmt, value)


def gguf(kvs, tensors, alignment=32, version=3):
    """A GGUF file: kvs [(key, kind, value)], tensors [(name, row-major shape, ggml type)] with
    deterministic data, each aligned to `alignment`."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, kind, value in kvs:
        tid, body = gguf_value(kind, value)
        out += gguf_str(key) + struct.pack("<I", tid) + body
    offset, blobs = 0, []
    for name, shape, ggml_type in tensors:
        elements, block_bytes = GGML_BLOCKS[ggml_type]
        numel = 1
        for d in shape:
            numel *= d
        size = numel // elements * block_bytes
        out += gguf_str(name) + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", d) for d in reversed(shape))
        out += struct.pack("<IQ", ggml_type, offset)
        blobs.append((offset, bytes((i * 7 + 3) % 256 for i in range(size))))
        offset = (offset + size + alignment - 1) // alignment * alignment
    out += b"\0" * (-len(out) % alignment)
    data = bytearray(offset if blobs else 0)
    for at, blob in blobs:
        data[at:at + len(blob)] = blob
    return out + bytes(data[:blobs[-1][0] + len(blobs[-1][1])] if blobs else b"")


def qwen3_gguf(tied=True, vocab_tokens=True):
    """A one-layer Qwen3 GGUF: hidden 4, 2 heads of 2, 1 KV head, vocab 6, f32 tensors."""
    kvs = [("general.architecture", "string", "qwen3"), ("general.alignment", "u32", 32),
           ("qwen3.block_count", "u32", 1), ("qwen3.context_length", "u32", 64),
           ("qwen3.embedding_length", "u32", 4), ("qwen3.feed_forward_length", "u32", 8),
           ("qwen3.attention.head_count", "u32", 2), ("qwen3.attention.head_count_kv", "u32", 1),
           ("qwen3.attention.key_length", "u32", 2), ("qwen3.attention.value_length", "u32", 2),
           ("qwen3.attention.layer_norm_rms_epsilon", "f32", 1e-6),
           ("qwen3.rope.freq_base", "f32", 1e6), ("tokenizer.ggml.eos_token_id", "u32", 5),
           ("tokenizer.ggml.bos_token_id", "u32", 4)]
    if vocab_tokens:
        kvs += [("tokenizer.ggml.model", "string", "gpt2"),
                ("tokenizer.ggml.pre", "string", "qwen2"),
                ("tokenizer.ggml.tokens", "array", ("string", ["a", "b", "ab", "\u0120", "<|endoftext|>", "<|im_end|>"])),
                ("tokenizer.ggml.token_type", "array", ("i32", [1, 1, 1, 1, 3, 3])),
                ("tokenizer.ggml.merges", "array", ("string", ["a b"])),
                ("tokenizer.chat_template", "string", "{{ messages }}")]
    t = [("token_embd.weight", [6, 4], 0)]
    for part, shape in (("attn_norm", [4]), ("attn_q", [4, 4]), ("attn_k", [2, 4]),
                        ("attn_v", [2, 4]), ("attn_output", [4, 4]), ("attn_q_norm", [2]),
                        ("attn_k_norm", [2]), ("ffn_norm", [4]), ("ffn_gate", [8, 4]),
                        ("ffn_up", [8, 4]), ("ffn_down", [4, 8])):
        t.append((f"blk.0.{part}.weight", shape, 0))
    t.append(("output_norm.weight", [4], 0))
    if not tied:
        t.append(("output.weight", [6, 4], 30))
    return gguf(kvs, t)


gg = "gguf_fuzz"
write(gg, "header_only", gguf([], []))
write(gg, "f32_bf16_f16", gguf([("general.name", "string", "x")],
                               [("a", [2, 3], 0), ("b", [4], 30), ("c", [3], 1)]))
write(gg, "every_value_type", gguf(
    [(f"t.{k}", k, 1) for k in GGUF_SCALARS] +
    [("t.string", "string", "text"), ("t.strings", "array", ("string", ["x", "", "yz"])),
     ("t.u8s", "array", ("u8", [1, 2, 3])), ("t.f64s", "array", ("f64", [0.5, -1.0])),
     ("t.bools", "array", ("bool", [0, 1]))], []))
write(gg, "alignment_64", gguf([("general.alignment", "u32", 64)],
                               [("a", [3], 0), ("b", [5], 0)], alignment=64))
write(gg, "quantized", gguf([], [("q8", [2, 32], 8), ("q4", [1, 64], 2), ("q4k", [1, 256], 12),
                                 ("q6k", [2, 256], 14)]))
write(gg, "qwen3_tied", qwen3_gguf())
write(gg, "qwen3_untied_no_vocab", qwen3_gguf(tied=False, vocab_tokens=False))
write(gg, "version_2", gguf([("k", "u32", 1)], [("a", [2], 0)], version=2))
write(gg, "truncated", gguf([], [("a", [2, 3], 0)])[:-5])
# Near-valid: dims whose product passes 2^64 (2^32 x 2^32 x 2^8), and an array of 2^61 u64
# elements whose byte size overflows 64 bits unless the count is bounded by the bytes left.
big = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + gguf_str("w") + struct.pack("<I", 3)
big += struct.pack("<QQQ", 1 << 32, 1 << 32, 1 << 8) + struct.pack("<IQ", 0, 0)
write(gg, "dims_product_overflows", big + b"\0" * (-len(big) % 32))
write(gg, "array_count_overflows", b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gguf_str("k") +
      struct.pack("<IIQ", 9, 10, 1 << 61))

# --- config.json + generation_config.json ----------------------------------------------------
mc = "model_config_fuzz"
qwen3_06b = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
gen_06b = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
           "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
           "transformers_version": "4.51.0"}
tiny = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 151936, "eos_token_id": [151645],
        "tie_word_embeddings": True}
write(mc, "qwen3_0_6b", json.dumps(qwen3_06b, indent=2))
write(mc, "qwen3_0_6b_with_generation", json.dumps(qwen3_06b, indent=2) + "\x01" +
      json.dumps(gen_06b, indent=2))
write(mc, "tiny", json.dumps(tiny))
write(mc, "tiny_generation_int", json.dumps(tiny) + "\x01" + json.dumps({"eos_token_id": 1}))
minimal = {"model_type": "qwen3", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10}
write(mc, "minimal_no_head_dim", json.dumps(minimal))
write(mc, "minimal_bos_null", json.dumps(dict(minimal, bos_token_id=None, eos_token_id=[1, 2],
                                              rms_norm_eps=1e-5, rope_theta=10000.0)))
write(mc, "untied_dtype", json.dumps(dict(minimal, tie_word_embeddings=False,
                                          torch_dtype="float32", max_position_embeddings=128)))
write(mc, "bad_hidden_act", json.dumps(dict(minimal, hidden_act="gelu")))
write(mc, "bad_eos_range", json.dumps(dict(minimal, eos_token_id=99)))

# --- tokenizer.json (small synthetic byte-level BPE) + tokenizer_config.json -------------------
QWEN_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"
              " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def byte_alphabet():
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) +
          list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer_json(merge_strings=False, pattern={"Regex": QWEN_REGEX}, normalizer={"type": "NFC"},
                   plain_byte_level=False, added=True, ignore_merges=False):
    alpha = byte_alphabet()
    vocab = {alpha[b]: b for b in range(256)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("l", "l"),
              ("he", "ll"), ("hell", "o"), ("Ġ", "Ġ")]
    for left, right in merges:
        vocab.setdefault(left, len(vocab))
        vocab.setdefault(right, len(vocab))
        vocab.setdefault(left + right, len(vocab))
    added_tokens = []
    if added:
        for i, (content, special) in enumerate([("<|endoftext|>", True), ("<|im_start|>", True),
                                                ("<|im_end|>", True), ("<think>", False)]):
            added_tokens.append({"id": len(vocab) + i, "content": content, "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False,
                                 "special": special})
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    if plain_byte_level:
        pre = byte_level
    else:
        pre = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": pattern, "behavior": "Isolated", "invert": False},
            byte_level]}
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added_tokens,
        "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": ignore_merges, "vocab": vocab,
                  "merges": [f"{a} {b}" for a, b in merges] if merge_strings else
                            [[a, b] for a, b in merges]}}, ensure_ascii=False)


tl = "tokenizer_load_fuzz"
config = json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                     "add_bos_token": False})
write(tl, "qwen_like", tokenizer_json())
write(tl, "qwen_like_with_config", tokenizer_json() + "\x01" + config)
write(tl, "config_object_form", tokenizer_json() + "\x01" +
      json.dumps({"eos_token": {"content": "<|im_end|>"}, "pad_token": None}))
write(tl, "merge_strings", tokenizer_json(merge_strings=True))
write(tl, "string_pattern", tokenizer_json(pattern={"String": " "}))
write(tl, "normalizer_sequence", tokenizer_json(normalizer={"type": "Sequence", "normalizers": [
    {"type": "NFC"}]}))
write(tl, "no_normalizer_plain_byte_level", tokenizer_json(normalizer=None, plain_byte_level=True,
                                                            added=False))
write(tl, "ignore_merges", tokenizer_json(ignore_merges=True))
write(tl, "backtracking_regex", tokenizer_json(pattern={"Regex": "(a+)+b|(\\s*)*x|(\\d+\\d+)+z"}))
write(tl, "bad_model_type", tokenizer_json().replace('"type": "BPE"', '"type": "WordPiece"'))

# --- text for the real Qwen3 tokenizer ---------------------------------------------------------
te = "tokenizer_encode_fuzz"
write_all(te, {
    "english": "The quick brown fox jumps over the lazy dog. It's 2024; we'll see!",
    "chat": "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "special_adjacent": "<|endoftext|><|im_end|>x<|im_start|",
    "chinese": "你好，世界！今天天气很好。",
    "emoji_zwj": "👩‍👩‍👧‍👦 🇺🇸 ❤️ 👍🏽",
    "combining_nfc": "cafe\u0301 A\u030a \u1e9b\u0323 \uac00\u11a8 \u212b",
    "invalid_utf8": b"ok \xff\xfe \xc0\xaf \xe0\x80\x80 \xed\xa0\x80 \xf4\x90\x80\x80 \xe2\x82 end",
    "whitespace": "  a\t\tb\r\n\r\n   \n c  \u00a0\u3000 \u0085 ",
    "numbers_code": "for (int i = 0; i < 1234567; ++i) { x[i] = 3.14e-10; }  // ok\n",
    "contractions": "I'M HE'LL SHE'D THEY'RE WE'VE it's 'S 'sss",
    "mixed_scripts": "Ελληνικά Русский العربية עברית हिन्दी 日本語 한국어 ไทย",
    "long_run": "a" * 300 + " " * 300 + "1" * 100 + "!" * 100 + "\n" * 50,
})

# --- prompts file lines -----------------------------------------------------------------------
pf = "prompts_file_fuzz"
write_all(pf, {
    "prompt": '{"prompt": "The quick brown fox"}',
    "prompt_ids": '{"prompt_ids": [9707, 11, 1879]}',
    "prompt_unicode": '{"prompt": "caf\\u00e9 \\ud83d\\ude00 \\n"}',
    "both_keys": '{"prompt": "a", "prompt_ids": [1]}',
    "blank": " \t\r",
    "empty_ids": '{"prompt_ids": []}',
    "not_object": '["prompt", "x"]',
    "non_integer_id": '{"prompt_ids": [1, 2.5]}',
    "big_id": '{"prompt_ids": [2147483647, 0]}',
    "crlf": '{"prompt": "x"}\r',
})

# --- SIMPLER_SIM_FAULTS ------------------------------------------------------------------------
fp = "fault_plan_fuzz"
write_all(fp, {
    "readme_example": "run=3:task=7:kind=device_fault:code=507018,run=5:task=0:kind=hang",
    "kernel_error": "run=0:task=0:kind=kernel_error",
    "launch_refused": "run=2:task=0:kind=launch_refused",
    "hang_code": "run=1:task=4294967295:kind=hang:code=9",
    "many": ",".join(f"run={i}:task={i % 3}:kind=kernel_error" for i in range(8)),
    "duplicate": "run=1:task=1:kind=hang,run=1:task=1:kind=kernel_error",
    "empty": "",
})
