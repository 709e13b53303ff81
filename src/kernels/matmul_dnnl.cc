// The bf16 path's GEMM for batched rows (matmul_impl.h, run_dnnl_bf16) through oneDNN (Debian
// libdnnl-dev, 2.x API): a oneDNN reorder rounds x to bf16 (round to nearest even), a oneDNN
// matmul multiplies it by the bf16 W slice into a dense f32 buffer (AMX where the CPU has it
// and the kernel grants it, else AVX512_BF16 dot products; oneDNN chooses and asks the kernel
// itself), and the buffer is stored into (or added to) y's columns.
//
// Threads: each call runs on the SPMD block's own thread with OpenMP limited to that thread
// for the call (the device's cores are the parallelism; an OpenMP team per block would
// oversubscribe the CPUs), with a per-thread engine, stream and user-managed scratchpad, so
// calls on different core threads share no mutable state (oneDNN's primitive cache is
// thread-safe and makes repeated shapes cheap to set up).
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <dnnl.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/matmul_impl.h"

namespace simpler::llm::matmul_detail {
namespace {

using dnnl::memory;
using Dt = memory::data_type;
using Tag = memory::format_tag;

// One thread's oneDNN objects and buffers, reused across calls.
struct ThreadState {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::vector<uint16_t> x_bf16;
  std::vector<float> y_dense;
  std::vector<uint8_t> scratchpad;
};

ThreadState& thread_state() {
  thread_local ThreadState state;
  return state;
}

// OpenMP limited to the calling thread for one scope (restores the thread's setting).
class OneOmpThread {
 public:
  OneOmpThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneOmpThread() { omp_set_num_threads(saved_); }
  OneOmpThread(const OneOmpThread&) = delete;
  OneOmpThread& operator=(const OneOmpThread&) = delete;

 private:
  int saved_;
};

dnnl::primitive_attr user_scratchpad() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

memory scratch_memory(ThreadState& s, const memory::desc& d) {
  if (s.scratchpad.size() < d.get_size()) s.scratchpad.resize(d.get_size());
  return memory(d, s.engine, s.scratchpad.data());
}

}  // namespace

absl::Status run_dnnl_bf16(const Problem& p) {
  if (p.wt != WeightType::kBF16) {
    return absl::InternalError("run_dnnl_bf16 takes bf16 weights");
  }
  ThreadState& s = thread_state();
  try {
    OneOmpThread one_thread;
    const memory::desc x_f32({p.rows, p.k}, Dt::f32, Tag::ab);
    const memory::desc x_bf16({p.rows, p.k}, Dt::bf16, Tag::ab);
    // W is [n, k] row-major: the [k, n] weights operand with strides (1, k).
    const memory::desc w_bf16({p.k, p.n}, Dt::bf16, Tag::ba);
    const memory::desc y_f32({p.rows, p.n}, Dt::f32, Tag::ab);
    const dnnl::primitive_attr attr = user_scratchpad();
    s.x_bf16.resize(static_cast<size_t>(p.rows * p.k));
    s.y_dense.resize(static_cast<size_t>(p.rows * p.n));
    memory x_in(x_f32, s.engine, const_cast<float*>(p.x));
    memory x_mem(x_bf16, s.engine, s.x_bf16.data());
    memory w_mem(w_bf16, s.engine, const_cast<void*>(p.w));
    memory y_mem(y_f32, s.engine, s.y_dense.data());

    const dnnl::reorder::primitive_desc to_bf16(s.engine, x_f32, s.engine, x_bf16, attr);
    dnnl::reorder(to_bf16).execute(
        s.stream, {{DNNL_ARG_FROM, x_in},
                   {DNNL_ARG_TO, x_mem},
                   {DNNL_ARG_SCRATCHPAD, scratch_memory(s, to_bf16.scratchpad_desc())}});
    const dnnl::matmul::primitive_desc gemm(dnnl::matmul::desc(x_bf16, w_bf16, y_f32), attr,
                                            s.engine);
    dnnl::matmul(gemm).execute(s.stream,
                               {{DNNL_ARG_SRC, x_mem},
                                {DNNL_ARG_WEIGHTS, w_mem},
                                {DNNL_ARG_DST, y_mem},
                                {DNNL_ARG_SCRATCHPAD, scratch_memory(s, gemm.scratchpad_desc())}});
    s.stream.wait();
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("oneDNN bf16 matmul [", p.rows, " x ", p.k, "] x [",
                                            p.k, " x ", p.n, "]: ", e.what(), " (status ",
                                            static_cast<int>(e.status), ")"));
  }
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* src = s.y_dense.data() + r * p.n;
    float* dst = p.y + r * p.ldy;
    if (p.accumulate) {
      for (int64_t j = 0; j < p.n; ++j) dst[j] += src[j];
    } else {
      std::memcpy(dst, src, static_cast<size_t>(p.n) * sizeof(float));
    }
  }
  return absl::OkStatus();
}

std::string dnnl_bf16_implementation() {
  try {
    OneOmpThread one_thread;
    const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    const memory::desc x({64, 256}, Dt::bf16, Tag::ab);
    const memory::desc w({256, 64}, Dt::bf16, Tag::ba);
    const memory::desc y({64, 64}, Dt::f32, Tag::ab);
    const dnnl::matmul::primitive_desc gemm(dnnl::matmul::desc(x, w, y), user_scratchpad(), engine);
    return gemm.impl_info_str();
  } catch (const dnnl::error& e) {
    return absl::StrCat("unavailable (", e.what(), ")");
  }
}

}  // namespace simpler::llm::matmul_detail
