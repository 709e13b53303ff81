// llamacpp_quality: how far a quantized GGUF file moves the first-step logits from the bf16
// model's, ours and llama.cpp's side by side (a benchmark, not a test; docs/benchmarks.md,
// "Quantized models"). For each of N seeded random prompts it takes the logits after the prompt's
// last position from
//   - ours on the bf16 checkpoint directory (exact path) and on the quantized file (precision
//     int8 and exact),
//   - llama.cpp's on the bf16 GGUF export of the same checkpoint and on the quantized file,
// and prints, for ours and for llama.cpp's, the relative L2 distance of the quantized file's
// logits from the same implementation's bf16 logits (mean, median, max over the prompts) and
// the top-1 agreement (prompts whose argmax is the bf16 model's); then ours against llama.cpp's
// on the bf16 files and on the quantized file (the second's reference being llama.cpp's); one
// JSON object with --json.
// Built where scripts/build_llamacpp_peer.sh has built the peer: `ninja -C build/release
// llamacpp_quality`.
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "ggml-backend.h"
#include "llama.h"
#include "llamacpp_peer_util.h"
#include "nlohmann/json.hpp"
#include "simpler/engine/llm_engine.h"

namespace simpler::llm {
namespace {

size_t argmax(const Logits& v) {
  return static_cast<size_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// Relative L2 (mean, median, max) and top-1 agreement of `quantized` against `bf16`.
nlohmann::json compare(const std::vector<Logits>& quantized, const std::vector<Logits>& bf16) {
  std::vector<double> rel;
  int64_t agree = 0;
  for (size_t i = 0; i < quantized.size(); ++i) {
    rel.push_back(relative_l2(quantized[i], bf16[i]));
    agree += argmax(quantized[i]) == argmax(bf16[i]);
  }
  double mean = 0;
  for (double r : rel) mean += r / static_cast<double>(rel.size());
  std::vector<double> sorted = rel;
  std::sort(sorted.begin(), sorted.end());
  return {{"relative_l2_mean", mean},
          {"relative_l2_median", sorted[sorted.size() / 2]},
          {"relative_l2_max", sorted.back()},
          {"top1_agree", agree},
          {"prompts", static_cast<int64_t>(rel.size())}};
}

// N prompts of `len` token ids drawn uniformly from [0, vocab), seeded.
Prompts random_prompts(int n, int len, int32_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> id(0, vocab - 1);
  Prompts prompts(n);
  for (auto& p : prompts) {
    for (int k = 0; k < len; ++k) p.push_back(id(rng));
  }
  return prompts;
}

struct Flags {
  std::string model, bf16_gguf, quantized;
  int prompts = 64, prompt_len = 16;
  int32_t vocab = 151643;  // Qwen3's ordinary tokens
  uint64_t seed = 1;
  bool json = false;
  bool f32_attention = false;
};

int run(const Flags& f) {
  const Prompts prompts = random_prompts(f.prompts, f.prompt_len, f.vocab, f.seed);
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto ours_bf16 = our_first_logits(f.model, prompts, Precision::kExact);
  auto ours_int8 = our_first_logits(f.quantized, prompts, Precision::kInt8);
  auto ours_exact = our_first_logits(f.quantized, prompts, Precision::kExact);
  llama_log_set(
      [](ggml_log_level level, const char* text, void*) {
        if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);  // only llama.cpp's errors
      },
      nullptr);
  ggml_backend_load_all_from_path(SIMPLER_LLAMACPP_BIN_DIR);
  llama_backend_init();
  const LlamacppAttention attention{.f32_attention = f.f32_attention};
  auto theirs_bf16 = llamacpp_first_logits(f.bf16_gguf, prompts, threads, attention);
  auto theirs_q = llamacpp_first_logits(f.quantized, prompts, threads, attention);
  llama_backend_free();
  for (const auto* r : {&ours_bf16, &ours_int8, &ours_exact, &theirs_bf16, &theirs_q}) {
    if (!r->ok()) {
      std::fprintf(stderr, "llamacpp_quality: %s\n", r->status().ToString().c_str());
      return 1;
    }
  }
  nlohmann::json j = {{"quantized", f.quantized},
                      {"prompts", f.prompts},
                      {"prompt_len", f.prompt_len},
                      {"seed", f.seed},
                      {"ours_int8", compare(*ours_int8, *ours_bf16)},
                      {"ours_exact", compare(*ours_exact, *ours_bf16)},
                      {"llamacpp", compare(*theirs_q, *theirs_bf16)},
                      {"bf16_ours_vs_llamacpp", compare(*ours_bf16, *theirs_bf16)},
                      {"quantized_ours_int8_vs_llamacpp", compare(*ours_int8, *theirs_q)},
                      {"quantized_ours_exact_vs_llamacpp", compare(*ours_exact, *theirs_q)}};
  if (f.json) {
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  for (const char* k : {"ours_int8", "ours_exact", "llamacpp", "bf16_ours_vs_llamacpp",
                        "quantized_ours_int8_vs_llamacpp", "quantized_ours_exact_vs_llamacpp"}) {
    const nlohmann::json& c = j[k];
    std::printf("%-33s relative L2 mean %.4g median %.4g max %.4g; top-1 agree %lld of %lld\n", k,
                c["relative_l2_mean"].get<double>(), c["relative_l2_median"].get<double>(),
                c["relative_l2_max"].get<double>(), c["top1_agree"].get<long long>(),
                c["prompts"].get<long long>());
  }
  return 0;
}

}  // namespace
}  // namespace simpler::llm

int main(int argc, char** argv) {
  simpler::llm::Flags f;
  CLI::App app{
      "first-step logits of a quantized GGUF file against the bf16 model's, ours and "
      "llama.cpp's side by side"};
  app.add_option("--model", f.model, "the bf16 checkpoint directory")->required();
  app.add_option("--bf16-gguf", f.bf16_gguf,
                 "the same checkpoint as a bf16 GGUF (simpler export-gguf), for llama.cpp")
      ->required();
  app.add_option("--quantized", f.quantized, "the quantized GGUF file (simpler export-gguf)")
      ->required();
  app.add_option("--prompts", f.prompts, "random prompts")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--prompt-len", f.prompt_len, "tokens a prompt")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--seed", f.seed, "the prompts' seed")->capture_default_str();
  app.add_flag("--json", f.json, "one JSON object on stdout");
  app.add_flag("--llamacpp-f32-attention", f.f32_attention,
               "llama.cpp without flash attention and with an f32 K/V cache (its default: flash "
               "attention over f16 K/V)");
  CLI11_PARSE(app, argc, argv);
  return simpler::llm::run(f);
}
