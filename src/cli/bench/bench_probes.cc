#include "cli/bench/bench_probes.h"

#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "dnnl.hpp"
#include "simpler/base/clock.h"
#include "simpler/base/cpu.h"
#include "simpler/base/process.h"
#include "simpler/base/status.h"
#include "simpler/base/thread.h"

namespace simpler::cli {
namespace {

// Sums 64-bit words, 64 bytes a load, 4 independent chains, prefetching (into L2, as the matmul
// tiles do: matmul_tile.h) kPrefetchBytes ahead: the hardware prefetchers stop at 4 KiB page
// boundaries, which a stream of 30-50 GB/s crosses every ~100 ns. Inlined into one function per
// target below, so the widest loads the CPU has do the reading. n is a multiple of 32.
constexpr size_t kPrefetchBytes = 4096;
__attribute__((always_inline)) inline uint64_t sum_words_body(const uint64_t* p, size_t n) {
  uint64_t a[4][8] = {};
  for (size_t i = 0; i < n; i += 32) {
    for (int c = 0; c < 4; ++c) {
      __builtin_prefetch(reinterpret_cast<const char*>(p + i + c * 8) + kPrefetchBytes, 0, 1);
      for (int j = 0; j < 8; ++j) a[c][j] += p[i + c * 8 + j];
    }
  }
  uint64_t s = 0;
  for (const auto& chain : a) {
    for (uint64_t v : chain) s += v;
  }
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

#if defined(__x86_64__) || defined(__aarch64__)
constexpr bool kHasAddChain = true;
// `rounds` x 64 dependent integer adds: 64 cycles a round on every x86-64 and aarch64 core (a
// register add has a latency of one cycle; the loop's counter is a chain of its own, in parallel).
// Each adds the register to itself: an add of an immediate is folded at register renaming on
// Intel's Golden Cove and later cores (a chain of them ran at "17 GHz" on an Emerald Rapids
// Xeon), one of a register's unknown value cannot be.
__attribute__((noinline)) uint64_t add_chain(int64_t rounds) {
  uint64_t x = 1;
  for (int64_t i = 0; i < rounds; ++i) {
#if defined(__x86_64__)
    asm volatile(".rept 64\n\taddq %0, %0\n\t.endr" : "+r"(x));
#else
    asm volatile(".rept 64\n\tadd %0, %0, %0\n\t.endr" : "+r"(x));
#endif
  }
  return x;
}
#else
constexpr bool kHasAddChain = false;
uint64_t add_chain(int64_t) { return 0; }
#endif

// The clock every hardware thread runs at while all of them are busy, GHz: each thread warms up
// on add_chain (2^18 rounds, ~4 ms at 4 GHz, out of any idle state), then times 500 runs of 2^10
// rounds (~16 µs each, shorter than a scheduler's time slice, so on a loaded machine some run
// unpreempted) and keeps the fastest; all threads at once, the mean over the threads. The CPU's
// clock, not the share of it a loaded machine leaves the benchmark. 0 where the target has no add
// chain.
double measured_ghz() {
  if (!kHasAddChain) return 0;
  constexpr int64_t kRounds = int64_t{1} << 10;
  const int threads = base::hardware_threads();
  std::vector<double> ghz(static_cast<size_t>(threads));
  std::atomic<int> ready{0};
  std::atomic<uint64_t> sink{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < threads) {
      }
      sink.fetch_add(add_chain(int64_t{1} << 18), std::memory_order_relaxed);
      int64_t best_ns = INT64_MAX;
      for (int run = 0; run < 500; ++run) {
        const int64_t t0 = base::now_ns();
        sink.fetch_add(add_chain(kRounds), std::memory_order_relaxed);
        best_ns = std::min(best_ns, base::now_ns() - t0);
      }
      ghz[static_cast<size_t>(t)] =
          static_cast<double>(kRounds) * 64 / std::max<int64_t>(best_ns, 1);
    });
  }
  for (std::thread& th : ts) th.join();
  double sum = 0;
  for (double g : ghz) sum += g;
  return sum / threads;
}

}  // namespace

absl::StatusOr<double> read_bandwidth_bytes_per_s(size_t bytes, int threads, int passes) {
  if (threads <= 0) threads = base::hardware_threads();
  // Whole 2 MiB pages (the unit of a transparent huge page), so each thread's slice is a whole
  // number of 256-byte steps.
  constexpr size_t kPage = size_t{2} << 20;
  const size_t mapped = std::max<size_t>((bytes + kPage - 1) / kPage, 1) * kPage;
  // Laid out as the sim device lays out the weights (sim_device.cc): an anonymous mapping advised
  // to use transparent huge pages, so the probe has the TLB reach the kernels have. A 4 KiB-page
  // buffer read 15-20% below what the kernels stream from device memory.
  void* map = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("read-bandwidth probe: cannot map a ", mapped,
                                                     "-byte buffer: ", std::strerror(errno)));
  }
  (void)::madvise(map, mapped, MADV_HUGEPAGE);
  uint64_t* buf = static_cast<uint64_t*>(map);
  const size_t words = mapped / 8;
  auto slice = [&](int t) {
    const size_t steps = words / 32;
    return std::pair<size_t, size_t>{steps * t / threads * 32, steps * (t + 1) / threads * 32};
  };
  {  // Each thread writes its own slice first (the page faults, outside the timing).
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        const auto [begin, end] = slice(t);
        for (size_t i = begin; i < end; ++i) buf[i] = i;
      });
    }
    for (std::thread& th : ts) th.join();
  }
  double best_s = 1e30;
  std::atomic<uint64_t> sink{0};
  for (int pass = 0; pass < passes; ++pass) {
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        const auto [begin, end] = slice(t);
        ready.fetch_add(1);
        while (!go.load(std::memory_order_acquire)) {
        }
        sink.fetch_add(sum_words(buf + begin, end - begin), std::memory_order_relaxed);
      });
    }
    while (ready.load() < threads) std::this_thread::yield();
    const int64_t t0 = base::now_ns();
    go.store(true, std::memory_order_release);
    for (std::thread& th : ts) th.join();
    best_s = std::min(best_s, (base::now_ns() - t0) / 1e9);
  }
  ::munmap(map, mapped);
  if (sink.load() == 42) std::fprintf(stderr, " ");  // keeps the sums
  return static_cast<double>(mapped) / best_s;
}

TheoreticalPeak theoretical_f32_fma_peak() {
  TheoreticalPeak t;
  t.cores = base::hardware_threads();
  t.ghz = measured_ghz();
  t.clock = "measured: dependent integer adds, every hardware thread";
  if (t.ghz <= 0) {
    t.ghz = cpuinfo_ghz();
    t.clock = "/proc/cpuinfo's cpu MHz";
  }
  t.lanes = 4;
  t.fma_ports = 2;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) {
    t.lanes = 16;
    // Zen 4 (AMD family 19h with AVX-512) runs a 512-bit FMA as two 256-bit halves on its two
    // FMA pipes: one 16-lane FMA per cycle. Zen 5 (family 1Ah) has two full 512-bit FMA pipes.
    if (base::amd_cpu_family() == 0x19) t.fma_ports = 1;
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    t.lanes = 8;
  }
#endif
  t.flop_per_s = t.cores * t.ghz * 1e9 * t.lanes * t.fma_ports * 2;
  t.formula = absl::StrCat(t.cores, " cores x ", absl::SixDigits(t.ghz), " GHz (", t.clock, ") x ",
                           t.lanes, " f32 lanes x ", t.fma_ports, " FMA ports x 2");
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
