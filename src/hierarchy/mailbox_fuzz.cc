// libFuzzer targets for what one side of the mailbox reads from the other (built twice, see
// CMakeLists.txt):
//  * SIMPLER_FUZZ_FRAME (mailbox_frame_fuzz): the child's frame decoder. The input sets the
//    entries' generations, a published frame's header and its payload; MailboxChild::take()
//    and then decode_run_request() read them. Checks: no crash or UB; a taken request names an
//    entry inside the table at its current odd generation; a refused frame stopped the endpoint
//    with a reason; a decoded request re-encodes to the same bytes.
//  * SIMPLER_FUZZ_ENTRY (mailbox_entry_fuzz): the parent's entry reader. The input overwrites
//    every held entry (state, code, error length and text) and collect() reads them. Checks: a
//    failed run never reports OK, no text longer than an entry holds, every terminal entry is
//    collected once and freed.
//  * SIMPLER_FUZZ_CONTROL (mailbox_control_fuzz): the child's control-frame handling. The input
//    is a ControlCommand (its device and host fields aimed near the child's live buffers and
//    shared range, so that some commands are valid), served by serve_control_command on a sim
//    worker. Checks: no crash, leak or UB; the reply's code is a status code and its text fits;
//    an unknown op and a copy outside the shared range are INVALID_ARGUMENT; the region's table
//    always fits its extent.
#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "base/fuzz_check.h"
#include "hierarchy/endpoint.h"
#include "hierarchy/mailbox.h"
#include "hierarchy/run_request.h"

namespace {

using simpler::fuzz::check;
using namespace simpler::hierarchy;

template <typename T>
T take_bytes(const uint8_t*& data, size_t& size) {
  T v{};
  const size_t n = size < sizeof(T) ? size : sizeof(T);
  std::memcpy(&v, data, n);
  data += n;
  size -= n;
  return v;
}

MailboxRegion& region() {
  static MailboxRegion* r = new MailboxRegion(*MailboxRegion::create(1));  // M = 3 entries
  return *r;
}

[[maybe_unused]] void reset(MailboxRegion& r) {
  MailboxHeader& h = r.header();
  h.stopped.store(0);
  h.stop_reason_bytes = 0;
  for (uint32_t i = 0; i < kRequestFrames; ++i) r.frame(i).header.state.store(0);
  for (uint32_t i = 0; i < r.entry_count(); ++i) {
    r.entry(i)->generation.store(0);
    r.entry(i)->state.store(0);
  }
}

}  // namespace

