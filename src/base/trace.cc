#include "simpler/base/trace.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "simpler/base/json.h"

namespace simpler::base {

void TraceRecorder::add(TraceSpan span) {
  MutexLock lock(mu_);
  spans_.push_back(std::move(span));
}

std::vector<TraceSpan> TraceRecorder::spans() const {
  MutexLock lock(mu_);
  return spans_;
}

size_t TraceRecorder::size() const {
  MutexLock lock(mu_);
  return spans_.size();
}

std::string TraceRecorder::to_json() const {
  nlohmann::json events = nlohmann::json::array();
  std::vector<TraceSpan> copy = spans();
  int64_t origin = copy.empty() ? 0 : copy.front().start_ns;
  for (const auto& s : copy) origin = std::min(origin, s.start_ns);
  events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"args", {{"name", "host"}}}});
  events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", 1}, {"args", {{"name", "device (sim)"}}}});
  for (const auto& s : copy) {
    nlohmann::json args = nlohmann::json::object();
    if (s.run_id >= 0) args["run_id"] = s.run_id;
    if (s.task >= 0) args["task"] = s.task;
    if (s.block >= 0) args["block"] = s.block;
    events.push_back({{"name", s.name},
                      {"cat", s.category},
                      {"ph", "X"},
                      {"ts", static_cast<double>(s.start_ns - origin) / 1000.0},
                      {"dur", static_cast<double>(s.dur_ns) / 1000.0},
                      {"pid", s.pid},
                      {"tid", s.tid},
                      {"args", args}});
  }
  // "otherData" carries the clock origin so a trace can be lined up with
  // other CLOCK_MONOTONIC tools (e.g. `perf sched record -k CLOCK_MONOTONIC`).
  nlohmann::json root = {{"traceEvents", events},
                         {"displayTimeUnit", "ns"},
                         {"otherData", {{"clock", "CLOCK_MONOTONIC"}, {"origin_ns", origin}}}};
  // Span names come from program libraries and need not be UTF-8.
  return dump_replacing(root);
}

absl::Status TraceRecorder::write(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::InvalidArgumentError(absl::StrCat("cannot open trace file '", path, "'"));
  out << to_json();
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("failed writing trace file '", path, "'"));
  return absl::OkStatus();
}

}  // namespace simpler::base
