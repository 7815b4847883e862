// ds — the command line: registers every subcommand, parses, runs the chosen one, and maps CLI11's
// own error codes onto ds's (0 ok, 1 runtime, 2 usage/config).
#pragma once

namespace ds::cli {

int run_ds(int argc, char** argv);

}  // namespace ds::cli
