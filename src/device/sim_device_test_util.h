// Shared helpers of the tests that run once per scheduler-core mode of the sim device.
#pragma once

#include <string>

#include "gtest/gtest.h"
#include "simpler/device/device.h"

namespace simpler::device::testing {

// The two modes a test runs in (INSTANTIATE_TEST_SUITE_P's values): the stream's scheduler thread
// only scheduling, and standing in for core 0 on short jobs.
inline auto scheduler_core_modes() {
  return ::testing::Values(SimDeviceOptions::SchedulerCore::kOff,
                           SimDeviceOptions::SchedulerCore::kOn);
}

// The name of a test's instance in `info`'s mode (INSTANTIATE_TEST_SUITE_P's name generator).
inline std::string scheduler_core_test_name(
    const ::testing::TestParamInfo<SimDeviceOptions::SchedulerCore>& info) {
  return info.param == SimDeviceOptions::SchedulerCore::kOn ? "SchedulerIsCore0" : "ThreadPerCore";
}

}  // namespace simpler::device::testing
