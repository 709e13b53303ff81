// The first-step logits of ours and of llama.cpp (through libllama's C API) on the same
// prompts, for llamacpp_logits_test and the llamacpp_quality benchmark. Header-only; the
// includer links simpler_engine and libllama (tests/CMakeLists.txt).
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "engine/engine_test_hooks.h"
#include "llama.h"
#include "simpler/base/clock.h"
#include "simpler/base/status.h"
#include "simpler/engine/kv_pages.h"
#include "simpler/engine/llm_engine.h"

namespace simpler::llm {

using Logits = std::vector<float>;
using Prompts = std::vector<std::vector<int32_t>>;

// Our logits after each prompt's last position: every prompt a request of one engine on `model`
// (a directory or a .gguf file), one output token each.
inline absl::StatusOr<std::vector<Logits>> our_first_logits(const std::string& model,
                                                            const Prompts& prompts,
                                                            Precision precision) {
  EngineOptions eo;
  eo.runner.precision = precision;
  eo.runner.worker.operation_timeout_s = 3600;  // a slow path on a loaded machine is not an error
  // Every prompt with its one new token in the pool at once.
  int64_t pages = 0;
  for (const std::vector<int32_t>& p : prompts) {
    pages += pages_needed(static_cast<int64_t>(p.size()) + 1, eo.runner.page_size);
  }
  eo.runner.num_pages = static_cast<int32_t>(pages);
  SIMPLER_ASSIGN_OR_RETURN(std::unique_ptr<LlmEngine> engine, LlmEngine::create(model, eo));
  std::vector<RequestId> ids;
  std::vector<std::shared_ptr<RequestHooks>> hooks;
  for (const std::vector<int32_t>& p : prompts) {
    RequestSpec spec;
    spec.prompt_ids = p;
    spec.max_tokens = 1;
    spec.sampling.temperature = 0;
    hooks.push_back(std::make_shared<RequestHooks>());
    hooks.back()->logits_tokens = {0};
    spec.hooks = hooks.back();
    SIMPLER_ASSIGN_OR_RETURN(RequestId id, engine->add_request(spec));
    ids.push_back(id);
  }
  std::vector<Logits> logits(prompts.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    for (;;) {
      SIMPLER_ASSIGN_OR_RETURN(
          RequestOutput out,
          engine->next_output(ids[i], base::Deadline::after(std::chrono::seconds(600))));
      if (hooks_of(out).logits.count(0)) logits[i] = hooks_of(out).logits.at(0);
      if (out.finished()) break;
    }
    if (logits[i].empty()) {
      return absl::InternalError(absl::StrCat("no logits for prompt ", i, " of ", model));
    }
  }
  SIMPLER_RETURN_IF_ERROR(engine->shutdown());
  return logits;
}

// How llama.cpp's context attends. Its defaults (flash attention where the backend has it,
// which the CPU's does, over an f16 K/V cache) round K and V to f16 and, on the CPU, accumulate
// softmax·V in f16; `f32_attention` turns flash attention off and keeps K/V in f32, so its
// attention is f32 throughout as ours is.
struct LlamacppAttention {
  bool f32_attention = false;
};

// llama.cpp's logits after each prompt's last position, one context over the file, its memory
// cleared between prompts. The caller has loaded ggml's backends and initialised llama.cpp
// (ggml_backend_load_all_from_path, llama_backend_init).
inline absl::StatusOr<std::vector<Logits>> llamacpp_first_logits(
    const std::string& gguf, const Prompts& prompts, int threads,
    LlamacppAttention attention = LlamacppAttention()) {
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  std::unique_ptr<llama_model, decltype(&llama_model_free)> model(
      llama_model_load_from_file(gguf.c_str(), mp), &llama_model_free);
  if (model == nullptr) return absl::InvalidArgumentError("llama.cpp did not load " + gguf);
  size_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, p.size());
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(longest + 16);
  cp.n_batch = cp.n_ctx;
  cp.n_threads = threads;
  cp.n_threads_batch = threads;
  if (attention.f32_attention) {
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
  }
  std::unique_ptr<llama_context, decltype(&llama_free)> ctx(llama_init_from_model(model.get(), cp),
                                                            &llama_free);
  if (ctx == nullptr) return absl::InternalError("llama.cpp made no context for " + gguf);
  const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model.get()));
  std::vector<Logits> logits;
  for (const std::vector<int32_t>& p : prompts) {
    llama_memory_clear(llama_get_memory(ctx.get()), true);
    std::vector<llama_token> tokens(p.begin(), p.end());
    llama_batch batch = llama_batch_get_one(tokens.data(), static_cast<int32_t>(tokens.size()));
    if (int rc = llama_decode(ctx.get(), batch); rc != 0) {
      return absl::InternalError(absl::StrCat("llama_decode returned ", rc, " on ", gguf));
    }
    const float* l = llama_get_logits_ith(ctx.get(), -1);
    if (l == nullptr) return absl::InternalError("llama.cpp returned no logits for " + gguf);
    logits.emplace_back(l, l + n_vocab);
  }
  return logits;
}

// The relative L2 distance of `a` from `reference`.
inline double relative_l2(const Logits& a, const Logits& reference) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - reference[i]) * (double(a[i]) - reference[i]);
    norm += double(reference[i]) * reference[i];
  }
  return std::sqrt(diff / norm);
}

}  // namespace simpler::llm
