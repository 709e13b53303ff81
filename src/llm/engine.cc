#include "simpler/llm/engine.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "simpler/base/clock.h"
#include "simpler/base/log.h"
#include "simpler/base/status.h"
#include "simpler/llm/kernels.h"
#include "simpler/llm/kv_cache.h"
#include "simpler/llm/safetensors.h"

namespace simpler::llm {

using task::DataType;
using task::MemoryKind;
using task::Tensor;

// The decode callable is registered before Worker::init (with the program's
// kernel table) and bound to the device addresses of weights, scratch and KV
// pools after upload: its orchestration forwards to the bound program.
struct Qwen3Engine::Holder {
  task::ChipCallable bound;
};

namespace {

Tensor host_tensor(const void* data, std::initializer_list<int64_t> shape, DataType dtype) {
  return *Tensor::contiguous(reinterpret_cast<uintptr_t>(data), shape, dtype, MemoryKind::kHost);
}

Qwen3Dims dims_of(const ModelConfig& c) {
  Qwen3Dims d;
  d.hidden_size = c.hidden_size;
  d.intermediate_size = c.intermediate_size;
  d.num_hidden_layers = c.num_hidden_layers;
  d.num_attention_heads = c.num_attention_heads;
  d.num_key_value_heads = c.num_key_value_heads;
  d.head_dim = c.head_dim;
  d.vocab_size = c.vocab_size;
  d.rms_norm_eps = c.rms_norm_eps;
  d.rope_theta = c.rope_theta;
  d.tie_word_embeddings = c.tie_word_embeddings;
  return d;
}

}  // namespace

int32_t Qwen3Engine::pages_for(const std::vector<std::vector<int32_t>>& prompts,
                               int32_t max_new_tokens, int32_t page_size) {
  int64_t pages = 0;
  for (const auto& p : prompts) {
    pages += pages_needed(static_cast<int64_t>(p.size()) + max_new_tokens, page_size);
  }
  return static_cast<int32_t>(std::min<int64_t>(pages, INT32_MAX));
}

absl::StatusOr<std::unique_ptr<Qwen3Engine>> Qwen3Engine::create(const std::string& model_dir,
                                                                 const EngineOptions& options,
                                                                 int32_t max_batch,
                                                                 int32_t num_pages) {
  if (options.page_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size must be > 0, got ", options.page_size));
  }
  if (max_batch <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_batch must be > 0, got ", max_batch));
  }
  if (num_pages <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_pages must be > 0, got ", num_pages));
  }
  std::unique_ptr<Qwen3Engine> e(new Qwen3Engine());
  e->options_ = options;
  e->max_batch_ = max_batch;
  e->num_pages_ = num_pages;
  SIMPLER_ASSIGN_OR_RETURN(e->config_, ModelConfig::load(model_dir));
  e->dims_ = dims_of(e->config_);
  SIMPLER_RETURN_IF_ERROR(
      base::annotate(e->dims_.validate(), absl::StrCat(model_dir, "/config.json: ")));
  SIMPLER_ASSIGN_OR_RETURN(ModelWeights weights, ModelWeights::open(model_dir));

  e->worker_ = std::make_unique<worker::Worker>(options.worker);
  e->holder_ = std::make_shared<Holder>();
  std::shared_ptr<Holder> holder = e->holder_;
  SIMPLER_ASSIGN_OR_RETURN(
      e->decode_,
      e->worker_->register_callable(task::ChipCallable{
          "qwen3_decode",
          [holder](task::OrchestrationContext& ctx, const task::TaskArgs& args) {
            return holder->bound.orchestration(ctx, args);
          },
          llm_kernels()}));
  SIMPLER_RETURN_IF_ERROR(e->worker_->init());

  // Weights: f32 in device memory, uploaded once.
  auto upload = [&](const std::string& name,
                    const std::vector<int64_t>& shape) -> absl::StatusOr<Tensor> {
    SIMPLER_ASSIGN_OR_RETURN(TensorView view, weights.get(name, shape));
    SIMPLER_ASSIGN_OR_RETURN(std::vector<float> f32, to_f32(view));
    SIMPLER_ASSIGN_OR_RETURN(worker::DeviceBuffer buf, e->worker_->malloc(f32.size() * 4));
    SIMPLER_RETURN_IF_ERROR(e->worker_->copy_to(buf, f32.data(), f32.size() * 4));
    e->buffers_.push_back(buf);
    return buf.tensor(shape, DataType::kFloat32);
  };
  const Qwen3Dims& d = e->dims_;
  const int64_t H = d.hidden_size, I = d.intermediate_size, V = d.vocab_size;
  Qwen3DeviceWeights w;
  SIMPLER_LOG_INFO("loading {} layers from {}", d.num_hidden_layers, model_dir);
  SIMPLER_ASSIGN_OR_RETURN(w.embed_tokens, upload("model.embed_tokens.weight", {V, H}));
  uint64_t streamed = 0;
  for (int64_t l = 0; l < d.num_hidden_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    Qwen3LayerWeights lw;
    SIMPLER_ASSIGN_OR_RETURN(lw.input_layernorm, upload(p + "input_layernorm.weight", {H}));
    SIMPLER_ASSIGN_OR_RETURN(lw.q_proj, upload(p + "self_attn.q_proj.weight", {d.q_size(), H}));
    SIMPLER_ASSIGN_OR_RETURN(lw.k_proj, upload(p + "self_attn.k_proj.weight", {d.kv_size(), H}));
    SIMPLER_ASSIGN_OR_RETURN(lw.v_proj, upload(p + "self_attn.v_proj.weight", {d.kv_size(), H}));
    SIMPLER_ASSIGN_OR_RETURN(lw.o_proj, upload(p + "self_attn.o_proj.weight", {H, d.q_size()}));
    SIMPLER_ASSIGN_OR_RETURN(lw.q_norm, upload(p + "self_attn.q_norm.weight", {d.head_dim}));
    SIMPLER_ASSIGN_OR_RETURN(lw.k_norm, upload(p + "self_attn.k_norm.weight", {d.head_dim}));
    SIMPLER_ASSIGN_OR_RETURN(lw.post_attention_layernorm,
                             upload(p + "post_attention_layernorm.weight", {H}));
    SIMPLER_ASSIGN_OR_RETURN(lw.gate_proj, upload(p + "mlp.gate_proj.weight", {I, H}));
    SIMPLER_ASSIGN_OR_RETURN(lw.up_proj, upload(p + "mlp.up_proj.weight", {I, H}));
    SIMPLER_ASSIGN_OR_RETURN(lw.down_proj, upload(p + "mlp.down_proj.weight", {H, I}));
    for (const Tensor* t : {&lw.input_layernorm, &lw.q_proj, &lw.k_proj, &lw.v_proj, &lw.o_proj,
                            &lw.q_norm, &lw.k_norm, &lw.post_attention_layernorm, &lw.gate_proj,
                            &lw.up_proj, &lw.down_proj}) {
      streamed += t->span_bytes();
    }
    w.layers.push_back(lw);
  }
  SIMPLER_ASSIGN_OR_RETURN(w.norm, upload("model.norm.weight", {H}));
  streamed += w.norm.span_bytes();
  if (!d.tie_word_embeddings) {
    SIMPLER_ASSIGN_OR_RETURN(w.lm_head, upload("lm_head.weight", {V, H}));
  }
  streamed += w.lm_head_or_embed(d).span_bytes();
  e->weight_bytes_per_step_ = streamed;

  SIMPLER_ASSIGN_OR_RETURN(uint64_t scratch_bytes, qwen3_scratch_bytes(d, max_batch));
  SIMPLER_ASSIGN_OR_RETURN(worker::DeviceBuffer scratch_buf, e->worker_->malloc(scratch_bytes));
  e->buffers_.push_back(scratch_buf);
  SIMPLER_ASSIGN_OR_RETURN(Qwen3Scratch scratch,
                           layout_scratch(d, max_batch, scratch_buf.address));
  SIMPLER_ASSIGN_OR_RETURN(uint64_t kv_bytes,
                           qwen3_kv_pool_bytes(d, num_pages, options.page_size));
  SIMPLER_ASSIGN_OR_RETURN(e->kv_buffer_, e->worker_->malloc(kv_bytes));
  SIMPLER_ASSIGN_OR_RETURN(e->kv_pools_,
                           layout_kv_pools(d, num_pages, options.page_size, e->kv_buffer_.address));
  Qwen3ProgramOptions popts;
  SIMPLER_ASSIGN_OR_RETURN(holder->bound,
                           make_qwen3_decode_callable(d, w, scratch, e->kv_pools_, popts));
  if (holder->bound.kernels.size() != llm_kernels().size()) {
    return absl::InternalError("decode program kernel table differs from llm_kernels()");
  }
  return e;
}

absl::StatusOr<GenerateResult> Qwen3Engine::generate(
    const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& options) {
  const Qwen3Dims& d = dims_;
  if (options.max_new_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens must be >= 1, got ", options.max_new_tokens));
  }
  if (prompts.empty()) return absl::InvalidArgumentError("no requests");
  if (static_cast<int32_t>(prompts.size()) > max_batch_) {
    return absl::InvalidArgumentError(absl::StrCat(prompts.size(), " requests exceed max_batch ",
                                                   max_batch_));
  }
  int64_t max_len = 0;
  for (size_t r = 0; r < prompts.size(); ++r) {
    if (prompts[r].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("request ", r, " has an empty prompt"));
    }
    for (int32_t id : prompts[r]) {
      if (id < 0 || id >= d.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("request ", r, ": token id ", id,
                                                       " outside the vocabulary [0, ",
                                                       d.vocab_size, ")"));
      }
    }
    const int64_t total = static_cast<int64_t>(prompts[r].size()) + options.max_new_tokens;
    if (total > config_.max_position_embeddings) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", r, ": prompt of ", prompts[r].size(), " tokens + ", options.max_new_tokens,
          " new tokens exceeds max_position_embeddings ", config_.max_position_embeddings));
    }
    max_len = std::max(max_len, total);
  }
  const int32_t page_size = options_.page_size;
  const int64_t max_blocks = pages_needed(max_len, page_size);
  SIMPLER_ASSIGN_OR_RETURN(PagePool pool, PagePool::create(num_pages_, page_size));

  struct Req {
    const std::vector<int32_t>* prompt;
    BlockTable table;
    int64_t fed = 0;
    bool finished = false;
    RequestResult out;
  };
  std::vector<Req> reqs;
  reqs.reserve(prompts.size());
  for (size_t r = 0; r < prompts.size(); ++r) {
    reqs.push_back(Req{&prompts[r], BlockTable(r), 0, false, {}});
    reqs.back().out.prompt_ids = prompts[r];
  }

  GenerateResult result;
  GenerateStats& stats = result.stats;
  for (const auto& p : prompts) stats.prompt_tokens += static_cast<int64_t>(p.size());
  const int64_t steps_bound = max_len;
  const int64_t t_start = base::now_ns();
  int64_t t_first_all = 0;
  const int64_t kv_row = d.kv_size();

  std::vector<int32_t> ids, positions, slots, tables, context_lens, logit_rows, out_ids;
  std::vector<float> logits;
  std::vector<size_t> row_req;
  while (true) {
    ids.clear();
    positions.clear();
    slots.clear();
    context_lens.clear();
    logit_rows.clear();
    row_req.clear();
    for (size_t r = 0; r < reqs.size(); ++r) {
      Req& q = reqs[r];
      if (q.finished) continue;
      const int64_t pos = q.fed;
      const int64_t plen = static_cast<int64_t>(q.prompt->size());
      ids.push_back(pos < plen ? (*q.prompt)[pos] : q.out.tokens.back());
      positions.push_back(static_cast<int32_t>(pos));
      auto slot = q.table.append_token(pool);
      if (!slot.ok()) {
        return base::annotate(slot.status(), absl::StrCat("request ", r, " position ", pos, ": "));
      }
      slots.push_back(*slot);
      context_lens.push_back(static_cast<int32_t>(pos + 1));
      if (pos >= plen - 1) logit_rows.push_back(static_cast<int32_t>(row_req.size()));
      row_req.push_back(r);
    }
    if (row_req.empty()) break;
    const int64_t B = static_cast<int64_t>(row_req.size());
    const int64_t n = static_cast<int64_t>(logit_rows.size());
    tables.assign(B * max_blocks, 0);
    for (int64_t i = 0; i < B; ++i) {
      SIMPLER_RETURN_IF_ERROR(reqs[row_req[i]].table.fill_row(&tables[i * max_blocks], max_blocks));
    }
    out_ids.assign(n, -1);
    bool want_logits = false;
    for (int64_t i = 0; i < n; ++i) {
      const Req& q = reqs[row_req[logit_rows[i]]];
      if (options.logits_steps.count(static_cast<int32_t>(q.out.tokens.size()))) want_logits = true;
    }
    Qwen3DecodeRunArgs ra;
    ra.input_ids = host_tensor(ids.data(), {B}, DataType::kInt32);
    ra.positions = host_tensor(positions.data(), {B}, DataType::kInt32);
    ra.slot_mapping = host_tensor(slots.data(), {B}, DataType::kInt32);
    ra.block_tables = host_tensor(tables.data(), {B, max_blocks}, DataType::kInt32);
    ra.context_lens = host_tensor(context_lens.data(), {B}, DataType::kInt32);
    ra.logit_rows = host_tensor(logit_rows.data(), {n}, DataType::kInt32);
    ra.out_ids = host_tensor(out_ids.data(), {n}, DataType::kInt32);
    if (want_logits) {
      logits.assign(n * d.vocab_size, 0.0f);
      ra.out_logits = host_tensor(logits.data(), {n, d.vocab_size}, DataType::kFloat32);
    }
    const int64_t t0 = base::now_ns();
    SIMPLER_ASSIGN_OR_RETURN(worker::RunHandle h, worker_->submit(decode_, ra.to_task_args()));
    SIMPLER_RETURN_IF_ERROR(h.wait());
    const worker::RunResult& rr = h.result();
    stats.step_ms.push_back((base::now_ns() - t0) / 1e6);
    stats.device_step_us.push_back((rr.timing.device_end_ns - rr.timing.device_start_ns) / 1e3);
    ++stats.steps;

    // K/V read-back at requested positions (before any page is released).
    for (int64_t i = 0; i < B; ++i) {
      const int64_t pos = positions[i];
      if (!options.kv_positions.count(pos)) continue;
      RequestResult::Kv kv;
      for (int64_t l = 0; l < d.num_hidden_layers; ++l) {
        std::vector<float> k(kv_row), v(kv_row);
        const uint64_t k_off = kv_pools_.layers[l].k_pool.address - kv_buffer_.address +
                               static_cast<uint64_t>(slots[i]) * kv_row * 4;
        const uint64_t v_off = kv_pools_.layers[l].v_pool.address - kv_buffer_.address +
                               static_cast<uint64_t>(slots[i]) * kv_row * 4;
        SIMPLER_RETURN_IF_ERROR(worker_->copy_from(k.data(), kv_buffer_, kv_row * 4, k_off));
        SIMPLER_RETURN_IF_ERROR(worker_->copy_from(v.data(), kv_buffer_, kv_row * 4, v_off));
        kv.k.push_back(std::move(k));
        kv.v.push_back(std::move(v));
      }
      reqs[row_req[i]].out.kv[pos] = std::move(kv);
    }
    for (int64_t i = 0; i < B; ++i) reqs[row_req[i]].fed++;
    for (int64_t j = 0; j < n; ++j) {
      Req& q = reqs[row_req[logit_rows[j]]];
      const int32_t step = static_cast<int32_t>(q.out.tokens.size());
      if (want_logits && options.logits_steps.count(step)) {
        q.out.logits[step].assign(logits.begin() + j * d.vocab_size,
                                  logits.begin() + (j + 1) * d.vocab_size);
      }
      const int32_t tok = out_ids[j];
      if (tok < 0 || tok >= d.vocab_size) {
        return absl::InternalError(absl::StrCat("decode step produced token id ", tok,
                                                " outside the vocabulary"));
      }
      q.out.tokens.push_back(tok);
      ++stats.generated_tokens;
      const bool stop = options.stop_ids.count(tok) > 0;
      if (stop || static_cast<int32_t>(q.out.tokens.size()) >= options.max_new_tokens) {
        q.finished = true;
        q.out.finish_reason = stop ? "stop" : "length";
        q.out.pages = q.table.pages();
        SIMPLER_RETURN_IF_ERROR(q.table.release(pool));
      }
    }
    if (t_first_all == 0) {
      bool all = true;
      for (const auto& q : reqs) all = all && !q.out.tokens.empty();
      if (all) t_first_all = base::now_ns();
    }
    if (options.progress) options.progress(stats.steps, steps_bound);
  }
  const int64_t t_end = base::now_ns();
  stats.total_ms = (t_end - t_start) / 1e6;
  if (t_first_all == 0) t_first_all = t_end;
  stats.prefill_ms = (t_first_all - t_start) / 1e6;
  stats.decode_ms = (t_end - t_first_all) / 1e6;
  for (auto& q : reqs) result.requests.push_back(std::move(q.out));
  return result;
}

absl::Status Qwen3Engine::close() {
  if (!worker_) return absl::OkStatus();
  return worker_->close();
}

}  // namespace simpler::llm
