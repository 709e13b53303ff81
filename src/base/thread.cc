#include "simpler/base/thread.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace simpler::base {

void set_thread_name(const std::string& name) {
#if defined(__linux__)
  (void)pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
#endif
}

void set_thread_name(std::thread& thread, const std::string& name) {
#if defined(__linux__)
  (void)pthread_setname_np(thread.native_handle(), name.substr(0, 15).c_str());
#endif
}

void use_precise_timers() {
#if defined(__linux__)
  (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
#endif
}

int hardware_threads() {
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

absl::StatusOr<std::vector<int>> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) {
    return absl::InternalError(absl::StrCat("sched_getaffinity: ", std::strerror(errno)));
  }
  std::vector<int> out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  return out;
}

absl::Status check_cpus(const std::vector<int>& cpus) {
  if (cpus.empty()) return absl::InvalidArgumentError("CPU list is empty");
  const long configured = sysconf(_SC_NPROCESSORS_CONF);
  for (int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE || (configured > 0 && c >= configured)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "CPU ", c, " does not exist (this machine has CPUs 0-", configured - 1, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status pin_this_thread(const std::vector<int>& cpus) {
  if (absl::Status c = check_cpus(cpus); !c.ok()) return c;

  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  if (int err = pthread_setaffinity_np(pthread_self(), sizeof(set), &set); err != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot run on CPUs ", absl::StrJoin(cpus, ","),
                     ": pthread_setaffinity_np: ", std::strerror(err)));
  }
  return absl::OkStatus();
}

}  // namespace simpler::base
