// What crosses the mailbox for one run: the callable's registered name, its CallConfig and its
// TaskArgs, encoded as a versioned little-endian byte string that fits one request frame. A
// callable crosses by name (registered in both processes before the fork), never as a closure.
// HOST tensors must lie in memory the child maps at the same address (shared host buffers
// mapped before the fork); DEVICE tensors are the child's device addresses.
//
// Format (version 1; every integer little-endian):
//   u32 magic "SRRQ" | u16 version | u16 name bytes | name
//   i32 max_cores | f64 timeout_s | u8 placement | u8 task_timing
//   u32 argument count, then per argument:
//     u8 direction | u8 memory | u8 dtype | u8 rank | u64 address | u64 scalar
//     rank x i64 shape | rank x i64 strides
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "simpler/task/call_config.h"
#include "simpler/task/task_args.h"

namespace simpler::hierarchy {

inline constexpr uint32_t kRunRequestMagic = 0x51525253;  // "SRRQ" in memory order
inline constexpr uint16_t kRunRequestVersion = 1;
inline constexpr size_t kMaxCallableNameBytes = 255;

struct RunRequest {
  std::string callable;  // the registered name
  task::CallConfig config;
  task::TaskArgs args;
};

// INVALID_ARGUMENT for an empty name or one longer than kMaxCallableNameBytes; the arguments
// and config must already be valid (Worker::submit checks them again in the child).
absl::StatusOr<std::vector<uint8_t>> encode_run_request(const RunRequest& request);
// Decodes bytes a peer wrote: every length is checked against the bytes left before it is used,
// every enum against its range, every argument with task::validate_arg, the config with
// CallConfig::validate. INVALID_ARGUMENT naming the first problem and its byte offset.
absl::StatusOr<RunRequest> decode_run_request(std::span<const uint8_t> bytes);

}  // namespace simpler::hierarchy
