// Properties of the calling thread: name, timer precision, CPU affinity.
#pragma once

#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace simpler::base {

// Names the calling thread for debuggers, `top -H` and /proc (Linux keeps the
// first 15 bytes). Best effort.
void set_thread_name(const std::string& name);
// Names `thread` (a started std::thread) from another thread: the name holds once this returns,
// before the thread has run anything.
void set_thread_name(std::thread& thread, const std::string& name);

// Asks the kernel to fire this thread's timed waits within ~1 µs of their
// deadline instead of the default 50 µs timer slack (Linux PR_SET_TIMERSLACK;
// no effect elsewhere). For threads that sleep until a predicted moment.
// Best effort: failures are ignored.
void use_precise_timers();

// Hardware threads of this machine (std::thread::hardware_concurrency), at least 1: the default
// width of the sim device and of the benchmarks' probes.
int hardware_threads();

// The CPUs the calling thread may run on (sched_getaffinity), ascending.
// INTERNAL with errno's text when the kernel refuses.
absl::StatusOr<std::vector<int>> allowed_cpus();

// Restricts the calling thread (and threads it creates later) to `cpus`.
// INVALID_ARGUMENT when check_cpus fails or the kernel refuses the mask (e.g.
// none of `cpus` is in the process's cpuset), with errno's text.
absl::Status pin_this_thread(const std::vector<int>& cpus);

// OK when `cpus` is non-empty and every entry is a CPU of this machine
// (0 <= cpu < configured CPUs); INVALID_ARGUMENT naming the bad entry.
// Whether the process's cpuset admits it is known only when pinning.
absl::Status check_cpus(const std::vector<int>& cpus);

}  // namespace simpler::base
