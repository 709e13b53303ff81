#include "simpler/model/qwen3_program.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/qwen3_reference_test_util.h"
#include "simpler/kernels/kernels.h"
#include "simpler/model/make_model.h"

namespace simpler::llm {
namespace {

using task::ArgDirection;
using task::DataType;
using task::TaskArgs;
using task::Tensor;
using ::testing::HasSubstr;
using testing::HostLayer;
using testing::HostModel;
using testing::reference_logits;
using testing::Vec;

// ---- paged KV stand-in ---------------------------------------------------------------

// The KV pool's pages handed out lowest id first and never reused, and one request's block
// table over them: the host side of paged KV these tests need (the engine's PagePool and
// BlockTable do it in serving). Thread-compatible.
class TestPages {
 public:
  TestPages(int64_t num_pages, int64_t page_size) : num_pages_(num_pages), page_size_(page_size) {}
  absl::StatusOr<int32_t> allocate() {
    if (next_ >= num_pages_) return absl::ResourceExhaustedError("no page free");
    return static_cast<int32_t>(next_++);
  }
  int64_t page_size() const { return page_size_; }

 private:
  int64_t num_pages_ = 0, page_size_ = 0, next_ = 0;
};

class TestTable {
 public:
  int64_t context_len() const { return context_len_; }
  const std::vector<int32_t>& pages() const { return pages_; }
  // Appends position context_len() and returns its slot (page · page_size + offset).
  absl::StatusOr<int32_t> append_token(TestPages& pool) {
    const int64_t offset = context_len_ % pool.page_size();
    if (offset == 0) {
      absl::StatusOr<int32_t> page = pool.allocate();
      if (!page.ok()) return page.status();
      pages_.push_back(*page);
    }
    ++context_len_;
    return static_cast<int32_t>(pages_.back() * pool.page_size() + offset);
  }
  absl::StatusOr<int32_t> slot_of(int64_t position, int32_t page_size) const {
    if (position < 0 || position >= context_len_) return absl::OutOfRangeError("position");
    return static_cast<int32_t>(pages_[position / page_size] * page_size + position % page_size);
  }

 private:
  int64_t context_len_ = 0;
  std::vector<int32_t> pages_;
};

// ---- device memory stand-in ---------------------------------------------------------

// One host buffer standing in for device memory (on the sim device a device
// address is a host pointer); bump allocation, 64-byte aligned.
class Arena {
 public:
  explicit Arena(size_t bytes) : mem_(bytes + 64, 0) {
    base_ = (reinterpret_cast<uintptr_t>(mem_.data()) + 63) / 64 * 64;
    capacity_ = bytes;
  }
  uint64_t alloc(uint64_t bytes) {
    const uint64_t off = (used_ + 63) / 64 * 64;
    if (off + bytes > capacity_) {
      std::fprintf(stderr, "test arena too small: %llu + %llu > %llu\n",
                   static_cast<unsigned long long>(off), static_cast<unsigned long long>(bytes),
                   static_cast<unsigned long long>(capacity_));
      std::abort();
    }
    used_ = off + bytes;
    return base_ + off;
  }
  Tensor tensor(std::initializer_list<int64_t> shape, DataType dtype) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return Tensor::contiguous(alloc(n * task::size_of(dtype)), shape, dtype).value();
  }
  uint8_t* data() { return reinterpret_cast<uint8_t*>(base_); }
  uint64_t base() const { return base_; }
  uint64_t size() const { return capacity_; }
  bool contains(uint64_t address, uint64_t bytes) const {
    return address >= base_ && address + bytes <= base_ + capacity_;
  }

 private:
  std::vector<uint8_t> mem_;
  uint64_t base_ = 0;
  uint64_t capacity_ = 0;
  uint64_t used_ = 0;
};

template <typename T>
void upload(const Tensor& t, const std::vector<T>& host) {
  std::memcpy(t.data<T>(), host.data(), host.size() * sizeof(T));
}

// ---- the in-test orchestration context ------------------------------------------------

// Executes each submitted task at once, all blocks in order — valid because
// submission order respects every dependency. In strict mode it also proves
// the task's argument tags exact: before the task every arena byte outside
// its IN / INOUT ranges is overwritten with 0xFF (NaN for f32, -1 for i32),
// after it every byte outside its OUT / INOUT ranges must be unchanged, and
// the bytes it may not write are restored.
class SequentialContext : public task::OrchestrationContext {
 public:
  struct Record {
    std::string kernel;
    TaskArgs args;
    int32_t block_dim;
  };

  SequentialContext(const task::ChipCallable& callable, int32_t cores, Arena* arena, bool strict)
      : callable_(callable), cores_(cores), arena_(arena), strict_(strict) {}

  absl::Status submit(task::KernelIndex kernel, const TaskArgs& args, int32_t block_dim) override {
    if (kernel >= callable_.kernels.size()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown kernel ", kernel));
    }
    if (block_dim < 1) return absl::InvalidArgumentError("block_dim < 1");
    if (absl::Status s = args.validate(); !s.ok()) return s;
    const task::Kernel& k = callable_.kernels[kernel];
    for (size_t i = 0; i < args.size(); ++i) {
      const task::Arg& a = args[i];
      if (a.direction == ArgDirection::kScalar) continue;
      if (!arena_->contains(a.tensor.address, a.tensor.span_bytes())) {
        return absl::InvalidArgumentError(
            absl::StrCat(k.name, " argument ", i, " lies outside device memory"));
      }
    }
    records.push_back({k.name, args, block_dim});
    uint8_t* mem = arena_->data();
    std::vector<Segment> segments;
    if (strict_) {
      snapshot_.assign(mem, mem + arena_->size());  // reuses its buffer from the last task
      segments = segments_of(args);
      for (const Segment& g : segments) {
        if (!g.readable) std::memset(mem + g.begin, 0xFF, g.end - g.begin);
      }
    }
    for (int32_t b = 0; b < block_dim; ++b) {
      task::KernelContext ctx;
      ctx.args = args.args().data();
      ctx.num_args = static_cast<uint32_t>(args.size());
      ctx.block_idx = b;
      ctx.block_dim = block_dim;
      ctx.task_index = static_cast<uint32_t>(records.size() - 1);
      absl::Status s = k.fn(ctx);
      if (!s.ok()) {
        if (strict_) std::memcpy(mem, snapshot_.data(), snapshot_.size());
        return s;
      }
    }
    if (strict_) check_and_restore(segments, k.name);
    return absl::OkStatus();
  }
  int32_t num_cores() const override { return cores_; }
  uint64_t run_id() const override { return 0; }

