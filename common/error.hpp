// ds — errors. Two kinds, kept apart on purpose:
//  * UserError: the user can fix it (a flag, a config key, a file, a plan that won't fit). It carries
//    what failed, where, and a hint; main prints it as `ds <sub>: error: ...` and exits with its code.
//  * DS_CHECK: an internal invariant. Failing one is a bug in ds; it reports file:line.
// Library code throws; only cli/main.cpp turns exceptions into exit codes. Nothing calls exit().
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ds {

// Process exit codes, documented in ds(1). Stable: scripts depend on them.
enum ExitCode : int {
  kExitOk = 0,
  kExitRuntime = 1,   // the run failed (I/O, a collective, a numeric blow-up)
  kExitUsage = 2,     // bad flags, bad config, missing input file: fix the command and retry
  kExitInterrupted = 130,  // Ctrl-C (128 + SIGINT), after saving a checkpoint
  kExitTerminated = 143,   // SIGTERM (128 + SIGTERM), after saving a checkpoint
};

class UserError : public std::runtime_error {
 public:
  UserError(std::string message, std::string hint = {}, int exit_code = kExitUsage)
      : std::runtime_error(std::move(message)), hint_(std::move(hint)), exit_code_(exit_code) {}
  const std::string& hint() const { return hint_; }
  int exit_code() const { return exit_code_; }

 private:
  std::string hint_;
  int exit_code_;
};

// One problem found in a config: a JSON path (e.g. "zero_optimization.stage"), the sentence,
// and an optional hint. Used for both errors and warnings.
struct ConfigIssue {
  std::string path;
  std::string message;
  std::string hint;
};

// All problems of one config at once, so the user fixes them in one round.
class ConfigError : public UserError {
 public:
  ConfigError(std::string source, std::vector<ConfigIssue> issues)
      : UserError(summary(source, issues.size())), source_(std::move(source)), issues_(std::move(issues)) {}
  const std::string& source() const { return source_; }
  const std::vector<ConfigIssue>& issues() const { return issues_; }

 private:
  static std::string summary(const std::string& source, size_t n) {
    return source + ": " + std::to_string(n) + (n == 1 ? " problem" : " problems");
  }
  std::string source_;
  std::vector<ConfigIssue> issues_;
};

namespace detail {
[[noreturn]] inline void check_failed(const char* cond, const char* file, int line, const std::string& msg) {
  std::ostringstream os;
  os << "internal error (a bug in ds): " << file << ":" << line << ": check `" << cond << "` failed";
  if (!msg.empty()) os << ": " << msg;
  throw std::logic_error(os.str());
}
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace ds

#define DS_CHECK(cond, ...)                                                                     \
  do {                                                                                          \
    if (!(cond)) ::ds::detail::check_failed(#cond, __FILE__, __LINE__, ::ds::detail::concat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)
