// ds train — train as the config and its plan say.
#pragma once

#include "cli/common.hpp"

namespace ds::cli {

struct TrainArgs {
  ConfigArgs config;
  bool resume = false;     // --resume: train.resume=auto (an explicit train.resume path wins)
  bool overwrite = false;
  bool no_fit_check = false;  // --no-fit-check: start a plan that needs more memory than the machine has  // --overwrite: a fresh run may replace the run in train.output_dir
  std::string hostfile;  // --hostfile: ranks on these hosts, over ssh
  std::string master_addr;
  int master_port = 0;
};

Subcommand setup_train(CLI::App& app);
int run_train(const TrainArgs& args);

}  // namespace ds::cli
