// Machine limits measured in the benchmark's own process, just before the workload they bound,
// so that the benchmark can print its figures as fractions of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace simpler::cli {

// Read bandwidth in bytes/s: `threads` threads (0 = every hardware thread) each sum their slice
// of one buffer of `bytes` rounded up to whole 2 MiB pages, laid out as the sim device lays out
// the weights (an anonymous mapping advised to use transparent huge pages; each slice first
// written by its own thread, outside the timing), with the widest vector loads the CPU has
// (AVX-512, AVX2 or the baseline's) whatever kernel target the benchmark runs: 64-byte loads in
// 4 independent chains, each line prefetched 4 KiB ahead (the hardware prefetchers stop at 4 KiB
// pages; the matmul tiles prefetch too). The best of `passes` passes, each timed from the first
// thread's start to the last one's end. Sized like the data the workload reads, it sees the same
// level of the memory hierarchy (a buffer larger than the last level cache measures DRAM).
// RESOURCE_EXHAUSTED naming the size when the buffer cannot be mapped.
absl::StatusOr<double> read_bandwidth_bytes_per_s(size_t bytes, int threads = 0, int passes = 5);

// The f32 FMA peak this CPU should reach on paper: hardware threads x clock x f32 lanes of its
// widest FMA (16 with AVX-512, 8 with AVX2 + FMA, else 4) x FMA ports (2; 1 for AMD Zen 4's
// 512-bit FMAs) x 2 FLOPs. The clock is measured: every hardware thread at once times short
// chains of dependent integer adds (one cycle each on x86-64 and aarch64 cores) and keeps its
// fastest, so it is the clock the cores run at while all are busy (turbo included, as under the
// FMA probe), not /proc/cpuinfo's nominal one, nor the share of it a loaded machine leaves;
// /proc/cpuinfo's first "cpu MHz" only on other targets. An estimate to hold the
// measured peak against: a measured peak below half of it is said so by the benchmarks. ghz is 0
// (and so flop_per_s) where neither is known. Takes ~10 ms (the clock's measurement).
struct TheoreticalPeak {
  int cores = 0;
  double ghz = 0;
  std::string clock;  // where ghz comes from: "measured: ..." or "/proc/cpuinfo's cpu MHz"
  int lanes = 0;
  int fma_ports = 0;
  double flop_per_s = 0;
  std::string formula;  // "2 cores x 3.95 GHz (measured: ...) x 16 f32 lanes x 2 FMA ports x 2"
};
TheoreticalPeak theoretical_f32_fma_peak();

// One matmul shape: y[rows, n] = x[rows, k] · W[n, k]ᵀ.
struct GemmShape {
  int64_t n = 0;
  int64_t k = 0;
};

// The bf16 GEMM library's rate on `shapes` in FLOP/s (2·rows·n·k per shape): oneDNN's matmul
// (bf16 x and W laid out as the model's weights, f32 y; the implementation oneDNN picks on this
// machine, e.g. AMX, named in `*implementation`) on `threads` OpenMP threads (0 = every hardware
// thread), each shape once per pass, the best of 3 passes after a warm-up pass. The denominator
// of `bench prefill --precision bf16`. INTERNAL with oneDNN's message when it refuses a shape.
absl::StatusOr<double> bf16_gemm_library_flops(int64_t rows, const std::vector<GemmShape>& shapes,
                                               int threads, std::string* implementation);

// Runs benchmarks/torch_qwen3.py (the PyTorch eager peer: f32, `threads` intra-op threads)
// with Debian's /usr/bin/python3 and returns its JSON object. `args` are its mode flags
// ({"--batch", "16", "--steps", "8"} or {"--prompt-len", "512"}), passed without a shell.
// FAILED_PRECONDITION naming the package when python3 cannot import torch; INTERNAL with its
// output when the script fails or cannot be started.
absl::StatusOr<nlohmann::json> run_torch_peer(const std::string& model,
                                              const std::vector<std::string>& args, int threads);

// Adds a row's PyTorch figures to `out` (`bench decode|prefill --compare torch`): the peer's
// milliseconds (its JSON field `their_key`, of run_torch_peer with `args` on every hardware
// thread) as `out_key`, and "speedup_vs_torch", theirs over `ours_ms`. run_torch_peer's errors,
// INTERNAL when its JSON has no number `their_key`.
absl::Status add_torch_figures(const std::string& model, const std::vector<std::string>& args,
                               const std::string& their_key, const std::string& out_key,
                               double ours_ms, nlohmann::json* out);

// Prints a row's PyTorch line from the figures add_torch_figures put in `out` under `out_key`:
// the milliseconds with `decimals` digits and `what` after "ms" (e.g. " per step").
void print_torch_line(const nlohmann::json& out, const std::string& out_key, int decimals,
                      const char* what);

// The summed sizes of `files` (a checkpoint's, llm::model_checkpoint_files), bytes; a file that
// cannot be read counts 0.
uint64_t files_bytes(const std::vector<std::string>& files);

// The process's peak resident set (VmHWM of /proc/self/status), bytes; 0 when unreadable.
uint64_t peak_resident_bytes();

}  // namespace simpler::cli
