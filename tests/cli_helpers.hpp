// Running the ds binary as a user does, for the tests of the command line and of several ranks.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace cli_test {

struct Result {
  int code = -1;
  std::string out, err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A run directory's metrics.jsonl, one object per step.
inline std::vector<nlohmann::json> metrics_of(const std::string& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream f(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

// One scratch directory per test process for captured output, removed when the process exits.
struct ScratchDir {
  std::string path = std::string(DS_BUILD_DIR) + "/cli_test_" + std::to_string(::getpid());
  ScratchDir() { std::filesystem::create_directories(path); }
  ~ScratchDir() { std::filesystem::remove_all(path); }
};

inline const std::string& scratch_dir() {
  static const ScratchDir scratch;
  return scratch.path;
}

// The working directory ds runs in: a scratch directory of this test process where the source tree's
// examples/, templates/ and tests/ are linked, so a test names examples/quickstart.json as a user does,
// while every run directory a config names relatively (runs/quickstart) lands here. What the user has
// in the source tree (the quickstart's runs/, say) is never read or written by a test.
inline const std::string& work_dir() {
  static const std::string dir = [] {
    const std::string d = scratch_dir() + "/work";
    std::filesystem::create_directories(d);
    for (const char* name : {"examples", "templates", "tests", "man", "schema", "bench", "scripts"}) {
      std::error_code ec;
      std::filesystem::create_directory_symlink(std::string(DS_SOURCE_DIR) + "/" + name, d + "/" + name, ec);
    }
    return d;
  }();
  return dir;
}

inline std::string ds_command(const std::string& args, const std::string& env) {
  const std::string& dir = scratch_dir();
  return "cd " + work_dir() + " && exec env -u WORLD_SIZE -u RANK -u DS_RUN_LOCK " + env + " " DS_BINARY " " + args + " >" + dir +
         "/out 2>" + dir + "/err </dev/null";
}

inline Result finished(int status) {
  Result r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? -WTERMSIG(status) : -1000;
  r.out = slurp(scratch_dir() + "/out");
  r.err = slurp(scratch_dir() + "/err");
  return r;
}

// Runs `ds ARGS` (in work_dir()) with the given environment prefix (e.g. "NO_COLOR=1"). A ds that died
// of a signal has code -signal.
inline Result ds(const std::string& args, const std::string& env = "") {
  return finished(std::system(ds_command(args, env).c_str()));
}

inline int64_t line_count(const std::string& path) {
  std::ifstream f(path);
  int64_t n = 0;
  for (std::string line; std::getline(f, line);) ++n;
  return n;
}

// Starts `ds ARGS`, waits until `watched` (a run's metrics.jsonl) holds at least `lines` lines, i.e. the
// run has trained that many steps, then `after_s` seconds more, and sends `sig`. Waiting on the run's own
// progress rather than a clock means a loaded machine cannot signal a run still starting up. Gives up
// waiting (and signals anyway) after 300 s; a ds that ends on its own first is reported as it ended.
inline Result ds_signalled(const std::string& args, int sig, const std::string& watched, int64_t lines, double after_s,
                           const std::string& env = "") {
  // The last run's output goes first: a watched err file it left would count as this run's lines.
  std::filesystem::remove(scratch_dir() + "/out");
  std::filesystem::remove(scratch_dir() + "/err");
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c", ds_command(args, env).c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  for (int tick = 0; tick < 15000; ++tick) {  // 20 ms ticks
    if (::waitpid(pid, &status, WNOHANG) == pid) return finished(status);
    if (line_count(watched) >= lines) break;
    ::usleep(20000);
  }
  ::usleep(static_cast<useconds_t>(after_s * 1e6));
  ::kill(pid, sig);
  ::waitpid(pid, &status, 0);
  return finished(status);
}

inline bool contains(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

// The fp32 quickstart run the trust tests start from: validation off, a checkpoint every 10 steps.
inline const std::string kQuickstartFp32 = "train examples/quickstart.json bf16.enabled=false train.eval_every=0 train.save_every=10 ";

// A path in the scratch directory, removed first.
inline std::string fresh(const std::string& name) {
  const std::string dir = scratch_dir() + "/" + name;
  std::filesystem::remove_all(dir);
  return dir;
}

// A short fp32 run of `steps` steps into `dir` (kQuickstartFp32: checkpoints every 10 steps); its exit status.
inline Result train_into(const std::string& dir, int steps, const std::string& extra = "") {
  return ds(kQuickstartFp32 + "train.steps=" + std::to_string(steps) + " train.output_dir=" + dir + " " + extra);
}

}  // namespace cli_test
