#!/usr/bin/python3
"""Self-checks of the numpy reference (qwen3_ref.py) against independent formulations.

  * the token-by-token decode with a K/V cache equals a whole-sequence causal forward written
    separately (masked attention over the full [T, T] score matrix);
  * RoPE: rotation keeps norms, and q.k after RoPE depends only on the relative position;
  * GQA: query head h reads KV head h // (heads / kv_heads), checked against a model with one KV
    head per query head whose K/V weights duplicate the shared heads;
  * safetensors: the writer and reader round-trip every dtype; BF16 encoding rounds to nearest
    even;
  * generate stops at a stop id and reports K/V only for processed positions;
  * requests decoded side by side (generate_all: prompts of different lengths, one stopping
    early) each get the whole-sequence forward's logits and the K/V of their run alone.

Run: /usr/bin/python3 tests/reference/qwen3_ref_test.py
"""

import json
import math
import os
import shutil
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen3_ref as ref  # noqa: E402


def write_model(out, *extra):
    args = ["write-model", "--out", out, "--dtype", "f32", "--vocab", "256", "--hidden", "32",
            "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--layers", "2",
            "--intermediate", "48", "--seed", "9"] + list(extra)
    assert ref.main(args) == 0


def full_forward(model, tokens):
    """Logits [T, V] of a whole sequence: causal masked attention over all positions at once."""
    c, w = model.c, model.w
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    T = len(tokens)
    pos = np.arange(T, dtype=np.float64)
    inv = c["rope_theta"] ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.outer(pos, inv)                       # [T, hd/2]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]

    def norm(x, weight):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + c["rms_norm_eps"]) * weight

    def rope(x):  # [T, heads, hd]
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos + np.concatenate([-x2, x1], -1) * sin

    x = w["model.embed_tokens.weight"][tokens]     # [T, H]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rope(norm((h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd),
                      w[p + "self_attn.q_norm.weight"]))
        k = rope(norm((h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd),
                      w[p + "self_attn.k_norm.weight"]))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
        out = np.empty((T, nh, hd))
        for head in range(nh):
            kvh = head // (nh // nkv)
            s = q[:, head] @ k[:, kvh].T / math.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (s / s.sum(-1, keepdims=True)) @ v[:, kvh]
        x = x + out.reshape(T, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g * (1 / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    x = norm(x, w["model.norm.weight"])
    return x @ model.lm_head.T


class ReferenceTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="qwen3_ref_test_")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_decode_with_cache_equals_full_sequence_forward(self):
        out = os.path.join(self.dir, "m")
        write_model(out)
        model = ref.Qwen3(out)
        prompt = [5, 17, 200, 3]
        res = model.generate(prompt, 6, [], logits_steps=set(range(6)))
        seq = prompt + res["tokens"][:-1]
        full = full_forward(model, seq)
        for s in range(6):
            np.testing.assert_allclose(res["logits"][str(s)], full[len(prompt) - 1 + s],
                                       rtol=1e-10, atol=1e-10)
            self.assertEqual(res["tokens"][s], int(np.argmax(full[len(prompt) - 1 + s])))

    def test_requests_side_by_side_each_equal_the_full_forward_and_their_run_alone(self):
        out = os.path.join(self.dir, "m")
        write_model(out)
        model = ref.Qwen3(out)
        prompts = [[5, 17, 200, 3], [9], list(range(40, 52))]
        alone = [model.generate(p, 6, [], logits_steps=set(range(6)), kv_positions=range(20))
                 for p in prompts]
        stop = alone[1]["tokens"][2]  # the second request stops at its third token
        both = model.generate_all(prompts, 6, [stop], logits_steps=set(range(6)),
                                  kv_positions=range(20))
        self.assertEqual(len(both), 3)
        for got, want, prompt in zip(both, alone, prompts):
            n = len(got["tokens"])
            self.assertEqual(got["prompt_ids"], prompt)
            if stop in want["tokens"]:
                n_want = want["tokens"].index(stop) + 1
                self.assertEqual(got["finish_reason"], "stop")
            else:
                n_want = 6
                self.assertEqual(got["finish_reason"], "length")
            self.assertEqual(got["tokens"], want["tokens"][:n_want])
            self.assertEqual(sorted(got["logits"], key=int), [str(s) for s in range(n)])
            full = full_forward(model, prompt + got["tokens"][:-1])
            for s in range(n):
                np.testing.assert_allclose(got["logits"][str(s)], full[len(prompt) - 1 + s],
                                           rtol=1e-10, atol=1e-10)
            processed = len(prompt) + n - 1
            self.assertEqual(sorted(got["kv"], key=int), [str(p) for p in range(min(processed,
                                                                                    20))])
            for p in got["kv"]:
                for kv in ("k", "v"):
                    np.testing.assert_allclose(got["kv"][p][kv], want["kv"][p][kv], rtol=1e-12,
                                               atol=1e-12)
        self.assertEqual(both[1]["finish_reason"], "stop")

    def test_rope_keeps_norm_and_depends_on_relative_position(self):
        out = os.path.join(self.dir, "m")
        write_model(out)
        model = ref.Qwen3(out)
        rng = np.random.default_rng(0)
        q, k = rng.standard_normal((1, 16)), rng.standard_normal((1, 16))
        self.assertAlmostEqual(np.linalg.norm(model.rope(q, 37)), np.linalg.norm(q), places=12)
        a = float(model.rope(q, 10) @ model.rope(k, 3).T)
        b = float(model.rope(q, 107) @ model.rope(k, 100).T)
        self.assertAlmostEqual(a, b, places=10)
        # Rotate-half pairs dimension i with i + head_dim/2 (not interleaved neighbours).
        e0 = np.zeros((1, 16))
        e0[0, 0] = 1.0
        r = model.rope(e0, 1)
        self.assertAlmostEqual(r[0, 0], math.cos(1.0), places=12)
        self.assertAlmostEqual(r[0, 8], math.sin(1.0), places=12)
        self.assertEqual(np.count_nonzero(np.abs(r) > 1e-15), 2)

    def test_gqa_query_head_reads_kv_head_h_div_group(self):
        out = os.path.join(self.dir, "m")
        write_model(out)
        gqa = ref.Qwen3(out)
        mha = ref.Qwen3(out)
        nh, nkv, hd = 4, 2, 16
        mha.c["num_key_value_heads"] = nh
        for i in range(2):
            for proj in ("k_proj", "v_proj"):
                name = f"model.layers.{i}.self_attn.{proj}.weight"
                heads = gqa.w[name].reshape(nkv, hd, -1)
                mha.w[name] = np.concatenate([heads[h // (nh // nkv)] for h in range(nh)])
        prompt = [1, 2, 3, 4, 5]
        a = gqa.generate(prompt, 3, [], logits_steps={0, 1, 2})
        b = mha.generate(prompt, 3, [], logits_steps={0, 1, 2})
        self.assertEqual(a["tokens"], b["tokens"])
        for s in ("0", "1", "2"):
            np.testing.assert_allclose(a["logits"][s], b["logits"][s], rtol=1e-12, atol=1e-12)

    def test_safetensors_round_trip_every_dtype(self):
        path = os.path.join(self.dir, "t.safetensors")
        vals = np.array([[1.0, -2.5, 3.0e-3], [7.0, 0.0, -1.0e4]])
        tensors = [("a", "F32", ref.from_f64("F32", vals)),
                   ("b", "BF16", ref.from_f64("BF16", vals)),
                   ("c", "F16", ref.from_f64("F16", vals)),
                   ("d", "I32", np.array([1, -2], dtype="<i4")),
                   ("e", "I64", np.array([1 << 40], dtype="<i8")),
                   ("f", "U8", np.array([0, 255], dtype="u1"))]
        ref.write_safetensors(path, tensors, {"format": "pt"})
        got, meta = ref.read_safetensors(path)
        self.assertEqual(meta, {"format": "pt"})
        for name, dtype, arr in tensors:
            self.assertEqual(got[name][0], dtype)
            self.assertEqual(got[name][1], arr.shape)
            np.testing.assert_array_equal(got[name][2], arr)
        np.testing.assert_allclose(ref.to_f64("BF16", got["b"][2]), vals, rtol=4e-3)
        with open(path, "rb") as f:
            self.assertEqual(int.from_bytes(f.read(8), "little") % 8, 0)

    def test_bf16_rounds_to_nearest_even(self):
        # 1 + 2^-8 is halfway between bf16 1.0 and 1 + 2^-7: ties go to the even mantissa (1.0).
        # 1 + 3*2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: rounds up to even.
        vals = np.array([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -8 + 2 ** -20])
        back = ref.to_f64("BF16", ref.from_f64("BF16", vals))
        np.testing.assert_array_equal(back, [1.0, 1.0 + 2 ** -6, 1.0 + 2 ** -7])

    def test_generate_stops_at_stop_id_and_reports_processed_kv_only(self):
        out = os.path.join(self.dir, "m")
        write_model(out)
        model = ref.Qwen3(out)
        free = model.generate([1, 2], 5, [], kv_positions=[0, 5, 6])
        self.assertEqual(free["finish_reason"], "length")
        self.assertEqual(sorted(free["kv"]), ["0", "5"])  # 2 + 5 - 1 positions processed
        stop = free["tokens"][2]
        stopped = model.generate([1, 2], 5, [stop])
        self.assertEqual(stopped["finish_reason"], "stop")
        self.assertEqual(stopped["tokens"], free["tokens"][:free["tokens"].index(stop) + 1])

    def test_cli_generate_writes_json(self):
        out = os.path.join(self.dir, "m")
        write_model(out, "--shards", "2", "--untied", "--dtype", "bf16")
        res_path = os.path.join(self.dir, "r.json")
        self.assertEqual(ref.main(["generate", "--model", out, "--prompt-ids", "1,2,3",
                                   "--prompt-ids", "4", "--max-new-tokens", "4",
                                   "--ignore-eos", "--dump-logits-steps", "0,3",
                                   "--dump-kv-positions", "0,1", "--out", res_path]), 0)
        with open(res_path) as f:
            res = json.load(f)
        self.assertEqual(len(res["requests"]), 2)
        self.assertEqual(len(res["requests"][0]["tokens"]), 4)
        self.assertEqual(sorted(res["requests"][0]["logits"]), ["0", "3"])
        self.assertEqual(len(res["requests"][0]["logits"]["0"]), 256)
        self.assertEqual(np.array(res["requests"][0]["kv"]["1"]["k"]).shape, (2, 2, 16))
        self.assertEqual(sorted(res["requests"][1]["kv"]), ["0", "1"])


if __name__ == "__main__":
    unittest.main()
