#include "simpler/llm/engine.h"

#include <algorithm>
#include <deque>

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

// Engine run arguments in front of the decode program's own (qwen3_program.h):
//   0 host_ids  i32 [B] IN    token per row when the host knows it (prompt, host sampling)
//   1 src_rows  i32 [B] IN    >= 0: take the token from last_ids[src_rows[i]] (device feedback)
//   2 last_ids  i32 [max_batch] INOUT  the previous step's sampled tokens, in device memory
//   3...        the decode program's arguments; its input_ids is the engine's feed buffer
constexpr size_t kEngineArgs = 3;

// input_ids[i] = src_rows[i] >= 0 ? last_ids[src_rows[i]] : host_ids[i].
// args: 0 host_ids IN, 1 src_rows IN, 2 last_ids IN, 3 input_ids OUT.
absl::Status token_feedback_kernel(const task::KernelContext& ctx) {
  const int32_t* host = ctx.tensor(0).data<int32_t>();
  const int32_t* src = ctx.tensor(1).data<int32_t>();
  const task::Tensor& last = ctx.tensor(2);
  int32_t* out = ctx.tensor(3).data<int32_t>();
  const int64_t rows = ctx.tensor(3).shape[0];
  for (int64_t i = 0; i < rows; ++i) {
    if (src[i] >= last.shape[0]) {
      return absl::InvalidArgumentError(
          absl::StrCat("token feedback: row ", i, " reads row ", src[i], " of ", last.shape[0]));
    }
    out[i] = src[i] >= 0 ? last.data<int32_t>()[src[i]] : host[i];
  }
  return absl::OkStatus();
}

// last_ids[0..n) = out_ids. args: 0 out_ids IN [n], 1 last_ids OUT [n].
absl::Status token_save_kernel(const task::KernelContext& ctx) {
  const int64_t n = ctx.tensor(0).shape[0];
  std::copy_n(ctx.tensor(0).data<int32_t>(), n, ctx.tensor(1).data<int32_t>());
  return absl::OkStatus();
}

std::vector<task::Kernel> engine_kernels() {
  std::vector<task::Kernel> k = llm_kernels();
  k.push_back({"token_feedback", token_feedback_kernel});
  k.push_back({"token_save", token_save_kernel});
  return k;
}

absl::Status orchestrate_step(const task::ChipCallable& bound, task::OrchestrationContext& ctx,
                              const task::TaskArgs& args) {
  const auto feedback = static_cast<task::KernelIndex>(bound.kernels.size());
  task::TaskArgs program;
  for (size_t i = kEngineArgs; i < args.size(); ++i) program.add(args[i]);
  const task::Tensor& input_ids = program.tensor(kQwen3InputIds);
  task::TaskArgs fb;
  fb.add_tensor(args.tensor(0), task::ArgDirection::kIn)
      .add_tensor(args.tensor(1), task::ArgDirection::kIn)
      .add_tensor(args.tensor(2), task::ArgDirection::kIn)
      .add_tensor(input_ids, task::ArgDirection::kOut);
  SIMPLER_RETURN_IF_ERROR(ctx.submit(feedback, fb));
  SIMPLER_RETURN_IF_ERROR(bound.orchestration(ctx, program));
  const task::Tensor& out_ids = program.tensor(kQwen3OutIds);
  if (out_ids.numel() == 0) return absl::OkStatus();
  task::Tensor last = args.tensor(2);
  last.shape[0] = out_ids.shape[0];
  task::TaskArgs save;
  save.add_tensor(out_ids, task::ArgDirection::kIn).add_tensor(last, task::ArgDirection::kOut);
  return ctx.submit(feedback + 1, save);
}