#if defined(SIMPLER_FUZZ_FRAME)
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  MailboxRegion& r = region();
  reset(r);
  for (uint32_t i = 0; i < r.entry_count(); ++i) {
    r.entry(i)->generation.store(take_bytes<uint8_t>(data, size));
  }
  FrameHeader& f = r.frame(0).header;
  f.entry_index = take_bytes<uint32_t>(data, size);
  f.entry_generation = take_bytes<uint32_t>(data, size);
  f.payload_bytes = take_bytes<uint32_t>(data, size);
  f.run_id = take_bytes<uint64_t>(data, size);
  std::memcpy(r.frame(0).payload, data, size < kFramePayloadBytes ? size : kFramePayloadBytes);
  f.state.store(static_cast<uint32_t>(FrameState::kPublished));
  MailboxChild child(&r);
  absl::StatusOr<std::optional<Request>> got = child.take();
  if (!got.ok()) {
    check(child.stopped(), "a refused frame did not stop the endpoint");
    check(r.header().stop_reason_bytes > 0, "a stop without a reason");
    return 0;
  }
  check(r.frame(0).header.state.load() == static_cast<uint32_t>(FrameState::kFree),
        "a frame taken or returned was not ACKed");
  if (!got->has_value()) return 0;  // stale: returned untouched
  const Request& req = **got;
  check(req.ticket.entry < r.entry_count(), "a request names an entry outside the table");
  check(req.ticket.generation % 2 == 1, "a request at an even generation");
  check(r.entry(req.ticket.entry)->generation.load() == req.ticket.generation,
        "a request at a generation the entry does not have");
  check(req.payload.size() <= kFramePayloadBytes, "a payload longer than a frame");
  absl::StatusOr<RunRequest> decoded = decode_run_request(req.payload);
  if (!decoded.ok()) return 0;
  absl::StatusOr<std::vector<uint8_t>> again = encode_run_request(*decoded);
  check(again.ok(), "a decoded request does not encode");
  check(*again == req.payload, "a decoded request re-encodes differently");
  return 0;
}
#elif defined(SIMPLER_FUZZ_ENTRY)
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  MailboxRegion& r = region();
  reset(r);
  MailboxParent parent(&r);
  const uint8_t payload[1] = {0};
  for (uint64_t run = 0; run < r.entry_count() && parent.can_dispatch(); ++run) {
    if (!parent.publish(run, payload).ok()) break;
    // The child took it: frames free again, entries held.
    for (uint32_t i = 0; i < kRequestFrames; ++i) r.frame(i).header.state.store(0);
  }
  const int32_t held = parent.in_flight();
  int32_t terminal = 0;
  for (uint32_t i = 0; i < r.entry_count(); ++i) {
    RunEntry& e = *r.entry(i);
    const uint32_t state = take_bytes<uint8_t>(data, size) % 6;
    e.code = take_bytes<int32_t>(data, size);
    e.error_bytes = take_bytes<uint32_t>(data, size);
    const size_t n = size < kErrorTextBytes ? size : kErrorTextBytes;
    std::memcpy(e.error, data, n);
    data += n;
    size -= n;
    e.state.store(state);
    if (state == static_cast<uint32_t>(EntryState::kCompleted) ||
        state == static_cast<uint32_t>(EntryState::kFailed)) {
      ++terminal;
    }
  }
  std::vector<Completion> done = parent.collect();
  check(static_cast<int32_t>(done.size()) == terminal, "a terminal entry not collected once");
  check(parent.in_flight() == held - terminal, "in_flight does not match the collected runs");
  for (const Completion& c : done) {
    check(c.status.message().size() < kErrorTextBytes, "an error text longer than an entry");
    const RunEntry& e = *r.entry(c.ticket.entry);
    check(e.generation.load() % 2 == 0, "a collected entry was not freed");
  }
  for (const Completion& c : parent.collect()) {
    check(false, "collected twice");
    (void)c;
  }
  return 0;
}
#elif defined(SIMPLER_FUZZ_CONTROL)
namespace {

struct Child {
  Child() : worker(options()) {
    (void)worker.init();
    for (auto& b : live) b = *worker.malloc(256);
  }
  static simpler::worker::WorkerOptions options() {
    simpler::worker::WorkerOptions o;
    o.num_cores = 1;
    o.device_memory_bytes = 1 << 20;  // a malloc the input sizes cannot exhaust the host
    o.faults.emplace();
    return o;
  }
  simpler::worker::Worker worker;
  simpler::worker::DeviceBuffer live[3];
  alignas(64) uint8_t shared[4096] = {};
};

Child& child() {
  static Child* c = new Child();
  return *c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  MailboxRegion& r = region();
  Child& c = child();
  // Buffers a fuzzed free released come back, so later inputs find live ones again.
  for (auto& b : c.live) {
    if (b.bytes == 0) b = *c.worker.malloc(256);
  }
  ControlCommand cmd;
  cmd.op = take_bytes<uint8_t>(data, size) % 7;  // 0 and 6: unknown ops
  cmd.grant = take_bytes<uint16_t>(data, size);
  const uint8_t which = take_bytes<uint8_t>(data, size) % 4;  // 3: an arbitrary address
  const int16_t device_delta = take_bytes<int16_t>(data, size);
  cmd.device = which < 3 ? c.live[which].address + device_delta : take_bytes<uint64_t>(data, size);
  cmd.device_bytes = take_bytes<uint32_t>(data, size) % (1u << 21);
  const int32_t host_delta = take_bytes<int16_t>(data, size);
  cmd.host = reinterpret_cast<uintptr_t>(c.shared) + host_delta;
  cmd.bytes = take_bytes<uint16_t>(data, size);
  cmd.offset = take_bytes<uint16_t>(data, size);
  const std::vector<std::pair<uint64_t, uint64_t>> ranges = {
      {reinterpret_cast<uintptr_t>(c.shared), reinterpret_cast<uintptr_t>(c.shared) + 4096}};
  const ControlReply reply = serve_control_command(cmd, c.worker, r, ranges);
  check(reply.code >= 0 && reply.code <= 16, "a reply code that is no status code");
  check(reply.text_bytes < kErrorTextBytes, "a reply text longer than the frame holds");
  if (cmd.op == 0 || cmd.op == 6) {
    check(reply.code == static_cast<int32_t>(absl::StatusCode::kInvalidArgument),
          "an unknown op was not refused");
  }
  const bool is_copy = cmd.op == static_cast<uint32_t>(ControlOp::kCopyTo) ||
                       cmd.op == static_cast<uint32_t>(ControlOp::kCopyFrom);
  const bool host_inside =
      host_delta >= 0 && cmd.bytes <= 4096 && static_cast<uint64_t>(host_delta) <= 4096 - cmd.bytes;
  if (is_copy && !host_inside) {
    check(reply.code == static_cast<int32_t>(absl::StatusCode::kInvalidArgument),
          "a copy outside the shared range was not refused");
  }
  if (cmd.op == static_cast<uint32_t>(ControlOp::kFree) && reply.code == 0) {
    for (auto& b : c.live) {
      if (b.address == cmd.device) b = {};
    }
  }
  if (cmd.op == static_cast<uint32_t>(ControlOp::kMalloc) && reply.code == 0) {
    check(c.worker.free({reply.device, cmd.device_bytes}).ok(), "a malloc'd buffer not freeable");
  }
  struct stat st {};
  check(fstat(r.fd(), &st) == 0, "fstat");
  check(r.bytes() <= static_cast<uint64_t>(st.st_size), "the table outgrew the region's extent");
  check(r.entry_count() >= kRequestFrames + 1, "a table below grant 1");
  return 0;
}
#endif
