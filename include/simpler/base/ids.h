// Identities: runs and generation-checked slots.
#pragma once

#include <cstdint>
#include <string>

namespace simpler::base {

// Identity of one run on one lane: its 0-based submission sequence number.
// A run's full identity adds the generation of the resource set it held
// (worker::RunResult::resource_set). Plain value, thread-compatible.
struct RunId {
  uint64_t value = 0;
  friend bool operator==(RunId a, RunId b) = default;
  friend auto operator<=>(RunId a, RunId b) = default;
};

// Reference to a reusable slot (resource set, mailbox frame, entry). The
// generation increases each time the slot is handed out again; a reference
// whose generation differs from the slot's current one is stale and is refused
// (ARCHITECTURE.md invariant 10).
struct SlotRef {
  uint32_t index = 0;
  uint32_t generation = 0;
  friend bool operator==(SlotRef a, SlotRef b) = default;
};

std::string to_string(RunId id);

}  // namespace simpler::base
