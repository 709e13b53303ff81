// Machine limits measured in the benchmark's own process, just before the workload they bound,
// so that the benchmark can print its figures as fractions of them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace simpler::cli {

// Read bandwidth in bytes/s: `threads` threads (0 = every hardware thread) each sum their slice
// of one `bytes`-byte buffer (touched first, outside the timing); the best of `passes` passes,
// each timed from the first thread's start to the last one's end. Sized like the data the
// workload reads, it sees the same level of the memory hierarchy (a buffer larger than the last
// level cache measures DRAM).
double read_bandwidth_bytes_per_s(size_t bytes, int threads = 0, int passes = 3);

// The process's peak resident set (VmHWM of /proc/self/status), bytes; 0 when unreadable.
uint64_t peak_resident_bytes();

}  // namespace simpler::cli
