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
  std::vector<std::byte> staging(kStagingBytes), interleaved;
  for (const WeightSlot* s : share) {
    // An interleaved weight goes in whole groups of 16 rows (as many as fit the staging buffer),
    // each interleaved on its way.
    const int64_t group = task::interleaved_rows(s->dtype);
    const int64_t cols = s->shape.back();
    const uint64_t group_bytes =
        static_cast<uint64_t>(group) * task::bytes_of(s->dtype, static_cast<uint64_t>(cols));
    const uint64_t step = group > 1 && group_bytes > 0
                              ? std::max<uint64_t>(kStagingBytes / group_bytes, 1) * group_bytes
                              : kStagingBytes;
    if (staging.size() < step) staging.resize(step);
    if (group > 1 && interleaved.size() < step) interleaved.resize(step);
    for (uint64_t at = 0; at < s->bytes; at += step) {
      if (stop.load(std::memory_order_relaxed)) return absl::OkStatus();
      const std::span<std::byte> chunk(staging.data(), std::min(step, s->bytes - at));
      absl::Status st = read_bytes(s->view, at, chunk);
      const std::byte* out = chunk.data();
      if (st.ok() && group > 1) {
        task::interleave_rows(s->dtype, reinterpret_cast<const uint8_t*>(chunk.data()),
                              static_cast<int64_t>(chunk.size() / group_bytes) * group, cols,
                              reinterpret_cast<uint8_t*>(interleaved.data()));
        out = interleaved.data();
      }
      if (st.ok()) st = w.copy_to(buf, out, chunk.size(), s->offset + at);
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
  for (const WeightSlot& s : slots) {  // what the copy assumes of a raw slot
    const int64_t group = task::interleaved_rows(s.dtype);
    if (s.raw && (task::plain_of(s.dtype) != s.view.dtype || s.shape.empty() ||
                  (group > 1 && (s.shape.size() != 2 || s.shape[0] % group != 0)))) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", std::string(s.view.name), "' of ", std::string(s.view.file),
                       ": planned as ", std::string(task::name_of(s.dtype)), " over its ",
                       std::string(task::name_of(s.view.dtype)),
                       " bytes (an interleaved dtype needs the plain one and a 2-D shape whose "
                       "rows are whole groups of ",
                       group, ")"));
    }
  }
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
        *s.target, buf.tensor(s.shape, s.raw ? s.dtype : task::DataType::kFloat32, s.offset));
  }
  return absl::OkStatus();
}

}  // namespace simpler::llm