  std::vector<Record> records;
  std::string stray_writes;

 private:
  // The arena cut at every argument's bounds: within a segment every byte is read (IN / INOUT)
  // or not, written (OUT / INOUT) or not. The checks run on whole segments with memset / memcmp
  // (a loop over the arena's bytes per task was most of this test's time under ASan).
  struct Segment {
    uint64_t begin, end;
    bool readable, writable;
  };
  std::vector<Segment> segments_of(const TaskArgs& args) const {
    std::vector<uint64_t> cuts = {0, arena_->size()};
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i].direction == ArgDirection::kScalar) continue;
      const uint64_t begin = args[i].tensor.address - arena_->base();
      cuts.push_back(begin);
      cuts.push_back(begin + args[i].tensor.span_bytes());
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<Segment> out;
    for (size_t c = 0; c + 1 < cuts.size(); ++c) {
      Segment g{cuts[c], cuts[c + 1], false, false};
      for (size_t i = 0; i < args.size(); ++i) {
        const task::Arg& a = args[i];
        if (a.direction == ArgDirection::kScalar) continue;
        const uint64_t begin = a.tensor.address - arena_->base();
        if (g.begin < begin || g.end > begin + a.tensor.span_bytes()) continue;
        g.readable |= a.direction != ArgDirection::kOut;
        g.writable |= a.direction != ArgDirection::kIn;
      }
      out.push_back(g);
    }
    return out;
  }
  // Every byte the task may not write must hold what it held before the task (its snapshot
  // where the task could read it, 0xFF where not); all of them get their snapshot back.
  void check_and_restore(const std::vector<Segment>& segments, const std::string& kernel_name) {
    uint8_t* mem = arena_->data();
    if (filler_.size() != snapshot_.size()) filler_.assign(snapshot_.size(), 0xFF);
    for (const Segment& g : segments) {
      if (g.writable) continue;
      const uint8_t* want = g.readable ? snapshot_.data() + g.begin : filler_.data();
      const uint64_t n = g.end - g.begin;
      if (stray_writes.empty() && std::memcmp(mem + g.begin, want, n) != 0) {
        uint64_t b = 0;
        while (mem[g.begin + b] == want[b]) ++b;
        stray_writes =
            absl::StrCat("task ", records.size() - 1, " (", kernel_name, ") wrote arena byte ",
                         g.begin + b, " outside its OUT/INOUT ranges");
      }
      std::memcpy(mem + g.begin, snapshot_.data() + g.begin, n);
    }
  }

  const task::ChipCallable& callable_;
  int32_t cores_;
  Arena* arena_;
  bool strict_;
  // Strict mode's copies of the arena's size, kept from task to task: allocated afresh for each
  // task (a megabyte each, thousands of tasks a test), their page faults and fills were most of
  // this test's time.
  std::vector<uint8_t> snapshot_;  // the arena before the task
  std::vector<uint8_t> filler_;    // 0xFF: what a byte the task may not read holds meanwhile
};

// ---- random model and the double-precision reference ------------------------------------

class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  float uniform(float lo, float hi) {
    s_ ^= s_ << 13;
    s_ ^= s_ >> 7;
    s_ ^= s_ << 17;
    return lo + (hi - lo) * static_cast<float>((s_ >> 40) * (1.0 / 16777216.0));
  }
  std::vector<float> vec(size_t n, float lo, float hi) {
    std::vector<float> v(n);
    for (float& x : v) x = uniform(lo, hi);
    return v;
  }
  // Uniform with variance 1/in (keeps activations O(1)).
  std::vector<float> weight(int64_t out, int64_t in) {
    const float a = static_cast<float>(std::sqrt(3.0 / static_cast<double>(in)));
    return vec(out * in, -a, a);
  }

 private:
  uint64_t s_;
};

HostModel random_model(const Qwen3Dims& d, uint64_t seed) {
  Rng rng(seed);
  HostModel m;
  m.dims = d;
  m.embed = rng.vec(d.vocab_size * d.hidden_size, -1.0f, 1.0f);
  m.norm = rng.vec(d.hidden_size, 0.8f, 1.2f);
  if (!d.tie_word_embeddings) m.lm_head = rng.weight(d.vocab_size, d.hidden_size);
  for (int64_t l = 0; l < d.num_hidden_layers; ++l) {
    HostLayer h;
    h.ln1 = rng.vec(d.hidden_size, 0.8f, 1.2f);
    h.wq = rng.weight(d.q_size(), d.hidden_size);
    h.wk = rng.weight(d.kv_size(), d.hidden_size);
    h.wv = rng.weight(d.kv_size(), d.hidden_size);
    h.wo = rng.weight(d.hidden_size, d.q_size());
    h.qn = rng.vec(d.head_dim, 0.8f, 1.2f);
    h.kn = rng.vec(d.head_dim, 0.8f, 1.2f);
    h.ln2 = rng.vec(d.hidden_size, 0.8f, 1.2f);
    h.wg = rng.weight(d.intermediate_size, d.hidden_size);
    h.wu = rng.weight(d.intermediate_size, d.hidden_size);
    h.wd = rng.weight(d.hidden_size, d.intermediate_size);
    m.layers.push_back(std::move(h));
  }
  return m;
}

