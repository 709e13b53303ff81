#include "cli/bench/bench_probes.h"

#include <omp.h>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "dnnl.hpp"
#include "simpler/base/clock.h"
#include "simpler/base/process.h"
#include "simpler/base/status.h"
#include "simpler/base/thread.h"

namespace simpler::cli {
namespace {

// Sums 64-bit words with 8 independent chains (no loop-carried latency): bound by the loads.
// Inlined into one function per target below, so the widest loads the CPU has do the reading.
__attribute__((always_inline)) inline uint64_t sum_words_body(const uint64_t* p, size_t n) {
  uint64_t a[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) a[j] += p[i + j];
  }
  for (; i < n; ++i) a[0] += p[i];
  uint64_t s = 0;
  for (uint64_t v : a) s += v;
  return s;
}
#if defined(__x86_64__)
__attribute__((target("avx512f"))) uint64_t sum_words_avx512(const uint64_t* p, size_t n) {
  return sum_words_body(p, n);
}
__attribute__((target("avx2"))) uint64_t sum_words_avx2(const uint64_t* p, size_t n) {
  return sum_words_body(p, n);
}
#endif
uint64_t sum_words_baseline(const uint64_t* p, size_t n) { return sum_words_body(p, n); }

// The probe's reader for this CPU (picked at the call, not by an ifunc).
uint64_t sum_words(const uint64_t* p, size_t n) {
#if defined(__x86_64__)
  static const int widest = __builtin_cpu_supports("avx512f") ? 2
                            : __builtin_cpu_supports("avx2")  ? 1
                                                              : 0;
  if (widest == 2) return sum_words_avx512(p, n);
  if (widest == 1) return sum_words_avx2(p, n);
#endif
  return sum_words_baseline(p, n);
}

// The first "cpu MHz" of /proc/cpuinfo, GHz (0 when absent).
double cpuinfo_ghz() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("cpu MHz", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    double mhz = 0;
    if (absl::SimpleAtod(line.substr(colon + 1), &mhz)) return mhz / 1e3;
  }
  return 0;
}

}  // namespace

double read_bandwidth_bytes_per_s(size_t bytes, int threads, int passes) {
  if (threads <= 0) threads = base::hardware_threads();
  const size_t words = std::max<size_t>(bytes / 8, 1024);
  std::unique_ptr<uint64_t[]> buf(new uint64_t[words]);
  for (size_t i = 0; i < words; ++i) buf[i] = i;
  double best_s = 1e30;
  std::atomic<uint64_t> sink{0};
  for (int pass = 0; pass < passes; ++pass) {
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        const size_t begin = words * t / threads, end = words * (t + 1) / threads;
        ready.fetch_add(1);
        while (!go.load(std::memory_order_acquire)) {
        }
        sink.fetch_add(sum_words(buf.get() + begin, end - begin), std::memory_order_relaxed);
      });
    }
    while (ready.load() < threads) std::this_thread::yield();
    const int64_t t0 = base::now_ns();
    go.store(true, std::memory_order_release);
    for (std::thread& th : ts) th.join();
    best_s = std::min(best_s, (base::now_ns() - t0) / 1e9);
  }
  if (sink.load() == 42) std::fprintf(stderr, " ");  // keeps the sums
  return static_cast<double>(words * 8) / best_s;
}

TheoreticalPeak theoretical_f32_fma_peak() {
  TheoreticalPeak t;
  t.cores = base::hardware_threads();
  t.ghz = cpuinfo_ghz();
  t.lanes = 4;
  t.fma_ports = 2;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) {
    t.lanes = 16;
    // Zen 4 (AMD family 19h with AVX-512) runs a 512-bit FMA as two 256-bit halves on its two
    // FMA pipes: one 16-lane FMA per cycle.
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(0, &a, &b, &c, &d) != 0 && b == signature_AMD_ebx &&
        __get_cpuid(1, &a, &b, &c, &d) != 0 && ((a >> 8) & 0xf) + ((a >> 20) & 0xff) == 0x19) {
      t.fma_ports = 1;
    }
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    t.lanes = 8;
  }
#endif
  t.flop_per_s = t.cores * t.ghz * 1e9 * t.lanes * t.fma_ports * 2;
  t.formula = absl::StrCat(t.cores, " cores x ", absl::SixDigits(t.ghz), " GHz x ", t.lanes,
                           " f32 lanes x ", t.fma_ports, " FMA ports x 2");
  return t;
}

