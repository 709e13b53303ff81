// llama.cpp as the benchmarks' peer in the same run (`bench decode|prefill --compare llama.cpp`):
// its llama-bench and llama-batched-bench, built by scripts/build_llamacpp_peer.sh from npm's
// node-llama-cpp source and prebuilt libraries, run on our checkpoint exported as GGUF.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "simpler/kernels/kernels.h"

namespace simpler::cli {

// The peer for one benchmark run: the tools' folder whose ggml CPU variants match our kernel
// target (avx512: every variant, ggml takes the best; x86-64-v3: only haswell; portable: only
// the x64 baseline) and the model as a GGUF file in the temporary directory, deleted when the
// object goes. Move-only; thread-compatible.
class LlamaCppPeer {
 public:
  // Finds the tools (SIMPLER_LLAMACPP_DIR, else build/peers/llama.cpp in the source tree) and
  // exports `model` (bf16, or f32 for an f32 checkpoint; a GGUF file is used as it is, and kept).
  // FAILED_PRECONDITION naming `scripts/install_deps.sh --bench` when the tools are not built; the
  // export's errors.
  static absl::StatusOr<LlamaCppPeer> prepare(const std::string& model, llm::KernelIsa isa);

  LlamaCppPeer(LlamaCppPeer&& other) noexcept;
  LlamaCppPeer& operator=(LlamaCppPeer&&) = delete;
  ~LlamaCppPeer();

  // Tokens/s of `batch` sequences generating `steps` tokens each after a prompt of `context`
  // tokens (a one-token prompt when 0), on `threads` threads (llama-bench -n, and -d for the
  // context, for one sequence; llama-batched-bench -npl, and -npp with the prompt shared, -pps,
  // for more).
  absl::StatusOr<double> decode_tokens_per_s(int batch, int steps, int threads, int context = 0);
  // Prompt-processing tokens/s of a `prompt_len`-token prompt (llama-bench -p, best of 3).
  absl::StatusOr<double> prefill_tokens_per_s(int prompt_len, int threads);
  // The ggml CPU variant ggml loads from the tools' folder (e.g. "zen4", "haswell", "x64"), as
  // `llama-bench --list-devices` names it at prepare() and each run of llama-bench since; empty
  // when no tool named one.
  const std::string& cpu_variant() const { return cpu_variant_; }

 private:
  LlamaCppPeer(std::string bin_dir, std::string gguf, bool owned);
  absl::StatusOr<std::string> run(const std::string& tool, const std::vector<std::string>& args);

  std::string bin_dir_;
  std::string gguf_;
  bool owned_ = false;  // gguf_ is our export, removed with the object
  std::string cpu_variant_;
};

// Adds --compare (torch or llama.cpp) to a `bench decode|prefill` command `cmd`, parsed into
// `*compare` (which must outlive the parse). Its help says the peers run `what` (e.g. "the
// prompts") with llama.cpp's `llama_tools` on the same threads and `same` (e.g. "prompt length").
void add_compare_flag(CLI::App* cmd, std::string* compare, const std::string& what,
                      const std::string& llama_tools, const std::string& same);

// The llama.cpp peer of a `bench decode|prefill` run: prepared (LlamaCppPeer::prepare) when
// `compare` is "llama.cpp", none otherwise.
absl::StatusOr<std::optional<LlamaCppPeer>> prepare_peer_if_compared(const std::string& compare,
                                                                     const std::string& model,
                                                                     llm::KernelIsa isa);

// Adds a row's llama.cpp figures to `out`: the peer's tokens/s (`theirs`), ours over theirs and
// the peer's ggml CPU variant.
void add_llamacpp_figures(const LlamaCppPeer& peer, double theirs, double ours,
                          nlohmann::json* out);

// Prints a row's llama.cpp line from the figures add_llamacpp_figures put in `out`, when `peer`
// is set; `threads` are the peer's.
void print_llamacpp_line(const LlamaCppPeer* peer, int threads, const nlohmann::json& out);

}  // namespace simpler::cli