Qwen3DeviceWeights upload_model(const HostModel& m, Arena& arena) {
  const Qwen3Dims& d = m.dims;
  const DataType f32 = DataType::kFloat32;
  auto put = [&](const std::vector<float>& host, std::initializer_list<int64_t> shape) {
    Tensor t = arena.tensor(shape, f32);
    upload(t, host);
    return t;
  };
  Qwen3DeviceWeights w;
  w.embed_tokens = put(m.embed, {d.vocab_size, d.hidden_size});
  w.norm = put(m.norm, {d.hidden_size});
  if (!d.tie_word_embeddings) w.lm_head = put(m.lm_head, {d.vocab_size, d.hidden_size});
  for (const HostLayer& h : m.layers) {
    Qwen3LayerWeights lw;
    lw.input_layernorm = put(h.ln1, {d.hidden_size});
    lw.q_proj = put(h.wq, {d.q_size(), d.hidden_size});
    lw.k_proj = put(h.wk, {d.kv_size(), d.hidden_size});
    lw.v_proj = put(h.wv, {d.kv_size(), d.hidden_size});
    lw.o_proj = put(h.wo, {d.hidden_size, d.q_size()});
    lw.q_norm = put(h.qn, {d.head_dim});
    lw.k_norm = put(h.kn, {d.head_dim});
    lw.post_attention_layernorm = put(h.ln2, {d.hidden_size});
    lw.gate_proj = put(h.wg, {d.intermediate_size, d.hidden_size});
    lw.up_proj = put(h.wu, {d.intermediate_size, d.hidden_size});
    lw.down_proj = put(h.wd, {d.hidden_size, d.intermediate_size});
    w.layers.push_back(lw);
  }
  return w;
}

