// ds profile: runs a few training steps with the same engine as ds train and reports where the time,
// FLOPs, bytes and memory of a step go (text, --json, or a Chrome trace with --trace).
#pragma once

#include "cli/common.hpp"

namespace ds::cli {

Subcommand setup_profile(CLI::App& app);

}  // namespace ds::cli
