// ds plan — validate and resolve a config, compile it, print the execution plan.
#pragma once

#include "cli/common.hpp"

namespace ds::cli {

struct PlanArgs {
  ConfigArgs config;
  bool json = false;
  bool show_config = false;
  bool layout = false;
  int64_t show_sample = -1;  // jsonl data: print this sample as the model sees it
};

Subcommand setup_plan(CLI::App& app);
int run_plan(const PlanArgs& args);

}  // namespace ds::cli
