#include "simpler/base/trace.h"

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace simpler::base {
namespace {

TEST(TraceRecorder, WritesCompleteEventsWithRunIds) {
  TraceRecorder r;
  r.add({"submit", "host", 1000, 500, 0, 0, 7, -1});
  r.add({"task", "device", 2000, 1000, 1, 2, 7, 3});
  auto j = nlohmann::json::parse(r.to_json());
  auto& ev = j["traceEvents"];
  int complete = 0;
  for (auto& e : ev) {
    if (e["ph"] == "X") {
      ++complete;
      EXPECT_EQ(e["args"]["run_id"], 7);
    }
  }
  EXPECT_EQ(complete, 2);
  // ts is relative to the earliest span, whose absolute time is the origin.
  EXPECT_EQ(j["otherData"]["origin_ns"], 1000);
  EXPECT_EQ(j["otherData"]["clock"], "CLOCK_MONOTONIC");
  for (auto& e : ev) {
    if (e["ph"] == "X" && e["name"] == "task") {
      EXPECT_DOUBLE_EQ(e["ts"].get<double>(), 1.0);
    }
  }
  EXPECT_FALSE(r.write("/nonexistent-dir/x.json").ok());
}

TEST(TraceRecorder, WritesSpanNamesThatAreNotUtf8WithReplacementCharacters) {
  TraceRecorder r;
  r.add({"task\xff", "device", 2000, 1000, 1, 2, 7, 3});
  auto j = nlohmann::json::parse(r.to_json());
  bool found = false;
  for (auto& e : j["traceEvents"]) found = found || e["name"] == "task\xEF\xBF\xBD";
  EXPECT_TRUE(found);
}

}  // namespace
}  // namespace simpler::base
