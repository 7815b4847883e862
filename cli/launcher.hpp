// ds — starts the ranks of this same binary, the way torchrun would: each gets RANK, LOCAL_RANK,
// WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Ranks on this machine are forked; ranks on
// other hosts (a DeepSpeed hostfile) are started over ssh (`DS_SSH` replaces the ssh command, e.g.
// "ssh -p 2222"), in the same working directory, with the same binary path. Rank 0 keeps the terminal;
// the others write to <log_dir>/rank_<r>.log (remote ranks' output comes back through ssh). Ctrl-C and
// SIGTERM are forwarded to every local child. When a rank fails, the others get SIGTERM, then SIGKILL
// after `grace`: the launcher never waits on a hung peer, and it names the rank that failed with the
// last lines of its log. A remote rank whose ssh is killed ends at its next collective (timeout).
// No LibTorch here: fork/exec and waitpid.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace ds {

struct LaunchHost {
  std::string name;
  int slots = 1;
};

// DeepSpeed's hostfile: one "hostname slots=N" per line, '#' comments. Throws UserError naming the
// file and line for anything else.
std::vector<LaunchHost> read_hostfile(const std::string& path);

struct LaunchSpec {
  int nproc = 1;                  // ranks on this machine when `hosts` is empty
  std::vector<LaunchHost> hosts;  // a hostfile's hosts, ranks numbered in their order
  std::string master_addr;        // "" : this machine (127.0.0.1), or the first host of a hostfile
  int master_port = 0;            // 0: a free local port (only for ranks all on this machine), else 29500
  std::vector<std::string> args;  // arguments for each rank (argv[1..]); the binary is this one
  std::string log_dir;            // where ranks other than 0 write their output
  std::chrono::seconds grace{30}; // after a failure: how long the others get to exit before SIGKILL
  // Descriptors the ranks on this machine inherit (the run directory's lock: they hold it with the launcher,
  // and keep it while they save if the launcher is killed). Every other descriptor closes on exec.
  std::vector<int> inherit_fds;
};

// The words each rank runs with: the launcher's command line (argv[1..]) without the flags that only the
// launcher acts on (how many ranks, which hosts, the rendezvous; --overwrite, done once before starting).
std::vector<std::string> rank_arguments(const std::vector<std::string>& argv);

// Returns the exit status for the launcher: 0 when every rank succeeded, 130 when interrupted, else
// the first failing rank's status (1 when it was killed by a signal).
int launch_ranks(const LaunchSpec& spec);

}  // namespace ds