double relative_l2(const float* got, const Vec& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// ---- a test fixture: model + scratch + pools + run buffers in one arena -------------------

struct ProgramFixture {
  Qwen3Dims dims;
  HostModel model;
  Arena arena;
  Qwen3DeviceWeights weights;
  Qwen3Scratch scratch;
  Qwen3KvPools pools;
  int64_t max_batch;
  int64_t max_blocks;
  // Run buffers sized for max_batch rows.
  Tensor ids, positions, slots, tables, lens, logit_rows, out_ids, out_logits;

  ProgramFixture(const Qwen3Dims& d, int64_t max_batch_, int64_t num_pages, int64_t page_size,
                 int64_t max_blocks_, uint64_t seed, size_t arena_bytes)
      : dims(d),
        model(random_model(d, seed)),
        arena(arena_bytes),
        max_batch(max_batch_),
        max_blocks(max_blocks_) {
    weights = upload_model(model, arena);
    const uint64_t scratch_bytes = qwen3_scratch_bytes(d, max_batch).value();
    scratch = layout_scratch(d, max_batch, arena.alloc(scratch_bytes)).value();
    const uint64_t pool_bytes = qwen3_kv_pool_bytes(d, num_pages, page_size).value();
    const uint64_t pool_base = arena.alloc(pool_bytes);
    std::memset(reinterpret_cast<void*>(pool_base), 0xFF, pool_bytes);  // NaN: never-written slots
    pools = layout_kv_pools(d, num_pages, page_size, pool_base).value();
    ids = arena.tensor({max_batch}, DataType::kInt32);
    positions = arena.tensor({max_batch}, DataType::kInt32);
    slots = arena.tensor({max_batch}, DataType::kInt32);
    tables = arena.tensor({max_batch, max_blocks}, DataType::kInt32);
    lens = arena.tensor({max_batch}, DataType::kInt32);
    logit_rows = arena.tensor({max_batch}, DataType::kInt32);
    out_ids = arena.tensor({max_batch}, DataType::kInt32);
    out_logits = arena.tensor({max_batch, d.vocab_size}, DataType::kFloat32);
  }

  static Tensor prefix(const Tensor& t, std::initializer_list<int64_t> shape) {
    return Tensor::contiguous(t.address, shape, t.dtype).value();
  }

  // One batch row.
  struct Row {
    int32_t token, position, slot, context_len;
    std::vector<int32_t> pages;
  };

  // Writes the run buffers and returns the run's TaskArgs.
  TaskArgs run_args(const std::vector<Row>& rows, const std::vector<int32_t>& logit_row_ids,
                    bool with_logits, bool with_scalars) {
    const int64_t B = static_cast<int64_t>(rows.size());
    const int64_t n = static_cast<int64_t>(logit_row_ids.size());
    for (int64_t b = 0; b < B; ++b) {
      ids.data<int32_t>()[b] = rows[b].token;
      positions.data<int32_t>()[b] = rows[b].position;
      slots.data<int32_t>()[b] = rows[b].slot;
      lens.data<int32_t>()[b] = rows[b].context_len;
      int32_t* row = tables.data<int32_t>() + b * max_blocks;
      std::fill(row, row + max_blocks, -1);
      std::copy(rows[b].pages.begin(), rows[b].pages.end(), row);
    }
    std::copy(logit_row_ids.begin(), logit_row_ids.end(), logit_rows.data<int32_t>());
    std::fill(out_ids.data<int32_t>(), out_ids.data<int32_t>() + max_batch, -7);
    Qwen3DecodeRunArgs r;
    r.input_ids = prefix(ids, {B});
    r.positions = prefix(positions, {B});
    r.slot_mapping = prefix(slots, {B});
    r.block_tables = prefix(tables, {B, max_blocks});
    r.context_lens = prefix(lens, {B});
    r.logit_rows = prefix(logit_rows, {n});
    r.out_ids = prefix(out_ids, {n});
    if (with_logits) r.out_logits = prefix(out_logits, {n, dims.vocab_size});
    TaskArgs a = r.to_task_args();
    if (!with_scalars) {
      TaskArgs trimmed;
      for (size_t i = 0; i + 2 < a.size(); ++i) trimmed.add_tensor(a[i].tensor, a[i].direction);
      return trimmed;
    }
    return a;
  }
};

Qwen3Dims small_dims(bool tied, int64_t kv_heads) {
  Qwen3Dims d;
  d.hidden_size = 32;
  d.intermediate_size = 48;
  d.num_hidden_layers = 2;
  d.num_attention_heads = 4;
  d.num_key_value_heads = kv_heads;
  d.head_dim = 16;  // != hidden / heads
  d.vocab_size = 97;
  d.rms_norm_eps = 1e-6;
  d.rope_theta = 10000.0;
  d.tie_word_embeddings = tied;
  return d;
}

// Checks the directions of every task of one run.
void expect_well_formed(const std::vector<SequentialContext::Record>& records,
                        const Qwen3KvPools& pools) {
  std::vector<std::pair<uint64_t, uint64_t>> pool_ranges;
  for (const Qwen3KvLayerPool& p : pools.layers) {
    for (const Tensor* t : {&p.k_pool, &p.v_pool}) {
      pool_ranges.push_back({t->address, t->address + t->span_bytes()});
    }
  }
  for (size_t i = 0; i < records.size(); ++i) {
    const auto& r = records[i];
    bool writes = false;
    for (size_t a = 0; a < r.args.size(); ++a) {
      const task::Arg& arg = r.args[a];
      if (arg.direction == ArgDirection::kScalar) continue;
      writes |= arg.direction != ArgDirection::kIn;
      bool touches_pool = false;
      for (const auto& [lo, hi] : pool_ranges) {
        touches_pool |=
            arg.tensor.address < hi && lo < arg.tensor.address + arg.tensor.span_bytes();
      }
      if (!touches_pool) continue;
      if (r.kernel == "kv_write" || r.kernel == "qk_norm_rope_kv") {
        EXPECT_EQ(arg.direction, ArgDirection::kInOut) << "task " << i << " arg " << a;
      } else if (r.kernel == "paged_attention") {
        EXPECT_EQ(arg.direction, ArgDirection::kIn) << "task " << i << " arg " << a;
      } else {
        ADD_FAILURE() << "task " << i << " (" << r.kernel << ") touches a KV pool";
      }
    }
    EXPECT_TRUE(writes) << "task " << i << " (" << r.kernel << ") writes nothing";
  }
}

struct ScenarioParam {
  bool tied;
  int64_t kv_heads;
  int32_t cores;
};

// The harness's own check: a kernel that writes one float past its OUT tensor is reported
// (naming the task and the byte), the byte gets its value back, and a kernel that keeps to its
// OUT range is not reported.
absl::Status copy_four(const task::KernelContext& ctx) {
  const float* in = reinterpret_cast<const float*>(ctx.args[0].tensor.address);
  float* out = reinterpret_cast<float*>(ctx.args[1].tensor.address);
  for (int i = 0; i < 4; ++i) out[i] = in[i];
  return absl::OkStatus();
}
absl::Status copy_four_and_one_past(const task::KernelContext& ctx) {
  (void)copy_four(ctx);
  reinterpret_cast<float*>(ctx.args[1].tensor.address)[4] = 7.0f;
  return absl::OkStatus();
}

TEST(SequentialHarness, AWriteOutsideTheOutRangeIsReportedAndUndone) {
  for (const bool stray : {false, true}) {
    Arena arena(1024);
    const Tensor in = arena.tensor({4}, DataType::kFloat32);
    const Tensor out = arena.tensor({4}, DataType::kFloat32);
    uint8_t* past = arena.data() + (out.address - arena.base()) + 4 * sizeof(float);
    *past = 0x5A;  // the byte the stray kernel overwrites
    task::ChipCallable callable =
        task::one_kernel_callable("copy", stray ? copy_four_and_one_past : copy_four);
    TaskArgs args;
    args.add_tensor(in, ArgDirection::kIn).add_tensor(out, ArgDirection::kOut);
    SequentialContext ctx(callable, 1, &arena, /*strict=*/true);
    ASSERT_TRUE(ctx.submit(0, args, 1).ok());
    if (stray) {
      EXPECT_THAT(ctx.stray_writes, ::testing::HasSubstr("task 0 (copy) wrote arena byte "));
    } else {
      EXPECT_EQ(ctx.stray_writes, "");
    }
    EXPECT_EQ(*past, 0x5A);
  }
}

class Qwen3DecodeScenario : public ::testing::TestWithParam<ScenarioParam> {};

// Three requests of different prompt lengths decode greedily through the
// program, with a padding row in some steps; every logits row matches the
// double-precision full recompute.
TEST_P(Qwen3DecodeScenario, MatchesFullRecomputeReference) {
  const ScenarioParam param = GetParam();
  const Qwen3Dims dims = small_dims(param.tied, param.kv_heads);
  const int64_t page_size = 4, num_pages = 16, max_blocks = 4, max_batch = 4;
  ProgramFixture setup(dims, max_batch, num_pages, page_size, max_blocks, /*seed=*/42, 1 << 20);
  Qwen3ProgramOptions options;
  options.min_rows_per_block = 1;  // force SPMD splits on this tiny model
  options.min_macs_per_block = 1;
  options.min_elems_per_block = 1;
  options.min_attention_macs_per_block = 1;
  auto callable =
      make_qwen3_decode_callable(dims, setup.weights, setup.scratch, setup.pools, options);
  ASSERT_TRUE(callable.ok()) << callable.status();

  TestPages pool(num_pages, page_size);
  ASSERT_TRUE(pool.allocate().ok());  // page 0 never used by the requests
  struct Request {
    std::vector<int32_t> prompt;
    size_t max_new;
    std::vector<int32_t> generated;
    TestTable table;
  };
  Rng rng(7);
  std::vector<Request> requests;
  for (size_t len : {5u, 9u, 2u}) {
    Request r{{}, 4, {}, TestTable()};
    for (size_t i = 0; i < len; ++i) {
      r.prompt.push_back(static_cast<int32_t>(rng.uniform(0, 1) * (dims.vocab_size - 1)));
    }
    requests.push_back(std::move(r));
  }

  int step = 0;
  int checked_rows = 0;
  for (;; ++step) {
    std::vector<ProgramFixture::Row> rows;
    std::vector<size_t> row_request;  // SIZE_MAX for padding
    std::vector<int32_t> logit_rows;
    for (size_t r = 0; r < requests.size(); ++r) {
      Request& q = requests[r];
      if (q.generated.size() >= q.max_new) continue;
      const int64_t p = q.table.context_len();
      const int32_t token = p < static_cast<int64_t>(q.prompt.size())
                                ? q.prompt[p]
                                : q.generated[p - q.prompt.size()];
      const int32_t slot = q.table.append_token(pool).value();
      if (step % 3 == 2 && r == 1) {  // a padding row between requests
        rows.push_back({0, 0, -1, 0, {}});
        row_request.push_back(SIZE_MAX);
      }
      if (p + 1 >= static_cast<int64_t>(q.prompt.size())) {
        logit_rows.push_back(static_cast<int32_t>(rows.size()));
      }
      rows.push_back(
          {token, static_cast<int32_t>(p), slot, static_cast<int32_t>(p + 1), q.table.pages()});
      row_request.push_back(r);
    }
    if (rows.empty()) break;
    const bool with_logits = step % 2 == 0;
    TaskArgs args = setup.run_args(rows, logit_rows, with_logits, /*with_scalars=*/step % 4 == 1);
    SequentialContext ctx(*callable, param.cores, &setup.arena, /*strict=*/true);
    ASSERT_TRUE(callable->orchestration(ctx, args).ok()) << "step " << step;
    EXPECT_EQ(ctx.stray_writes, "");
    EXPECT_EQ(static_cast<int64_t>(ctx.records.size()),
              qwen3_decode_task_count(dims, !logit_rows.empty()));
    expect_well_formed(ctx.records, setup.pools);

    for (size_t j = 0; j < logit_rows.size(); ++j) {
      Request& q = requests[row_request[logit_rows[j]]];
      std::vector<int32_t> seq = q.prompt;
      seq.insert(seq.end(), q.generated.begin(), q.generated.end());
      seq.resize(q.table.context_len());
      const Vec want = reference_logits(setup.model, seq);
      const int32_t id = setup.out_ids.data<int32_t>()[j];
      ASSERT_GE(id, 0);
      ASSERT_LT(id, dims.vocab_size);
      const double ref_max = *std::max_element(want.begin(), want.end());
      EXPECT_NEAR(want[id], ref_max, 1e-4 * (1 + std::abs(ref_max)))
          << "step " << step << " logit row " << j << ": argmax " << id << " is not a maximum";
      if (with_logits) {
        const float* got = setup.out_logits.data<float>() + j * dims.vocab_size;
        EXPECT_LE(relative_l2(got, want), 1e-4) << "step " << step << " logit row " << j;
        const int64_t own_argmax = std::max_element(got, got + dims.vocab_size) - got;
        EXPECT_EQ(id, own_argmax);
      }
      q.generated.push_back(id);
      ++checked_rows;
    }
  }
  EXPECT_EQ(checked_rows, 12);  // 4 tokens for each of the 3 requests
  EXPECT_GE(step, 12);
}

INSTANTIATE_TEST_SUITE_P(Configs, Qwen3DecodeScenario,
                         ::testing::Values(ScenarioParam{false, 1, 1}, ScenarioParam{false, 1, 3},
                                           ScenarioParam{true, 2, 4}),
                         [](const ::testing::TestParamInfo<ScenarioParam>& info) {
                           return absl::StrCat(info.param.tied ? "Tied" : "Untied", "Kv",
                                               info.param.kv_heads, "Cores", info.param.cores);
                         });

// Chunked prefill through the same program: several consecutive positions of
// one request are rows of one run (the program writes every row's K/V before
// any row's attention reads the pool, and each row attends to its own
// context length, so the chunk is causal), next to another request's chunk
// and, later, decode rows. Every logits row matches the full recompute.
TEST(Qwen3ChunkedPrefill, PositionsOfOneRequestInOneRunAttendCausallyWithinTheChunk) {
  const Qwen3Dims dims = small_dims(/*tied=*/false, /*kv_heads=*/2);
  const int64_t page_size = 4, num_pages = 16, max_blocks = 4, chunk = 4;
  ProgramFixture setup(dims, /*max_batch=*/2 * chunk, num_pages, page_size, max_blocks,
                       /*seed=*/11, 1 << 20);
  auto callable = make_qwen3_decode_callable(dims, setup.weights, setup.scratch, setup.pools,
                                             Qwen3ProgramOptions{});
  ASSERT_TRUE(callable.ok()) << callable.status();
  TestPages pool(num_pages, page_size);
  struct Request {
    std::vector<int32_t> prompt;
    std::vector<int32_t> generated;
    TestTable table;
  };
  Rng rng(5);
  std::vector<Request> requests;
  for (size_t len : {9u, 6u}) {
    Request r{{}, {}, TestTable()};
    for (size_t i = 0; i < len; ++i) {
      r.prompt.push_back(static_cast<int32_t>(rng.uniform(0, 1) * (dims.vocab_size - 1)));
    }
    requests.push_back(std::move(r));
  }
  constexpr size_t kMaxNew = 3;
  int steps = 0, checked = 0;
  while (true) {
    std::vector<ProgramFixture::Row> rows;
    std::vector<size_t> row_request;
    std::vector<int32_t> logit_rows;
    for (size_t r = 0; r < requests.size(); ++r) {
      Request& q = requests[r];
      if (q.generated.size() >= kMaxNew) continue;
      const int64_t plen = static_cast<int64_t>(q.prompt.size());
      // Up to `chunk` prompt positions, or one decode position.
      const int64_t first = q.table.context_len();
      const int64_t count = first < plen ? std::min<int64_t>(chunk, plen - first) : 1;
      for (int64_t p = first; p < first + count; ++p) {
        q.table.append_token(pool).value();
      }
      for (int64_t p = first; p < first + count; ++p) {
        const int32_t token = p < plen ? q.prompt[p] : q.generated[p - plen];
        if (p + 1 >= plen) logit_rows.push_back(static_cast<int32_t>(rows.size()));
        rows.push_back({token, static_cast<int32_t>(p),
                        q.table.slot_of(p, static_cast<int32_t>(page_size)).value(),
                        static_cast<int32_t>(p + 1), q.table.pages()});
        row_request.push_back(r);
      }
    }
    if (rows.empty()) break;
    ++steps;
    TaskArgs args = setup.run_args(rows, logit_rows, /*with_logits=*/true, /*with_scalars=*/true);
    SequentialContext ctx(*callable, 2, &setup.arena, /*strict=*/true);
    ASSERT_TRUE(callable->orchestration(ctx, args).ok()) << "step " << steps;
    for (size_t j = 0; j < logit_rows.size(); ++j) {
      const ProgramFixture::Row& row = rows[logit_rows[j]];
      Request& q = requests[row_request[logit_rows[j]]];
      std::vector<int32_t> seq = q.prompt;
      seq.insert(seq.end(), q.generated.begin(), q.generated.end());
      seq.resize(row.context_len);
      const Vec want = reference_logits(setup.model, seq);
      const float* got = setup.out_logits.data<float>() + j * dims.vocab_size;
      EXPECT_LE(relative_l2(got, want), 1e-4) << "step " << steps << " logit row " << j;
      q.generated.push_back(setup.out_ids.data<int32_t>()[j]);
      ++checked;
    }
  }
  // Prompts of 9 and 6 in chunks of 4: 3 and 2 prefill steps (the last chunk
  // yields the first token), then 2 decode steps each.
  EXPECT_EQ(steps, 5);
  EXPECT_EQ(checked, 6);
}

// paged_attention runs as one block while the block tables hold too little context for a
// second block to pay for its hand-off to another core (min_attention_macs_per_block), and
// spreads over the (row, kv head) pairs, at most one block per core, past it.
TEST(Qwen3ProgramBlocks, AttentionSplitsOnlyWhenItsContextIsWorthASecondBlock) {
  const Qwen3Dims dims = small_dims(/*tied=*/false, /*kv_heads=*/2);
  ProgramFixture setup(dims, /*max_batch=*/1, /*num_pages=*/4, /*page_size=*/4, /*max_blocks=*/2,
                       /*seed=*/1, 1 << 20);
  const TaskArgs args = setup.run_args({{1, 0, 1, 1, {0}}}, {0}, false, false);
  for (const int64_t macs : {Qwen3ProgramOptions{}.min_attention_macs_per_block, int64_t{1}}) {
    Qwen3ProgramOptions options;
    options.min_attention_macs_per_block = macs;
    auto callable =
        make_qwen3_decode_callable(dims, setup.weights, setup.scratch, setup.pools, options);
    ASSERT_TRUE(callable.ok()) << callable.status();
    SequentialContext ctx(*callable, /*cores=*/4, &setup.arena, /*strict=*/true);
    ASSERT_TRUE(callable->orchestration(ctx, args).ok());
    int attention = 0;
    for (const auto& r : ctx.records) {
      if (r.kernel != "paged_attention") continue;
      ++attention;
      // One row of 2 kv heads: 2 pairs at most.
      EXPECT_EQ(r.block_dim, macs == 1 ? 2 : 1) << "min_attention_macs_per_block " << macs;
    }
    EXPECT_EQ(attention, dims.num_hidden_layers);
  }
}

// The block counts of one decode's `kernel` tasks, in submission order: a model of `dims` over
// `rows` rows (each at position 0 with one page of its own and every row's logits) whose block
// tables are `width` tokens wide (pages of 16).
std::vector<int32_t> block_dims_of(const std::string& kernel, const Qwen3Dims& dims, int32_t rows,
                                   int64_t width, const Qwen3ProgramOptions& options) {
  constexpr int64_t kPageSize = 16;
  const int64_t pages = std::max<int64_t>(rows, width / kPageSize);
  const uint64_t pool_bytes = qwen3_kv_pool_bytes(dims, pages, kPageSize).value();
  ProgramFixture setup(dims, /*max_batch=*/rows, pages, kPageSize,
                       /*max_blocks=*/width / kPageSize, /*seed=*/1, pool_bytes + (8 << 20));
  std::vector<ProgramFixture::Row> batch;
  std::vector<int32_t> logit_rows;
  for (int32_t b = 0; b < rows; ++b) {
    batch.push_back({1, 0, static_cast<int32_t>(kPageSize) * b, 1, {b}});
    logit_rows.push_back(b);
  }
  const TaskArgs args = setup.run_args(batch, logit_rows, false, false);
  auto callable =
      make_qwen3_decode_callable(dims, setup.weights, setup.scratch, setup.pools, options);
  EXPECT_TRUE(callable.ok()) << callable.status();
  if (!callable.ok()) return {};
  SequentialContext ctx(*callable, /*cores=*/4, &setup.arena, /*strict=*/false);
  EXPECT_TRUE(callable->orchestration(ctx, args).ok());
  std::vector<int32_t> block_dims;
  for (const auto& r : ctx.records) {
    if (r.kernel == kernel) block_dims.push_back(r.block_dim);
  }
  return block_dims;
}

// Where paged_attention's second block starts, at batch 1: once the block tables' width gives it
// as many multiply-adds as the first (2 · heads · head_dim · width ≥ 2 · the minimum), whatever
// the rows' own context lengths.
TEST(Qwen3ProgramBlocks, AttentionTakesASecondBlockAtTwiceTheMinimumOfMultiplyAdds) {
  const auto attention = [](int64_t heads, int64_t head_dim, int64_t width,
                            const Qwen3ProgramOptions& options) {
    Qwen3Dims dims = small_dims(/*tied=*/false, /*kv_heads=*/2);
    dims.num_attention_heads = heads;
    dims.head_dim = head_dim;
    const std::vector<int32_t> block_dims =
        block_dims_of("paged_attention", dims, /*rows=*/1, width, options);
    EXPECT_EQ(block_dims.size(), static_cast<size_t>(dims.num_hidden_layers));
    return block_dims;
  };
  // A minimum of 2^13 over 4 heads of 16 (128 multiply-adds a token): one block's worth at 64
  // tokens; the second block from 128, not at 112.
  Qwen3ProgramOptions options;
  options.min_attention_macs_per_block = int64_t{1} << 13;
  for (const auto& [width, blocks] :
       std::vector<std::pair<int64_t, int32_t>>{{64, 1}, {112, 1}, {128, 2}, {256, 2}}) {
    SCOPED_TRACE(::testing::Message() << "block tables " << width << " tokens wide");
    for (int32_t b : attention(4, 16, width, options)) EXPECT_EQ(b, blocks);
  }
  // The default, at qwen3-0.6b's attention (16 heads of 128: 4,096 a token): one block at tables
  // 16 tokens wide, two from 32 (docs/design/scheduler.md).
  for (const auto& [width, blocks] : std::vector<std::pair<int64_t, int32_t>>{{16, 1}, {32, 2}}) {
    SCOPED_TRACE(::testing::Message() << "qwen3-0.6b heads, tables " << width << " tokens wide");
    for (int32_t b : attention(16, 128, width, {})) EXPECT_EQ(b, blocks);
  }
}

// rms_norm (row-parallel) takes a second block once its rows give it min_elems_per_block
// elements: at the default and qwen3-0.6b's hidden size of 1,024, from 8 rows, not at 4.
TEST(Qwen3ProgramBlocks, RmsNormTakesASecondBlockFromEightRowsOfQwen3Hidden) {
  Qwen3Dims dims = small_dims(/*tied=*/false, /*kv_heads=*/2);
  dims.hidden_size = 1024;
  for (const auto& [rows, blocks] : std::vector<std::pair<int32_t, int32_t>>{{4, 1}, {8, 2}}) {
    SCOPED_TRACE(::testing::Message() << rows << " rows");
    const std::vector<int32_t> block_dims = block_dims_of("rms_norm", dims, rows, 16, {});
    // two a layer and the final norm (over every row's logits: `rows` rows too)
    EXPECT_EQ(block_dims.size(), static_cast<size_t>(2 * dims.num_hidden_layers + 1));
    for (int32_t b : block_dims) EXPECT_EQ(b, blocks);
  }
}

// ---- errors and layouts ---------------------------------------------------------------------

class Qwen3ProgramErrors : public ::testing::Test {
 protected:
  Qwen3ProgramErrors() : setup_(small_dims(false, 1), 2, 4, 4, 2, 1, 1 << 20) {}

  absl::Status run(const TaskArgs& args) {
    auto callable =
        make_qwen3_decode_callable(setup_.dims, setup_.weights, setup_.scratch, setup_.pools);
    EXPECT_TRUE(callable.ok()) << callable.status();
    SequentialContext ctx(*callable, 2, &setup_.arena, false);
    return callable->orchestration(ctx, args);
  }
  ProgramFixture setup_;
};

TEST_F(Qwen3ProgramErrors, BadTokenIdFailsTheRunNamingTheTaskAndId) {
  TaskArgs args = setup_.run_args({{500, 0, 1, 1, {0}}}, {0}, false, false);
  absl::Status s = run(args);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("qwen3 decode embedding: embedding: token id 500 at row 0 is "
                                     "outside the vocabulary [0, 97)"));
}

