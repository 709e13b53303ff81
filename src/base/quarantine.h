// The process-wide quarantine of abandoned state.
//
// A device thread stuck in a kernel that never returns cannot be joined (C++
// has no way to stop a thread). Closing such a device abandons the thread
// deliberately (detaches it) and quarantines everything the thread may still
// touch — the device object with its memory, the run records, the callables —
// here, where it stays alive and reachable until the process exits: the
// abandoned thread never reads freed memory, and the leak checker does not
// report it (it is reachable from a global). Program libraries are not
// unloaded while any thread is abandoned (the thread may be running their
// code). The original runtime abandons storage it cannot prove free the same
// way.
//
// Thread-safe. Nothing here is ever destroyed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace simpler::base {

// Keeps `object` alive until the process exits.
void keep_until_exit(std::shared_ptr<const void> object);

// Records that a thread described by `what` (e.g. "sim device 0 core 1, run 3
// task 7") was abandoned.
void note_abandoned_thread(std::string what);

// Threads abandoned so far in this process.
int64_t abandoned_threads();

// Descriptions of the abandoned threads, oldest first.
std::vector<std::string> abandoned_thread_descriptions();

}  // namespace simpler::base
