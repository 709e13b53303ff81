// Logging through spdlog. All logs go to stderr so stdout stays for results.
#pragma once

#include <memory>

#include "spdlog/spdlog.h"

namespace simpler::base {

// The process-wide logger ("simpler"), writing to stderr. Level from
// SIMPLER_LOG_LEVEL (trace|debug|info|warn|error|off; default warn).
// Thread-safe.
spdlog::logger& logger();

}  // namespace simpler::base

#define SIMPLER_LOG_DEBUG(...) ::simpler::base::logger().debug(__VA_ARGS__)
#define SIMPLER_LOG_INFO(...) ::simpler::base::logger().info(__VA_ARGS__)
#define SIMPLER_LOG_WARN(...) ::simpler::base::logger().warn(__VA_ARGS__)
#define SIMPLER_LOG_ERROR(...) ::simpler::base::logger().error(__VA_ARGS__)