TEST_F(Qwen3ProgramErrors, RunArgumentErrorsNameTheArgument) {
  TaskArgs good = setup_.run_args({{1, 0, 1, 1, {0}}}, {0}, true, true);
  ASSERT_TRUE(run(good).ok());

  TaskArgs bad_dtype = good;
  bad_dtype[kQwen3Positions].tensor.dtype = DataType::kFloat32;
  absl::Status s = run(bad_dtype);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("run argument 1 (positions) must be a contiguous i32[1]"));

  TaskArgs bad_dir = good;
  bad_dir[kQwen3OutIds].direction = ArgDirection::kIn;
  EXPECT_THAT(run(bad_dir).message(),
              HasSubstr("run argument 6 (out_ids) must be tagged OUT or INOUT, got IN"));

  TaskArgs bad_scalar = good;
  bad_scalar[bad_scalar.size() - 2].scalar = 3;
  EXPECT_THAT(run(bad_scalar).message(),
              HasSubstr("run argument 8 (B = 3) disagrees with the tensor shapes (B = 1)"));

  TaskArgs few;
  for (int i = 0; i < 6; ++i) few.add_tensor(good[i].tensor, good[i].direction);
  EXPECT_THAT(run(few).message(), HasSubstr("at least 7 arguments, got 6"));

  // B above max_batch (2): build views over larger buffers.
  Arena big(1 << 16);
  TaskArgs too_many;
  too_many.add_tensor(big.tensor({3}, DataType::kInt32), ArgDirection::kIn);
  too_many.add_tensor(big.tensor({3}, DataType::kInt32), ArgDirection::kIn);
  too_many.add_tensor(big.tensor({3}, DataType::kInt32), ArgDirection::kIn);
  too_many.add_tensor(big.tensor({3, 2}, DataType::kInt32), ArgDirection::kIn);
  too_many.add_tensor(big.tensor({3}, DataType::kInt32), ArgDirection::kIn);
  too_many.add_tensor(big.tensor({0}, DataType::kInt32), ArgDirection::kIn);
  too_many.add_tensor(big.tensor({0}, DataType::kInt32), ArgDirection::kOut);
  EXPECT_THAT(run(too_many).message(), HasSubstr("batch of 3 rows is outside [1, max_batch 2]"));
}

