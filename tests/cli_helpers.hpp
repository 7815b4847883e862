// Running the ds binary as a user does, for the tests of the command line and of several ranks.
#pragma once

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

// Runs `ds ARGS` from the source directory with the given environment prefix (e.g. "NO_COLOR=1").
inline Result ds(const std::string& args, const std::string& env = "") {
  const std::string& dir = scratch_dir();
  const std::string cmd = "cd " DS_SOURCE_DIR " && env -u WORLD_SIZE -u RANK " + env + " " DS_BINARY " " + args + " >" + dir +
                          "/out 2>" + dir + "/err </dev/null";
  int status = std::system(cmd.c_str());
  Result r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(dir + "/out");
  r.err = slurp(dir + "/err");
  return r;
}

inline bool contains(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

}  // namespace cli_test
