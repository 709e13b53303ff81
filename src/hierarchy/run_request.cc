#include "hierarchy/run_request.h"

#include <bit>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "simpler/base/status.h"

namespace simpler::hierarchy {

namespace {

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

class Writer {
 public:
  template <typename T>
  void put(T v) {
    const size_t at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &v, sizeof(T));
  }
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  std::vector<uint8_t> take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

class Reader {
 public:
  explicit Reader(std::span<const uint8_t> in) : in_(in) {}
  template <typename T>
  absl::Status get(T& v, const char* what) {
    if (in_.size() - at_ < sizeof(T)) return truncated(what, sizeof(T));
    std::memcpy(&v, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return absl::OkStatus();
  }
  absl::Status string(std::string& s, size_t n, const char* what) {
    if (in_.size() - at_ < n) return truncated(what, n);
    s.assign(reinterpret_cast<const char*>(in_.data() + at_), n);
    at_ += n;
    return absl::OkStatus();
  }
  size_t offset() const { return at_; }
  size_t left() const { return in_.size() - at_; }
  absl::Status bad(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat("run request: ", what, " at byte ", at_));
  }

 private:
  absl::Status truncated(const char* what, size_t n) const {
    return absl::InvalidArgumentError(absl::StrCat("run request: truncated at byte ", at_,
                                                   " reading ", what, " (", n, " bytes needed, ",
                                                   in_.size() - at_, " left)"));
  }
  std::span<const uint8_t> in_;
  size_t at_ = 0;
};

#define SIMPLER_GET(reader, var, what) SIMPLER_RETURN_IF_ERROR((reader).get(var, what))

}  // namespace

absl::StatusOr<std::vector<uint8_t>> encode_run_request(const RunRequest& r) {
  if (r.callable.empty() || r.callable.size() > kMaxCallableNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("run request: callable name of ",
                                                   r.callable.size(), " bytes; want 1..",
                                                   kMaxCallableNameBytes));
  }
  Writer w;
  w.put<uint32_t>(kRunRequestMagic);
  w.put<uint16_t>(kRunRequestVersion);
  w.put<uint16_t>(static_cast<uint16_t>(r.callable.size()));
  w.bytes(r.callable.data(), r.callable.size());
  w.put<int32_t>(r.config.max_cores);
  w.put<double>(r.config.timeout_s);
  w.put<uint8_t>(static_cast<uint8_t>(r.config.placement));
  w.put<uint8_t>(r.config.task_timing ? 1 : 0);
  w.put<uint32_t>(static_cast<uint32_t>(r.args.size()));
  for (const task::Arg& a : r.args.args()) {
    w.put<uint8_t>(static_cast<uint8_t>(a.direction));
    w.put<uint8_t>(static_cast<uint8_t>(a.tensor.memory));
    w.put<uint8_t>(static_cast<uint8_t>(a.tensor.dtype));
    const int32_t rank = a.direction == task::ArgDirection::kScalar ? 0 : a.tensor.rank;
    w.put<uint8_t>(static_cast<uint8_t>(rank));
    w.put<uint64_t>(a.tensor.address);
    w.put<uint64_t>(a.scalar);
    for (int32_t d = 0; d < rank; ++d) w.put<int64_t>(a.tensor.shape[d]);
    for (int32_t d = 0; d < rank; ++d) w.put<int64_t>(a.tensor.strides[d]);
  }
  return w.take();
}

absl::StatusOr<RunRequest> decode_run_request(std::span<const uint8_t> bytes) {
  Reader in(bytes);
  uint32_t magic = 0;
  uint16_t version = 0, name_bytes = 0;
  SIMPLER_GET(in, magic, "the magic");
  if (magic != kRunRequestMagic) {
    return in.bad(absl::StrCat("bad magic 0x", absl::Hex(magic), " (not a run request)"));
  }
  SIMPLER_GET(in, version, "the version");
  if (version != kRunRequestVersion) {
    return in.bad(absl::StrCat("version ", version, ", this build reads ", kRunRequestVersion));
  }
  SIMPLER_GET(in, name_bytes, "the name length");
  if (name_bytes == 0 || name_bytes > kMaxCallableNameBytes) {
    return in.bad(absl::StrCat("callable name of ", name_bytes, " bytes"));
  }
  RunRequest r;
  SIMPLER_RETURN_IF_ERROR(in.string(r.callable, name_bytes, "the callable name"));
  uint8_t placement = 0, timing = 0;
  SIMPLER_GET(in, r.config.max_cores, "max_cores");
  SIMPLER_GET(in, r.config.timeout_s, "timeout_s");
  SIMPLER_GET(in, placement, "placement");
  SIMPLER_GET(in, timing, "task_timing");
  if (placement > static_cast<uint8_t>(task::GraphPlacement::kHost)) {
    return in.bad(absl::StrCat("unknown graph placement ", placement));
  }
  if (timing > 1) return in.bad(absl::StrCat("task_timing ", timing, " is not 0 or 1"));
  r.config.placement = static_cast<task::GraphPlacement>(placement);
  r.config.task_timing = timing == 1;
  if (absl::Status c = r.config.validate(); !c.ok()) {
    return in.bad(absl::StrCat("config: ", std::string(c.message())));
  }
  uint32_t count = 0;
  SIMPLER_GET(in, count, "the argument count");
  // Each argument takes at least 20 bytes: a count the bytes cannot hold is refused before
  // anything is reserved for it.
  constexpr size_t kMinArgBytes = 4 + 8 + 8;
  if (count > in.left() / kMinArgBytes) {
    return in.bad(absl::StrCat(count, " arguments do not fit the ", in.left(), " bytes left"));
  }
  for (uint32_t i = 0; i < count; ++i) {
    task::Arg a;
    uint8_t dir = 0, memory = 0, dtype = 0, rank = 0;
    SIMPLER_GET(in, dir, "an argument's direction");
    SIMPLER_GET(in, memory, "an argument's memory kind");
    SIMPLER_GET(in, dtype, "an argument's dtype");
    SIMPLER_GET(in, rank, "an argument's rank");
    if (rank > task::kMaxRank) {
      return in.bad(
          absl::StrCat("argument ", i, " has rank ", rank, " (at most ", task::kMaxRank, ")"));
    }
    if (dir == static_cast<uint8_t>(task::ArgDirection::kScalar) && rank != 0) {
      return in.bad(absl::StrCat("argument ", i, " is a scalar with rank ", rank));
    }
    a.direction = static_cast<task::ArgDirection>(dir);
    a.tensor.memory = static_cast<task::MemoryKind>(memory);
    a.tensor.dtype = static_cast<task::DataType>(dtype);
    a.tensor.rank = rank;
    SIMPLER_GET(in, a.tensor.address, "an argument's address");
    SIMPLER_GET(in, a.scalar, "an argument's scalar");
    for (int d = 0; d < rank; ++d) SIMPLER_GET(in, a.tensor.shape[d], "a shape");
    for (int d = 0; d < rank; ++d) SIMPLER_GET(in, a.tensor.strides[d], "a stride");
    // validate_arg checks direction, memory kind and dtype ranges, shapes and spans.
    if (absl::Status v = task::validate_arg(a, i); !v.ok()) {
      return in.bad(std::string(v.message()));
    }
    r.args.add(a);
  }
  if (in.left() != 0) return in.bad(absl::StrCat(in.left(), " trailing bytes"));
  return r;
}

}  // namespace simpler::hierarchy