TEST_F(Qwen3ProgramErrors, PureprefillStepSkipsTheLmHead) {
  TaskArgs args = setup_.run_args({{1, 0, 1, 1, {0}}, {2, 0, 5, 1, {1}}}, {}, false, false);
  auto callable =
      make_qwen3_decode_callable(setup_.dims, setup_.weights, setup_.scratch, setup_.pools);
  ASSERT_TRUE(callable.ok());
  SequentialContext ctx(*callable, 2, &setup_.arena, true);
  ASSERT_TRUE(callable->orchestration(ctx, args).ok());
  EXPECT_EQ(static_cast<int64_t>(ctx.records.size()), qwen3_decode_task_count(setup_.dims, false));
  EXPECT_EQ(ctx.records.back().kernel, "matmul_acc");  // the last layer's down projection
  EXPECT_EQ(setup_.out_ids.data<int32_t>()[0], -7);
}

TEST_F(Qwen3ProgramErrors, ValidateNamesTheBadWeight) {
  Qwen3DeviceWeights w = setup_.weights;
  w.layers[1].k_norm.shape[0] = 8;
  auto c = make_qwen3_decode_callable(setup_.dims, w, setup_.scratch, setup_.pools);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(),
              HasSubstr("Qwen3DeviceWeights.layers[1].k_norm must be a contiguous f32[16] tensor"));
  w = setup_.weights;
  w.layers.pop_back();
  EXPECT_THAT(
      make_qwen3_decode_callable(setup_.dims, w, setup_.scratch, setup_.pools).status().message(),
      HasSubstr("layers has 1 entries, num_hidden_layers is 2"));
  Qwen3Scratch s = setup_.scratch;
  s.up = s.gate;
  EXPECT_THAT(
      make_qwen3_decode_callable(setup_.dims, setup_.weights, s, setup_.pools).status().message(),
      HasSubstr("overlap"));
  Qwen3Dims d = setup_.dims;
  d.num_key_value_heads = 3;
  EXPECT_THAT(d.validate().message(), HasSubstr("num_attention_heads = 4 is not a multiple of "
                                                "num_key_value_heads = 3"));
}

