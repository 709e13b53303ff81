#!/usr/bin/python3
"""PyTorch eager peer of `simpler bench decode` / `bench prefill --compare torch`.

Runs the same checkpoint as a plain batched Qwen3 forward in torch eager (f32 weights and
activations; Debian's python3-torch), with `--threads` intra-op threads, and prints one JSON
object on stdout:

  decode:  {"batch": B, "decode_step_ms": median ms of one decode step of B rows}
           (after a 1-token prompt per row; K/V kept per layer as growing tensors)
  prefill: {"prompt_len": T, "ttft_ms": best ms of one forward over a T-token prompt}

The math is transformers' modeling_qwen3.py (RMSNorm, q/k norm, rotate-half RoPE, causal GQA
attention, SwiGLU MLP); the weights come from tests/reference/qwen3_ref.py's safetensors reader.
"""
import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "reference"))
import numpy as np  # noqa: E402
import torch  # noqa: E402
import qwen3_ref  # noqa: E402


class TorchQwen3:
    def __init__(self, model_dir):
        self.c = c = qwen3_ref.load_config(model_dir)
        raw = qwen3_ref.read_weights(model_dir)
        self.w = {}
        for name, shape in qwen3_ref.expected_weights(c):
            dtype, _, arr, _ = raw[name]
            self.w[name] = torch.from_numpy(qwen3_ref.to_f64(dtype, arr).astype(np.float32))
        self.lm_head = self.w["model.embed_tokens.weight"] if c["tie_word_embeddings"] \
            else self.w["lm_head.weight"]
        hd = c["head_dim"]
        self.inv_freq = c["rope_theta"] ** (-(torch.arange(0, hd // 2, dtype=torch.float64) * 2.0)
                                            / hd)

    def rms_norm(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"]) * w

    def rope(self, x, pos):
        # x [B, T, heads, hd]; pos [B, T]
        angle = pos.to(torch.float64)[..., None] * self.inv_freq
        cos = torch.cat([angle.cos(), angle.cos()], -1).to(torch.float32)[:, :, None, :]
        sin = torch.cat([angle.sin(), angle.sin()], -1).to(torch.float32)[:, :, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def forward(self, ids, pos, cache):
        """ids, pos [B, T]; cache: per layer [k, v] of [B, nkv, P, hd] (appended). Returns the
        last position's logits [B, V]."""
        c, w = self.c, self.w
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        B, T = ids.shape
        x = w["model.embed_tokens.weight"][ids]
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = self.rms_norm(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(B, T, nh, hd)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(B, T, nkv, hd)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(B, T, nkv, hd)
            q = self.rope(self.rms_norm(q, w[p + "self_attn.q_norm.weight"]), pos)
            k = self.rope(self.rms_norm(k, w[p + "self_attn.k_norm.weight"]), pos)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            if cache[i] is None:
                cache[i] = [k, v]
            else:
                cache[i] = [torch.cat([cache[i][0], k], 2), torch.cat([cache[i][1], v], 2)]
            keys = cache[i][0].repeat_interleave(nh // nkv, 1)
            values = cache[i][1].repeat_interleave(nh // nkv, 1)
            scores = q.transpose(1, 2) @ keys.transpose(2, 3) / math.sqrt(hd)
            P = keys.shape[2]
            mask = torch.ones(T, P, dtype=torch.bool).tril(P - T)
            scores = scores.masked_fill(~mask, float("-inf"))
            attn = (scores.softmax(-1) @ values).transpose(1, 2).reshape(B, T, nh * hd)
            x = x + attn @ w[p + "self_attn.o_proj.weight"].T
            h = self.rms_norm(x, w[p + "post_attention_layernorm.weight"])
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            up = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        x = self.rms_norm(x[:, -1], w["model.norm.weight"])
        return x @ self.lm_head.T


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--batch", type=int, help="decode: rows per step")
    ap.add_argument("--steps", type=int, default=8, help="decode: timed steps")
    ap.add_argument("--prompt-len", type=int, help="prefill: prompt tokens")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = TorchQwen3(args.model)
    V = m.c["vocab_size"]
    with torch.inference_mode():
        if args.batch:
            cache = [None] * m.c["num_hidden_layers"]
            ids = torch.ones(args.batch, 1, dtype=torch.long)
            logits = m.forward(ids, torch.zeros(args.batch, 1, dtype=torch.long), cache)
            times = []
            for s in range(args.steps):
                ids = logits.argmax(-1, keepdim=True)
                t0 = time.perf_counter()
                logits = m.forward(ids, torch.full((args.batch, 1), s + 1, dtype=torch.long),
                                   cache)
                times.append((time.perf_counter() - t0) * 1e3)
            times.sort()
            print(json.dumps({"batch": args.batch, "decode_step_ms": times[len(times) // 2],
                              "threads": args.threads}))
        else:
            T = args.prompt_len
            best = float("inf")
            for rep in range(2):
                ids = torch.tensor([[(100 + 7 * i + rep) % V for i in range(T)]])
                t0 = time.perf_counter()
                m.forward(ids, torch.arange(T)[None], [None] * m.c["num_hidden_layers"])
                best = min(best, (time.perf_counter() - t0) * 1e3)
            print(json.dumps({"prompt_len": T, "ttft_ms": best, "threads": args.threads}))


if __name__ == "__main__":
    main()
