// Writing a Qwen3 model directory (Hugging Face layout, safetensors) as one GGUF file that
// llama.cpp loads: the benchmarks' peer runs on the same checkpoint as we do.
//
// Format: GGUF version 3 (ggml's docs/gguf.md): the magic "GGUF", the version, the tensor and
// key-value counts, the key-values, the tensor infos (name, dims innermost first, ggml type,
// offset), padding to `general.alignment` (32), then the tensor data, each tensor aligned to 32
// bytes. Everything little-endian.
//
// What is written, as llama.cpp's convert_hf_to_gguf.py writes a Qwen3 checkpoint:
//   general.architecture "qwen3", general.name, general.alignment 32, general.file_type
//   (0 all f32, 32 mostly bf16, 7 mostly Q8_0, 2 mostly Q4_0, 15 mostly Q4_K_M);
//   qwen3.{context_length, embedding_length, block_count, feed_forward_length,
//   attention.head_count, attention.head_count_kv, attention.key_length, attention.value_length}
//   (u32), qwen3.rope.freq_base, qwen3.attention.layer_norm_rms_epsilon (f32); tokenizer.ggml.model
//   "gpt2", tokenizer.ggml.pre "qwen2", tokenizer.ggml.tokens (every id up to vocab_size:
//   tokenizer.json's vocabulary and added tokens, "[PAD<id>]" for ids neither names),
//   tokenizer.ggml.token_type (1 normal, 3 control = special added tokens, 4 user defined = other
//   added tokens, 5 unused = padding), tokenizer.ggml.merges ("a b"),
//   tokenizer.ggml.{bos,eos,padding}_token_id, tokenizer.ggml.add_bos_token false,
//   tokenizer.chat_template (tokenizer_config.json's "chat_template", byte for byte, when it has
//   one); tensors named as llama.cpp names them (token_embd, output_norm, output unless tied,
//   blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm, ffn_norm,
//   ffn_gate, ffn_up, ffn_down}), the data unchanged (Qwen3's RoPE is llama.cpp's NEOX rotation, no
//   permutation), 1-D tensors (the norms) in f32.
//
// Q8_0 follows llama.cpp's defaults for a Qwen3 checkpoint (convert_hf_to_gguf.py --outtype q8_0,
// and llama-quantize to Q8_0): every 2-D tensor (the projections, token_embd and output, tied or
// not) is Q8_0 by ggml's reference quantizer (quantize_row_q8_0 below); a 2-D tensor whose rows
// are not whole blocks of 32 falls back to F16, as the converter does; 1-D tensors stay F32.
// Q4_0 follows llama-quantize's Q4_0 file type: every 2-D tensor Q4_0 (quantize_row_q4_0) but
// the LM head (output.weight, or token_embd.weight when tied), which is Q6_K (quantize_row_q6_k),
// or Q8_0 when its rows are not whole super-blocks of 256 (llama.cpp's fallback); 1-D tensors F32.
// Q4_K_M follows llama-quantize's Q4_K_M file type for a dense model without an importance matrix
// (llama_tensor_get_type in llama-quant.cpp): Q4_K (quantize_row_q4_k) for every 2-D tensor but
// the LM head (output.weight, or token_embd.weight when tied: Q6_K) and attn_v / ffn_down of the
// layers where use_more_bits(layer, layers) holds (layer < layers/8, layer >= 7·layers/8, or
// (layer - layers/8) % 3 == 2: Q6_K, quantize_row_q6_k); an untied token_embd is Q4_K. A tensor
// whose rows are not whole super-blocks of 256 falls back as llama.cpp's tensor_type_fallback
// does, Q6_K to Q8_0, except Q4_K, which llama.cpp writes Q5_0 and we write Q8_0 (no Q5_0 kernels
// here). 1-D tensors F32.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "absl/status/status.h"

