#include "simpler/base/log.h"

#include <cstdlib>
#include <string>

#include "spdlog/sinks/stdout_color_sinks.h"

namespace simpler::base {

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto l = spdlog::stderr_color_mt("simpler");
    const char* level = std::getenv("SIMPLER_LOG_LEVEL");
    l->set_level(level ? spdlog::level::from_str(level) : spdlog::level::warn);
    l->set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
    return l;
  }();
  return *instance;
}

}  // namespace simpler::base
