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
// of one `bytes`-byte buffer (touched first, outside the timing); the best of `passes` passes,
// each timed from the first thread's start to the last one's end. Sized like the data the
// workload reads, it sees the same level of the memory hierarchy (a buffer larger than the last
// level cache measures DRAM).
double read_bandwidth_bytes_per_s(size_t bytes, int threads = 0, int passes = 3);

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

// The process's peak resident set (VmHWM of /proc/self/status), bytes; 0 when unreadable.
uint64_t peak_resident_bytes();

}  // namespace simpler::cli
