#include "cli/bench/bench_starpu.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "simpler/base/clock.h"

#ifdef SIMPLER_HAVE_STARPU
#include <starpu.h>
#endif

namespace simpler::cli {

#ifdef SIMPLER_HAVE_STARPU
namespace {

void empty_cpu_func(void* /*buffers*/[], void* /*cl_arg*/) {}

}  // namespace

bool starpu_available() { return true; }
std::string starpu_version() {
  return absl::StrCat(STARPU_MAJOR_VERSION, ".", STARPU_MINOR_VERSION, ".", STARPU_RELEASE_VERSION);
}

absl::StatusOr<std::vector<DispatchRow>> bench_dispatch_starpu(int ncpu, int64_t tasks) {
  if (tasks <= 0) return absl::InvalidArgumentError("bench dispatch: --tasks must be > 0");
  std::error_code ec;
  const std::filesystem::path home =
      std::filesystem::temp_directory_path() / absl::StrCat("simpler_starpu_home_", ::getpid());
  std::filesystem::create_directories(home, ec);
  ::setenv("STARPU_HOME", home.c_str(), 1);
  ::setenv("STARPU_NCPU", std::to_string(ncpu).c_str(), 1);
  ::setenv("STARPU_SCHED", "eager", 1);
  ::setenv("STARPU_CALIBRATE", "0", 1);
  ::setenv("STARPU_NCUDA", "0", 1);
  ::setenv("STARPU_NOPENCL", "0", 1);
  ::setenv("STARPU_SILENT", "1", 1);
  if (const int rc = starpu_init(nullptr); rc != 0) {
    std::filesystem::remove_all(home, ec);
    return absl::InternalError(absl::StrCat("starpu_init failed with ", rc));
  }
  starpu_codelet cl;
  starpu_codelet_init(&cl);
  cl.cpu_funcs[0] = empty_cpu_func;
  cl.nbuffers = 1;
  cl.modes[0] = STARPU_RW;
  cl.name = "empty";
  std::vector<int64_t> slots(static_cast<size_t>(tasks), 0);
  std::vector<starpu_data_handle_t> handles(static_cast<size_t>(tasks));
  for (int64_t i = 0; i < tasks; ++i) {
    starpu_variable_data_register(&handles[i], STARPU_MAIN_RAM,
                                  reinterpret_cast<uintptr_t>(&slots[i]), sizeof(int64_t));
  }
  std::vector<DispatchRow> rows;
  const char* names[] = {"independent", "chain", "8_chains"};
  absl::Status status;
  for (int pattern = 0; pattern < 3 && status.ok(); ++pattern) {
    const int64_t t0 = base::now_ns();
    for (int64_t i = 0; i < tasks; ++i) {
      const int64_t slot = pattern == 0 ? i : (pattern == 1 ? 0 : i % 8);
      starpu_task* t = starpu_task_create();
      t->cl = &cl;
      t->handles[0] = handles[slot];
      if (const int rc = starpu_task_submit(t); rc != 0) {
        status = absl::InternalError(absl::StrCat("starpu_task_submit failed with ", rc));
        break;
      }
    }
    starpu_task_wait_for_all();
    const int64_t t1 = base::now_ns();
    DispatchRow row;
    row.pattern = names[pattern];
    row.tasks = tasks;
    row.ns_per_task = static_cast<double>(t1 - t0) / tasks;
    row.wall_ms = (t1 - t0) / 1e6;
    rows.push_back(row);
  }
  for (starpu_data_handle_t h : handles) starpu_data_unregister(h);
  starpu_shutdown();
  std::filesystem::remove_all(home, ec);
  if (!status.ok()) return status;
  return rows;
}
#else
bool starpu_available() { return false; }
std::string starpu_version() { return {}; }

absl::StatusOr<std::vector<DispatchRow>> bench_dispatch_starpu(int, int64_t) {
  return absl::FailedPreconditionError(
      "--compare starpu: this simpler was built without StarPU; install it "
      "(scripts/install_deps.sh --bench: Debian libstarpu-dev) and rebuild");
}
#endif

}  // namespace simpler::cli
