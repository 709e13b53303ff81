#include "engine/weight_upload.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <span>
#include <string>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "simpler/base/status.h"
#include "simpler/base/thread.h"

namespace simpler::llm {

namespace {

// Bytes of the host buffer a raw weight passes through on its way from the file into device
// memory: small enough to stay in the core's L2 cache between the read that fills it and the
// copy that empties it, large enough that the sim device populates each copy's destination
// pages in one call (copies of 1 MiB and more).
constexpr uint64_t kStagingBytes = 1u << 20;

// The raw weights of one share, copied from their files into `buf` through one reused host
// buffer. `stop` is shared by the two shares: set by the one that fails, and read before each
// chunk by both (relaxed: a hint only; the statuses are read after the join). Returns OK when it
// stopped for the other share's failure (that share returns the error).
absl::Status copy_raw_weights(worker::Worker& w, const worker::DeviceBuffer& buf,
                              const std::vector<const WeightSlot*>& share,
                              std::atomic<bool>& stop) {
  std::vector<std::byte> staging(kStagingBytes);
  for (const WeightSlot* s : share) {
    for (uint64_t at = 0; at < s->bytes; at += kStagingBytes) {
      if (stop.load(std::memory_order_relaxed)) return absl::OkStatus();
      const std::span<std::byte> chunk(staging.data(), std::min(kStagingBytes, s->bytes - at));
      absl::Status st = read_bytes(s->view, at, chunk);
      if (st.ok()) st = w.copy_to(buf, chunk.data(), chunk.size(), s->offset + at);
      if (!st.ok()) {
        stop.store(true, std::memory_order_relaxed);
        return base::annotate(st, absl::StrCat("tensor '", std::string(s->view.name), "' of ",
                                               std::string(s->view.file), ": "));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status upload_weights(worker::Worker& w, const std::vector<WeightSlot>& slots, uint64_t total,
                            std::vector<worker::DeviceBuffer>* buffers) {
  SIMPLER_ASSIGN_OR_RETURN(worker::DeviceBuffer buf, w.malloc(total));
  buffers->push_back(buf);
  std::vector<const WeightSlot*> share[2];
  uint64_t share_bytes[2] = {0, 0};
  const bool two = base::hardware_threads() >= 2;
  for (const WeightSlot& s : slots) {
    if (!s.raw) continue;
    const int i = two && share_bytes[1] < share_bytes[0] ? 1 : 0;
    share[i].push_back(&s);
    share_bytes[i] += s.bytes;
  }
  std::atomic<bool> stop{false};
  absl::Status second;
  std::thread helper;
  if (!share[1].empty()) {
    try {
      helper = std::thread([&] { second = copy_raw_weights(w, buf, share[1], stop); });
    } catch (const std::system_error&) {  // no thread to be had: this one copies both shares
      share[0].insert(share[0].end(), share[1].begin(), share[1].end());
    }
  }
  const absl::Status first = copy_raw_weights(w, buf, share[0], stop);
  if (helper.joinable()) helper.join();
  SIMPLER_RETURN_IF_ERROR(first);
  SIMPLER_RETURN_IF_ERROR(second);
  for (const WeightSlot& s : slots) {
    if (!s.raw) {
      SIMPLER_ASSIGN_OR_RETURN(std::vector<float> f32, to_f32(s.view));
      SIMPLER_RETURN_IF_ERROR(w.copy_to(buf, f32.data(), s.bytes, s.offset));
    }
    SIMPLER_ASSIGN_OR_RETURN(
        *s.target, buf.tensor(s.shape, s.raw ? s.view.dtype : task::DataType::kFloat32, s.offset));
  }
  return absl::OkStatus();
}

}  // namespace simpler::llm