absl::StatusOr<double> bf16_gemm_library_flops(int64_t rows, const std::vector<GemmShape>& shapes,
                                               int threads, std::string* implementation) {
  using dnnl::memory;
  using Dt = memory::data_type;
  using Tag = memory::format_tag;
  if (threads <= 0) threads = base::hardware_threads();
  // oneDNN's team size for this call; the caller's setting comes back on every return.
  struct OmpThreads {
    int saved = omp_get_max_threads();
    explicit OmpThreads(int n) { omp_set_num_threads(n); }
    ~OmpThreads() { omp_set_num_threads(saved); }
  } omp_threads(threads);
  struct Gemm {
    std::vector<uint16_t> x, w;
    std::vector<float> y;
    dnnl::matmul prim;
    std::unordered_map<int, memory> args;
  };
  std::vector<Gemm> gemms;
  double flop = 0;
  try {
    const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    dnnl::stream stream(engine);
    for (const GemmShape& s : shapes) {
      Gemm g;
      // Values of moderate size (bf16 of 1 + i/256 mod 1), so nothing runs on denormals.
      g.x.resize(static_cast<size_t>(rows * s.k));
      g.w.resize(static_cast<size_t>(s.n * s.k));
      for (size_t i = 0; i < g.x.size(); ++i) g.x[i] = static_cast<uint16_t>(0x3f80 + i % 128);
      for (size_t i = 0; i < g.w.size(); ++i) g.w[i] = static_cast<uint16_t>(0x3c00 + i % 128);
      g.y.resize(static_cast<size_t>(rows * s.n));
      const memory::desc xd({rows, s.k}, Dt::bf16, Tag::ab);
      const memory::desc wd({s.k, s.n}, Dt::bf16, Tag::ba);  // W [n, k] row-major
      const memory::desc yd({rows, s.n}, Dt::f32, Tag::ab);
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(xd, wd, yd), engine);
      if (implementation != nullptr) *implementation = pd.impl_info_str();
      g.prim = dnnl::matmul(pd);
      g.args = {{DNNL_ARG_SRC, memory(xd, engine, g.x.data())},
                {DNNL_ARG_WEIGHTS, memory(wd, engine, g.w.data())},
                {DNNL_ARG_DST, memory(yd, engine, g.y.data())}};
      gemms.push_back(std::move(g));
      flop += 2.0 * static_cast<double>(rows) * static_cast<double>(s.n) * static_cast<double>(s.k);
    }
    double best_s = 1e30;
    for (int pass = 0; pass < 4; ++pass) {  // pass 0 warms up
      const int64_t t0 = base::now_ns();
      for (Gemm& g : gemms) g.prim.execute(stream, g.args);
      stream.wait();
      if (pass > 0) best_s = std::min(best_s, (base::now_ns() - t0) / 1e9);
    }
    return flop / best_s;
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("oneDNN bf16 matmul probe (", rows,
                                            " rows): ", e.what(), " (status ",
                                            static_cast<int>(e.status), ")"));
  }
}

absl::StatusOr<nlohmann::json> run_torch_peer(const std::string& model,
                                              const std::vector<std::string>& args, int threads) {
  const std::string python = "/usr/bin/python3";
  SIMPLER_ASSIGN_OR_RETURN(base::ProcessResult probe,
                           base::run_process({python, "-c", "import torch"}));
  if (!probe.ok()) {
    return absl::FailedPreconditionError(
        "--compare torch needs PyTorch for Debian's python3: apt-get install python3-torch "
        "(scripts/install_deps.sh --bench also installs OpenBLAS for it)");
  }
  const std::string script = std::string(SIMPLER_BENCHMARKS_DIR) + "/torch_qwen3.py";
  std::vector<std::string> argv = {python, script,      "--model",
                                   model,  "--threads", std::to_string(threads)};
  argv.insert(argv.end(), args.begin(), args.end());
  SIMPLER_ASSIGN_OR_RETURN(base::ProcessResult run, base::run_process(argv));
  const std::string& out = run.output;
  if (!run.ok()) {
    return absl::InternalError(
        absl::StrCat(script, " failed (", run.describe(), "): ", out.substr(0, 2000)));
  }
  const size_t line = out.rfind('{');
  nlohmann::json j = nlohmann::json::parse(line == std::string::npos ? "" : out.substr(line),
                                           nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InternalError(
        absl::StrCat(script, " printed no JSON object: ", out.substr(0, 2000)));
  }
  return j;
}

absl::Status add_torch_figures(const std::string& model, const std::vector<std::string>& args,
                               const std::string& their_key, const std::string& out_key,
                               double ours_ms, nlohmann::json* out) {
  SIMPLER_ASSIGN_OR_RETURN(nlohmann::json torch,
                           run_torch_peer(model, args, base::hardware_threads()));
  const auto it = torch.find(their_key);
  if (it == torch.end() || !it->is_number()) {
    return absl::InternalError(absl::StrCat("the PyTorch peer's JSON has no number '", their_key,
                                            "': ", torch.dump().substr(0, 2000)));
  }
  const double torch_ms = it->get<double>();
  (*out)[out_key] = torch_ms;
  (*out)["speedup_vs_torch"] = torch_ms / ours_ms;
  return absl::OkStatus();
}

void print_torch_line(const nlohmann::json& out, const std::string& out_key, int decimals,
                      const char* what) {
  std::printf("  PyTorch eager (f32, %d threads): %.*f ms%s; simpler is %.2fx faster\n",
              base::hardware_threads(), decimals, out[out_key].get<double>(), what,
              out["speedup_vs_torch"].get<double>());
}

uint64_t files_bytes(const std::vector<std::string>& files) {
  uint64_t bytes = 0;
  for (const std::string& f : files) {
    std::error_code ec;
    const uintmax_t size = std::filesystem::file_size(f, ec);
    if (!ec) bytes += size;
  }
  return bytes;
}

uint64_t peak_resident_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;  // kB
  }
  return 0;
}

}  // namespace simpler::cli