TEST(Qwen3Dims, OverflowingProductsAndFloatsOutsideFloat32AreRefused) {
  Qwen3Dims d = Qwen3Dims::from_config(*preset_config("tiny"));
  ASSERT_TRUE(d.validate().ok());
  d.num_attention_heads = d.num_key_value_heads = d.head_dim = int64_t{1} << 40;
  EXPECT_EQ(d.validate().message(),
            "Qwen3Dims: q_proj of 1099511627776 x 1099511627776 x 128 f32 elements overflows "
            "64-bit byte sizes");
  d = Qwen3Dims::from_config(*preset_config("tiny"));
  d.rope_theta = 1e-300;
  EXPECT_EQ(d.validate().message(),
            "Qwen3Dims.rope_theta = 1e-300 must be positive and normal in float32");
  d = Qwen3Dims::from_config(*preset_config("tiny"));
  d.rms_norm_eps = 1e300;
  EXPECT_EQ(d.validate().message(),
            "Qwen3Dims.rms_norm_eps = 1e+300 must be finite in float32 and >= 0");
}

TEST(Qwen3Layout, ScratchAndPoolsAreAlignedDisjointAndFitTheirBytes) {
  const Qwen3Dims d = Qwen3Dims::from_config(*preset_config("tiny"));
  const uint64_t bytes = qwen3_scratch_bytes(d, 8).value();
  const uint64_t base = 1 << 20;
  Qwen3Scratch s = layout_scratch(d, 8, base).value();
  ASSERT_TRUE(s.validate(d).ok());
  EXPECT_EQ(s.logits.shape[1], d.vocab_size);
  for (const Tensor* t : {&s.hidden, &s.q, &s.logits, &s.act}) {
    EXPECT_EQ(t->address % kQwen3ScratchAlignment, 0u);
    EXPECT_LE(t->address + t->span_bytes(), base + bytes);
  }
  const uint64_t pool_bytes = qwen3_kv_pool_bytes(d, 10, 16).value();
  EXPECT_EQ(pool_bytes, 2u * 2 * 10 * 16 * 2 * 64 * 4);
  Qwen3KvPools pools = layout_kv_pools(d, 10, 16, base).value();
  ASSERT_TRUE(pools.validate(d).ok());
  EXPECT_EQ(pools.num_pages(), 10);
  EXPECT_EQ(pools.page_size(), 16);
  EXPECT_EQ(pools.layers[1].v_pool.address + pools.layers[1].v_pool.span_bytes(),
            base + pool_bytes);
  EXPECT_EQ(qwen3_scratch_bytes(d, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(qwen3_decode_task_count(d, true), 1 + 8 * 2 + 4);
}

// ---- timing of the tiny preset ----------------------------------------------------------------

TEST(Qwen3TinyPreset, DecodeStepTimingInTheSequentialHarness) {
  const Qwen3Dims d = Qwen3Dims::from_config(*preset_config("tiny"));
  const int64_t page_size = 16, num_pages = 8, max_blocks = 8;
  ProgramFixture setup(d, /*max_batch=*/1, num_pages, page_size, max_blocks, 3, 96u << 20);
  auto callable = make_qwen3_decode_callable(d, setup.weights, setup.scratch, setup.pools);
  ASSERT_TRUE(callable.ok()) << callable.status();
  TestPages pool(num_pages, page_size);
  TestTable table;
  auto step = [&](bool logits) {
    const int32_t p = static_cast<int32_t>(table.context_len());
    const int32_t slot = table.append_token(pool).value();
    TaskArgs args =
        setup.run_args({{p % 1000, p, slot, p + 1, table.pages()}},
                       logits ? std::vector<int32_t>{0} : std::vector<int32_t>{}, false, true);
    SequentialContext ctx(*callable, 8, &setup.arena, false);
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = callable->orchestration(ctx, args);
    const auto t1 = std::chrono::steady_clock::now();
    EXPECT_TRUE(s.ok()) << s;
    return std::chrono::duration<double, std::milli>(t1 - t0).count();
  };
  for (int i = 0; i < 3; ++i) step(true);  // warm-up
  std::vector<double> decode, prefill;
  for (int i = 0; i < 20; ++i) prefill.push_back(step(false));
  for (int i = 0; i < 20; ++i) decode.push_back(step(true));
  std::sort(decode.begin(), decode.end());
  std::sort(prefill.begin(), prefill.end());
  std::printf(
      "tiny preset, sequential harness: decode step (n=1) median %.3f ms, min %.3f ms; "
      "prefill step (n=0) median %.3f ms, min %.3f ms\n",
      decode[decode.size() / 2], decode[0], prefill[prefill.size() / 2], prefill[0]);
  RecordProperty("decode_step_median_ms", std::to_string(decode[decode.size() / 2]));
  RecordProperty("prefill_step_median_ms", std::to_string(prefill[prefill.size() / 2]));
  EXPECT_GE(setup.out_ids.data<int32_t>()[0], 0);
  EXPECT_LT(decode[0], 1000.0);  // sanity only; shared CI cores make tight bounds flaky
}

}  // namespace
}  // namespace simpler::llm
