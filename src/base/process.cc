#include "simpler/base/process.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace simpler::base {

std::string describe_wait_status(int wstatus) {
  if (WIFSIGNALED(wstatus)) {
    const int sig = WTERMSIG(wstatus);
    const char* name = strsignal(sig);
    return absl::StrCat("killed by signal ", sig, " (", name != nullptr ? name : "?", ")");
  }
  if (WIFEXITED(wstatus)) return absl::StrCat("exited with status ", WEXITSTATUS(wstatus));
  return absl::StrCat("ended (wait status ", wstatus, ")");
}

char process_state(int pid) {
  const std::string path = absl::StrCat("/proc/", pid, "/stat");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return '?';
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return '?';
  // "PID (COMM) S ...": COMM may hold spaces and parentheses, so the state follows the last ')'.
  const std::string_view line(buf, static_cast<size_t>(n));
  const size_t paren = line.rfind(')');
  return paren != std::string_view::npos && paren + 2 < line.size() ? line[paren + 2] : '?';
}

absl::StatusOr<ProcessResult> run_process(const std::vector<std::string>& argv, size_t max_output) {
  if (argv.empty()) return absl::InvalidArgumentError("run_process: no program");
  const auto fail = [&argv](const char* what, int err) {
    return absl::InternalError(
        absl::StrCat("cannot run '", argv[0], "': ", what, ": ", std::strerror(err)));
  };
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return fail("pipe", errno);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_adddup2(&actions, out[1], 2);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, argv[0].c_str(), &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(out[1]);
  if (spawned != 0) {
    close(out[0]);
    return fail("spawn", spawned);
  }
  ProcessResult r;
  char buf[4096];
  while (true) {
    const ssize_t n = read(out[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    const size_t room = max_output - std::min(max_output, r.output.size());
    r.output.append(buf, std::min(room, static_cast<size_t>(n)));  // drained either way
  }
  close(out[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return fail("waitpid", errno);
  }
  r.wait_status = status;
  if (WIFSIGNALED(status)) {
    r.signal = WTERMSIG(status);
  } else {
    r.exit_code = WEXITSTATUS(status);
  }
  return r;
}

}  // namespace simpler::base
