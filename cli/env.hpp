// ds env — an environment report for bug reports and "why is it slow" questions: versions, cores,
// memory, CPU features that matter for bf16, GPUs, /dev/shm, launcher variables, and other `ds`
// executables on PATH (DeepSpeed's Python package installs one).
#pragma once

#include "cli/common.hpp"

namespace ds::cli {

struct EnvArgs {
  bool json = false;
};

Subcommand setup_env(CLI::App& app);
int run_env(const EnvArgs& args);

}  // namespace ds::cli