Tensor host_tensor(const void* data, std::initializer_list<int64_t> shape, DataType dtype) {
  return *Tensor::contiguous(reinterpret_cast<uintptr_t>(data), shape, dtype, MemoryKind::kHost);
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
  e->dims_ = Qwen3Dims::from_config(e->config_);
  SIMPLER_RETURN_IF_ERROR(
      base::annotate(e->dims_.validate(), absl::StrCat(model_dir, "/config.json: ")));
  SIMPLER_ASSIGN_OR_RETURN(ModelWeights weights, ModelWeights::open(model_dir));
  {
    std::set<std::string, std::less<>> expected;
    for (const WeightSpec& spec : e->config_.tensor_names_and_shapes()) expected.insert(spec.name);
    SIMPLER_RETURN_IF_ERROR(weights.check_tensor_set(
        expected,
        absl::StrCat(model_dir, "/config.json (num_hidden_layers ", e->config_.num_hidden_layers,
                     ", tie_word_embeddings ", e->config_.tie_word_embeddings ? "true" : "false",
                     ")"),
        options.allow_unused_tensors));
  }

  e->worker_ = std::make_unique<worker::Worker>(options.worker);
  e->holder_ = std::make_shared<Holder>();
  std::shared_ptr<Holder> holder = e->holder_;
  SIMPLER_ASSIGN_OR_RETURN(
      e->decode_, e->worker_->register_callable(task::ChipCallable{
                      "qwen3_decode",
                      [holder](task::OrchestrationContext& ctx, const task::TaskArgs& args) {
                        return orchestrate_step(holder->bound, ctx, args);
                      },
                      engine_kernels()}));
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
    for (const Tensor* t :
         {&lw.input_layernorm, &lw.q_proj, &lw.k_proj, &lw.v_proj, &lw.o_proj, &lw.q_norm,
          &lw.k_norm, &lw.post_attention_layernorm, &lw.gate_proj, &lw.up_proj, &lw.down_proj}) {
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
  SIMPLER_ASSIGN_OR_RETURN(Qwen3Scratch scratch, layout_scratch(d, max_batch, scratch_buf.address));
  SIMPLER_ASSIGN_OR_RETURN(e->feed_ids_, e->worker_->malloc(max_batch * 4));
  SIMPLER_ASSIGN_OR_RETURN(e->last_ids_, e->worker_->malloc(max_batch * 4));
  SIMPLER_ASSIGN_OR_RETURN(uint64_t kv_bytes, qwen3_kv_pool_bytes(d, num_pages, options.page_size));
  SIMPLER_ASSIGN_OR_RETURN(e->kv_buffer_, e->worker_->malloc(kv_bytes));
  SIMPLER_ASSIGN_OR_RETURN(e->kv_pools_,
                           layout_kv_pools(d, num_pages, options.page_size, e->kv_buffer_.address));
  Qwen3ProgramOptions popts;
  SIMPLER_ASSIGN_OR_RETURN(holder->bound,
                           make_qwen3_decode_callable(d, w, scratch, e->kv_pools_, popts));
  if (holder->bound.kernels.size() != llm_kernels().size()) {
    return absl::InternalError("decode program kernel table differs from llm_kernels()");
  }
  // The decode program reads and writes these buffers without naming them in
  // its arguments: bound, so none is freed while a step may use it.
  for (const worker::DeviceBuffer& b : e->bound_buffers()) {
    SIMPLER_RETURN_IF_ERROR(e->worker_->bind(e->decode_, b));
  }
  return e;
}

std::vector<worker::DeviceBuffer> Qwen3Engine::bound_buffers() const {
  std::vector<worker::DeviceBuffer> out = buffers_;
  out.push_back(feed_ids_);
  out.push_back(last_ids_);
  out.push_back(kv_buffer_);
  return out;
}

void Qwen3Engine::drain_orphans() {
  for (Orphans& o : orphans_) {
    // Their errors are consequences of the failure generate() reported.
    for (const worker::RunHandle& h : o.handles) (void)h.wait();
  }
  orphans_.clear();
}

Qwen3Engine::~Qwen3Engine() { (void)close(); }

absl::StatusOr<GenerateResult> Qwen3Engine::generate(
    const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& options) {
  drain_orphans();
  const Qwen3Dims& d = dims_;
  if (options.max_new_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens must be >= 1, got ", options.max_new_tokens));
  }
  if (prompts.empty()) return absl::InvalidArgumentError("no requests");
  if (static_cast<int32_t>(prompts.size()) > max_batch_) {
    return absl::InvalidArgumentError(
        absl::StrCat(prompts.size(), " requests exceed max_batch ", max_batch_));
  }
  int64_t max_len = 0;
  const int32_t page_size = options_.page_size;
  // Requests that can never fit the KV pool are refused here, before any
  // work; the others are served.
  std::vector<absl::Status> refused(prompts.size());
  for (size_t r = 0; r < prompts.size(); ++r) {
    if (prompts[r].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("request ", r, " has an empty prompt"));
    }
    for (int32_t id : prompts[r]) {
      if (id < 0 || id >= d.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "request ", r, ": token id ", id, " outside the vocabulary [0, ", d.vocab_size, ")"));
      }
    }
    const int64_t total = static_cast<int64_t>(prompts[r].size()) + options.max_new_tokens;
    if (total > config_.max_position_embeddings) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", r, ": prompt of ", prompts[r].size(), " tokens + ", options.max_new_tokens,
          " new tokens exceeds max_position_embeddings ", config_.max_position_embeddings));
    }
    const int64_t need = pages_needed(total, page_size);
    if (need > num_pages_) {
      refused[r] = absl::ResourceExhaustedError(absl::StrCat(
          "request ", r, " can never fit the KV cache: its prompt of ", prompts[r].size(),
          " tokens + ", options.max_new_tokens, " new tokens needs ", need, " pages of ", page_size,
          " tokens, and the pool holds ", num_pages_, " pages"));
      continue;
    }
    max_len = std::max(max_len, total);
  }
  const int64_t max_blocks = std::max<int64_t>(1, pages_needed(max_len, page_size));
  SIMPLER_ASSIGN_OR_RETURN(PagePool pool, PagePool::create(num_pages_, page_size));

  // Host-side feedback (host sampling) needs each step's logits on the host
  // before the next step: serial launch. Otherwise the next step reads the
  // previous step's tokens from device memory and up to launch_depth steps
  // are in flight.
  const bool serial = options.host_sampling;
  const int32_t depth = serial ? 1 : options_.worker.launch_depth;
  GenerateResult result;
  GenerateStats& stats = result.stats;
  stats.requested_depth = options_.worker.launch_depth;
  stats.serial_launch = serial;
  if (serial && options_.worker.launch_depth > 1) {
    SIMPLER_LOG_WARN(
        "decode: host sampling needs each step's logits on the host first; falling back to "
        "serial launch (effective depth 1, requested {})",
        options_.worker.launch_depth);
  }

  struct Req {
    const std::vector<int32_t>* prompt;
    BlockTable table;
    int64_t submitted = 0;        // positions submitted
    int32_t produced = 0;         // logit rows submitted (tokens that will exist)
    int32_t prev_logit_row = -1;  // its logit row in the latest submitted step
    int32_t inflight = 0;         // submitted steps not yet processed
    bool finished = false;        // known on the host
    bool released = false;
    RequestResult out;
  };
  std::vector<Req> reqs;
  reqs.reserve(prompts.size());
  for (size_t r = 0; r < prompts.size(); ++r) {
    reqs.push_back(Req{&prompts[r], BlockTable(r), 0, 0, -1, 0, false, false, {}});
    Req& q = reqs.back();
    q.out.prompt_ids = prompts[r];
    if (!refused[r].ok()) {
      q.finished = q.released = true;
      q.out.finish_reason = "error";
      q.out.status = refused[r];
      continue;
    }
    stats.prompt_tokens += static_cast<int64_t>(prompts[r].size());
  }

  // One submitted step: its host arguments live here until it is processed.
  struct Step {
    worker::RunHandle handle;
    std::vector<int32_t> host_ids, src_rows, positions, slots, tables, context_lens, logit_rows;
    std::vector<int32_t> out_ids;
    std::vector<float> logits;
    std::vector<size_t> row_req;
    bool want_logits = false;
    int64_t submit_ns = 0;
  };
  std::deque<Step> inflight;
  // On every exit, error paths included, wait for the steps still in flight:
  // their host buffers live in `inflight` until they finalize.
  struct DrainInflight {
    std::deque<Step>& steps;
    ~DrainInflight() {
      for (auto& st : steps) {
        if (st.handle.valid()) (void)st.handle.wait();
      }
    }
  } drain{inflight};
  const int64_t t_start = base::now_ns();
  int64_t t_first_all = 0;
  int64_t effective_depth_sum = 0;
  const int64_t kv_row = d.kv_size();

  auto submit_step = [&]() -> absl::StatusOr<bool> {
    Step st;
    for (size_t r = 0; r < reqs.size(); ++r) {
      Req& q = reqs[r];
      const int64_t plen = static_cast<int64_t>(q.prompt->size());
      // Positions 0 .. plen + N - 2 are fed; the last generated token is not.
      if (q.finished || q.submitted > plen + options.max_new_tokens - 2) continue;
      const int64_t pos = q.submitted;
      if (pos < plen) {
        st.host_ids.push_back((*q.prompt)[pos]);
        st.src_rows.push_back(-1);
      } else if (serial) {
        st.host_ids.push_back(q.out.tokens.back());
        st.src_rows.push_back(-1);
      } else {
        st.host_ids.push_back(0);
        st.src_rows.push_back(q.prev_logit_row);  // token from the previous step, on the device
      }
      st.positions.push_back(static_cast<int32_t>(pos));
      auto slot = q.table.append_token(pool);
      if (!slot.ok()) {
        return base::annotate(slot.status(), absl::StrCat("request ", r, " position ", pos, ": "));
      }
      st.slots.push_back(*slot);
      st.context_lens.push_back(static_cast<int32_t>(pos + 1));
      q.prev_logit_row = -1;
      if (pos >= plen - 1) {
        q.prev_logit_row = static_cast<int32_t>(st.logit_rows.size());
        st.logit_rows.push_back(static_cast<int32_t>(st.row_req.size()));
        if (options.logits_steps.count(q.produced)) st.want_logits = true;
        ++q.produced;
      }
      ++q.submitted;
      ++q.inflight;
      st.row_req.push_back(r);
    }
    if (st.row_req.empty()) return false;
    const int64_t B = static_cast<int64_t>(st.row_req.size());
    const int64_t n = static_cast<int64_t>(st.logit_rows.size());
    st.tables.assign(B * max_blocks, 0);
    for (int64_t i = 0; i < B; ++i) {
      SIMPLER_RETURN_IF_ERROR(
          reqs[st.row_req[i]].table.fill_row(&st.tables[i * max_blocks], max_blocks));
    }
    st.out_ids.assign(n, -1);
    if (serial || st.want_logits) st.logits.assign(n * d.vocab_size, 0.0f);
    task::TaskArgs a;
    a.add_tensor(host_tensor(st.host_ids.data(), {B}, DataType::kInt32), task::ArgDirection::kIn)
        .add_tensor(host_tensor(st.src_rows.data(), {B}, DataType::kInt32), task::ArgDirection::kIn)
        .add_tensor(*last_ids_.tensor({max_batch_}, DataType::kInt32), task::ArgDirection::kInOut);
    Qwen3DecodeRunArgs ra;
    ra.input_ids = *feed_ids_.tensor({B}, DataType::kInt32);
    ra.positions = host_tensor(st.positions.data(), {B}, DataType::kInt32);
    ra.slot_mapping = host_tensor(st.slots.data(), {B}, DataType::kInt32);
    ra.block_tables = host_tensor(st.tables.data(), {B, max_blocks}, DataType::kInt32);
    ra.context_lens = host_tensor(st.context_lens.data(), {B}, DataType::kInt32);
    ra.logit_rows = host_tensor(st.logit_rows.data(), {n}, DataType::kInt32);
    ra.out_ids = host_tensor(st.out_ids.data(), {n}, DataType::kInt32);
    if (!st.logits.empty()) {
      ra.out_logits = host_tensor(st.logits.data(), {n, d.vocab_size}, DataType::kFloat32);
    }
    const task::TaskArgs program = ra.to_task_args();
    for (size_t i = 0; i < program.size(); ++i) a.add(program[i]);
    st.submit_ns = base::now_ns();
    SIMPLER_ASSIGN_OR_RETURN(st.handle, worker_->submit(decode_, a));
    inflight.push_back(std::move(st));
    ++stats.steps;
    stats.max_steps_in_flight =
        std::max(stats.max_steps_in_flight, static_cast<int32_t>(inflight.size()));
    return true;
  };

  auto process_step = [&]() -> absl::Status {
    Step& st = inflight.front();
    SIMPLER_RETURN_IF_ERROR(st.handle.wait());
    const worker::RunResult& rr = st.handle.result();
    stats.step_ms.push_back((base::now_ns() - st.submit_ns) / 1e6);
    stats.device_step_us.push_back((rr.timing.device_end_ns - rr.timing.device_start_ns) / 1e3);
    effective_depth_sum += rr.effective_depth;
    const int64_t B = static_cast<int64_t>(st.row_req.size());
    for (int64_t i = 0; i < B; ++i) {
      Req& q = reqs[st.row_req[i]];
      --q.inflight;
      const int64_t pos = st.positions[i];
      if (q.finished || !options.kv_positions.count(pos)) continue;
      // K/V read back from the page pool (before any page is released).
      RequestResult::Kv kv;
      for (int64_t l = 0; l < d.num_hidden_layers; ++l) {
        std::vector<float> k(kv_row), v(kv_row);
        const uint64_t row_off = static_cast<uint64_t>(st.slots[i]) * kv_row * 4;
        const uint64_t k_off = kv_pools_.layers[l].k_pool.address - kv_buffer_.address + row_off;
        const uint64_t v_off = kv_pools_.layers[l].v_pool.address - kv_buffer_.address + row_off;
        SIMPLER_RETURN_IF_ERROR(worker_->copy_from(k.data(), kv_buffer_, kv_row * 4, k_off));
        SIMPLER_RETURN_IF_ERROR(worker_->copy_from(v.data(), kv_buffer_, kv_row * 4, v_off));
        kv.k.push_back(std::move(k));
        kv.v.push_back(std::move(v));
      }
      q.out.kv[pos] = std::move(kv);
    }
    for (size_t j = 0; j < st.logit_rows.size(); ++j) {
      Req& q = reqs[st.row_req[st.logit_rows[j]]];
      if (q.finished) continue;  // an extra step behind a stop: discarded
      const int32_t step = static_cast<int32_t>(q.out.tokens.size());
      int32_t tok = st.out_ids[j];
      if (!st.logits.empty()) {
        const float* row = st.logits.data() + j * d.vocab_size;
        if (options.logits_steps.count(step)) q.out.logits[step].assign(row, row + d.vocab_size);
        if (serial) {  // host sampling: greedy over the host's logits, lowest index on ties
          tok = static_cast<int32_t>(std::max_element(row, row + d.vocab_size) - row);
        }
      }
      if (tok < 0 || tok >= d.vocab_size) {
        return absl::InternalError(
            absl::StrCat("decode run ", st.handle.id().value, " produced token id ", tok,
                         " for request ", st.row_req[st.logit_rows[j]], " (generated token ", step,
                         ") outside the vocabulary [0, ", d.vocab_size, ")"));
      }
      q.out.tokens.push_back(tok);
      ++stats.generated_tokens;
      const bool stop = options.stop_ids.count(tok) > 0;
      if (stop || static_cast<int32_t>(q.out.tokens.size()) >= options.max_new_tokens) {
        q.finished = true;
        q.out.finish_reason = stop ? "stop" : "length";
        q.out.pages = q.table.pages();
      }
    }
    // Pages go back only after the last step that reads them was processed.
    for (auto& q : reqs) {
      if (q.finished && !q.released && q.inflight == 0) {
        SIMPLER_RETURN_IF_ERROR(q.table.release(pool));
        q.released = true;
      }
    }
    inflight.pop_front();
    if (t_first_all == 0) {
      bool all = true;
      for (const auto& q : reqs) all = all && (!q.out.status.ok() || !q.out.tokens.empty());
      if (all) t_first_all = base::now_ns();
    }
    if (options.progress) options.progress(stats.steps, max_len);
    return absl::OkStatus();
  };

  absl::Status failure;
  while (true) {
    absl::StatusOr<bool> submitted = submit_step();
    if (!submitted.ok()) {
      // Refused because a step in flight poisoned the lane: that step's own
      // error (and code) is the one to report, whichever noticed first.
      failure = worker::poison_cause(submitted.status(),
                                     [&](uint64_t run) -> std::optional<worker::RunHandle> {
                                       for (const Step& st : inflight) {
                                         if (st.handle.id().value == run) return st.handle;
                                       }
                                       return std::nullopt;
                                     });
      break;
    }
    if (!*submitted && inflight.empty()) break;
    if (!*submitted || static_cast<int32_t>(inflight.size()) >= depth) {
      failure = process_step();
      if (!failure.ok()) break;
    }
  }
  if (!failure.ok()) {
    // The error is known: report it now, without waiting for the steps still
    // in flight (they consumed the failed step's tokens, or sit behind a
    // poisoned lane, or a hung step). They are kept, with the host buffers
    // they stage into, until drained: by the next generate(), or cancelled at
    // once by close(deadline) on a fatal path.
    Orphans o;
    for (const Step& st : inflight) o.handles.push_back(st.handle);
    o.owner = std::make_shared<std::deque<Step>>(std::move(inflight));
    inflight.clear();
    orphans_.push_back(std::move(o));
    return failure;
  }
  const int64_t t_end = base::now_ns();
  stats.total_ms = (t_end - t_start) / 1e6;
  if (t_first_all == 0) t_first_all = t_end;
  stats.prefill_ms = (t_first_all - t_start) / 1e6;
  stats.decode_ms = (t_end - t_first_all) / 1e6;
  stats.effective_depth =
      stats.steps > 0 ? static_cast<double>(effective_depth_sum) / stats.steps : 0;
  for (auto& q : reqs) result.requests.push_back(std::move(q.out));
  return result;
}

absl::Status Qwen3Engine::close(const base::Deadline& deadline) {
  if (!worker_) return absl::OkStatus();
  absl::Status s = worker_->close(deadline);
  drain_orphans();  // finalized by the close: their buffers can go
  return s;
}

}  // namespace simpler::llm
