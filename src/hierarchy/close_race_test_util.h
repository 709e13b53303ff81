// The close-against-submit race both the endpoint and the L3 tests drive.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "base/test_wait.h"
#include "gtest/gtest.h"
#include "simpler/worker/run_handle.h"

namespace simpler::hierarchy::testing {

// Two threads call `submit(thread, i)` for i in [0, per_thread) while this thread calls `close`
// once `after_submits` submits (accepted or refused) were made. Every submit must either be refused
// with FAILED_PRECONDITION (closed) or give a run that is finished, and OK, once close() returned;
// close() itself must return OK.
inline void race_close_against_submits(
    const std::function<absl::StatusOr<worker::RunHandle>(int thread, int i)>& submit,
    const std::function<absl::Status()>& close, int per_thread, int after_submits) {
  std::vector<worker::RunHandle> accepted[2];
  std::atomic<int> refused{0}, made{0};
  std::thread t[2];
  for (int k = 0; k < 2; ++k) {
    t[k] = std::thread([&, k] {
      for (int i = 0; i < per_thread; ++i) {
        absl::StatusOr<worker::RunHandle> h = submit(k, i);
        if (h.ok()) {
          accepted[k].push_back(*h);
        } else {
          EXPECT_EQ(h.status().code(), absl::StatusCode::kFailedPrecondition) << h.status();
          ++refused;
        }
        ++made;
      }
    });
  }
  EXPECT_TRUE(simpler::testing::eventually([&] { return made.load() >= after_submits; }));
  EXPECT_TRUE(close().ok());
  for (auto& th : t) th.join();
  for (int k = 0; k < 2; ++k) {
    for (worker::RunHandle& h : accepted[k]) {
      EXPECT_TRUE(h.done()) << "run " << h.id().value << " not finished after close()";
      EXPECT_TRUE(h.wait(5.0).ok()) << h.wait(5.0);
    }
  }
  EXPECT_EQ(accepted[0].size() + accepted[1].size() + refused.load(), 2u * per_thread);
}

}  // namespace simpler::hierarchy::testing
