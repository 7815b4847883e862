// ds — the subcommands whose engines are not built yet (profile). They are registered so `ds --help` shows the whole tool, document what they will do, and
// when run say plainly that this build cannot do it yet, exiting 1.
#pragma once

#include "cli/common.hpp"

namespace ds::cli {

Subcommand setup_profile(CLI::App& app);

}  // namespace ds::cli