namespace simpler::llm {

// The type of the 2-D tensors in the file: kBf16 copies bf16 checkpoints as they are (f32 / f16
// ones rounded to bf16, nearest even); kF32 widens everything to f32 (exact); kQ8_0 quantizes
// them (quantize_row_q8_0).
// kQ4_0 quantizes them with quantize_row_q4_0, the LM head with quantize_row_q6_k (or
// quantize_row_q8_0, above); kQ4_K_M writes llama.cpp's Q4_K_M mix (above).
enum class GgufType : uint8_t { kBf16, kF32, kQ8_0, kQ4_0, kQ4_K_M };

// ggml's reference Q8_0 quantizer (quantize_row_q8_0_ref in ggml-quants.c), written here from its
// definition: `x` in blocks of 32; for each block amax = max |x|, d = amax / 127 (f32),
// id = 1 / d (0 when d is 0), the block's scale stored as d rounded to IEEE binary16 (nearest
// even), and q[i] = x[i]·id (f32) rounded half away from zero (roundf). `out` receives
// x.size() / 32 blocks of 34 bytes (d little-endian, then the 32 q). INVALID_ARGUMENT when
// x.size() is not a multiple of 32, out.size() is not x.size() / 32 · 34, or a value is NaN or
// infinite (naming its index). Thread-safe.
absl::Status quantize_row_q8_0(std::span<const float> x, std::span<uint8_t> out);

// ggml's reference Q4_0 quantizer (quantize_row_q4_0_ref), written from its definition: per
// block of 32, max = the value of largest magnitude (the first such, with its sign),
// d = max / -8 (f32), id = 1 / d (0 when d is 0), the scale stored as d rounded to binary16, and
// for j < 16 the byte qs[j] = xi(x[j]) | xi(x[j + 16]) << 4 with xi(v) = min(15, trunc(v·id +
// 8.5)). `out` receives x.size() / 32 blocks of 18 bytes. Errors as quantize_row_q8_0's.
absl::Status quantize_row_q4_0(std::span<const float> x, std::span<uint8_t> out);

// ggml's reference Q4_K quantizer (quantize_row_q4_K_ref, with make_qkx2_quants and
// get_scale_min_k4's packing), written from its definition: per super-block of 256, each
// sub-block of 32 gets an affine scale and min by make_qkx2_quants (weights av + |x|, av the
// sub-block's root mean square; 21 trial scales nmax = 15 - 1 + 0.1·i over max - min, each
// refined by weighted least squares, the least weighted squared error kept); the eight scales and
// mins are quantized to 6 bits against d = max scale / 63 and dmin = max min / 63 (stored as
// binary16), and each value's level is nearest_int((x + dmin·m) / (d·sc)) clamped to [0, 15].
// nearest_int rounds half to even. The same float operations in the same order as the
// reference, so the bytes are llama.cpp's where neither build contracts multiply-adds (x86-64
// baseline; tests/llamacpp checks them). `out` receives x.size() / 256 blocks of 144 bytes
// (task::DataType::kQ4_K). INVALID_ARGUMENT when x.size() is not a multiple of 256, out.size()
// is not x.size() / 256 · 144, or a value is NaN or infinite (naming its index). Thread-safe.
absl::Status quantize_row_q4_k(std::span<const float> x, std::span<uint8_t> out);

// ggml's reference Q6_K quantizer (quantize_row_q6_K_ref, with make_qx_quants, rmse_type 1):
// per group of 16 a symmetric scale by make_qx_quants (19 trial scales -(32 + 0.1·i) / max, the
// best by the x²-weighted least squares), the sixteen scales quantized to int8 against
// d = -max scale / 128 (binary16; all-zero blocks store zeros), each level
// nearest_int(x / (d·sc)) clamped to [-32, 31] plus 32, packed as task::DataType::kQ6_K. `out`
// receives x.size() / 256 blocks of 210 bytes. Errors as quantize_row_q4_k's (210 for 144).
absl::Status quantize_row_q6_k(std::span<const float> x, std::span<uint8_t> out);

struct GgufExportOptions {
  std::string model_dir;  // config.json, tokenizer.json, model.safetensors (or shards)
  // Written to a new temporary file beside it (out_path + ".tmp.<pid>.<n>", created exclusively),
  // renamed over out_path once complete: a file already at out_path is replaced then, and only
  // then. On any error, or when cancelled, the temporary file is removed.
  std::string out_path;
  GgufType type = GgufType::kBf16;
  // Called after each tensor with (tensors written, tensors in all); may be empty.
  std::function<void(int64_t, int64_t)> progress;
  // When not null and set (by another thread or a signal handler: a lock-free atomic), the export
  // stops before its next tensor or the next chunk of one (about 1 Mi values), or before the
  // rename, and returns CANCELLED. Must outlive the call.
  const std::atomic<bool>* cancel = nullptr;
};

// Writes the GGUF file. Errors, before the checkpoint is read: INVALID_ARGUMENT when out_path is
// empty or a directory, lies in model_dir under a name not ending in ".gguf" (any case) unless it
// is a GGUF file already (is_gguf_path), or is, or is linked to, a file of model_dir (the rename
// would replace the checkpoint's own files); NOT_FOUND when out_path's directory does not exist,
// UNAVAILABLE with the OS error when it cannot be examined. Then the model directory's
// (config.json, tokenizer.json, the checkpoint: the codes of ModelConfig::load and
// ModelWeights::open and its tensor reads); INVALID_ARGUMENT naming the field when tokenizer.json
// is not a BPE model with a vocabulary and merges, or an id is outside the model's vocabulary;
// INVALID_ARGUMENT naming the tensor and index of a value that is not finite (the quantized
// types); UNAVAILABLE with the OS error, naming out_path and its temporary file, when that cannot
// be created or written or renamed; CANCELLED (above). After any error the temporary file is gone
// and a file that was at out_path is as it was. Thread-compatible; two exports to one out_path
// at once each write their own temporary file and the last rename wins.
// Memory: the checkpoint is mapped, not read; a tensor written in another type is widened to f32
// and encoded a chunk of whole rows at a time (about 1 Mi values: 4 MiB of f32 and its encoding),
// never in one piece, with the same bytes as encoding the whole tensor at once.
absl::Status export_gguf(const GgufExportOptions& options);

}  // namespace simpler::llm
