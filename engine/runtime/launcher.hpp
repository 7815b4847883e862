// ds — starts N local ranks of this same binary, the way torchrun would: each child gets RANK,
// LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (a free local port). Rank 0
// keeps the terminal; the others write to <log_dir>/rank_<r>.log. Ctrl-C and SIGTERM are forwarded to
// every rank. When a rank fails, the others get SIGTERM, then SIGKILL after `grace`: the launcher never
// waits on a hung peer, and it names the rank that failed with the last lines of its log.
// No LibTorch here: fork/exec and waitpid.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace ds {

struct LaunchSpec {
  int nproc = 1;
  std::vector<std::string> args;  // arguments for each rank (argv[1..]); the binary is this one
  std::string log_dir;            // where ranks other than 0 write their output
  std::chrono::seconds grace{30}; // after a failure: how long the others get to exit before SIGKILL
};

// Returns the exit status for the launcher: 0 when every rank succeeded, 130 when interrupted, else
// the first failing rank's status (1 when it was killed by a signal).
int launch_local_ranks(const LaunchSpec& spec);

}  // namespace ds
