#include "cli/launcher.hpp"

#include "common/strings.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "common/error.hpp"
#include "common/stop_signals.hpp"

namespace ds {
namespace {

// Read by forward_signal on the signals' own thread (common/stop_signals.hpp) while the launcher's loop
// runs: sized before the handler is set, each entry atomic.
std::vector<std::atomic<pid_t>> g_children;
std::vector<char> g_remote;    // per rank: started over ssh (signals reach it through its lifeline instead)
std::vector<std::atomic<int>> g_lifelines;  // per rank: write end of a remote rank's ssh input (closing it interrupts the rank), else -1
std::atomic<int> g_forwarded_signal{0};

void cut_lifelines() {
  for (std::atomic<int>& lifeline : g_lifelines)
    if (const int fd = lifeline.exchange(-1); fd >= 0) close(fd);
}

void forward_signal(int sig) {
  g_forwarded_signal = sig;
  for (size_t r = 0; r < g_children.size(); ++r)
    if (g_children[r] > 0 && !g_remote[r]) kill(g_children[r], sig);
  cut_lifelines();  // remote ranks: their watcher interrupts them, and ssh brings back their exit status
}

int free_local_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;  // the kernel picks
  socklen_t len = sizeof a;
  int port = 29500;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) close(fd);
  return port;
}

std::string self_exe() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw std::runtime_error("cannot find this program's path (/proc/self/exe)");
  return std::string(buf, static_cast<size_t>(n));
}

std::string last_lines(const std::string& path, size_t count) {
  std::ifstream f(path);
  std::deque<std::string> lines;
  for (std::string line; std::getline(f, line);) {
    lines.push_back(line);
    if (lines.size() > count) lines.pop_front();
  }
  std::string out;
  for (const auto& l : lines) out += "    " + l + "\n";
  return out;
}

// True when the process is stopped (state T or t in /proc/PID/stat).
bool is_stopped(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  const size_t paren = line.rfind(')');  // the command name may hold spaces and parentheses
  return paren != std::string::npos && paren + 2 < line.size() && (line[paren + 2] == 'T' || line[paren + 2] == 't');
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + strsignal(WTERMSIG(status));
  return "stopped";
}

bool is_this_machine(const std::string& host) {
  if (host == "localhost" || host == "127.0.0.1" || host == "::1") return true;
  char name[256] = {};
  return gethostname(name, sizeof name - 1) == 0 && host == name;
}

std::vector<std::string> split_words(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

}  // namespace

std::vector<LaunchHost> read_hostfile(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw UserError("cannot read hostfile '" + path + "'", "give a file of 'hostname slots=N' lines");
  std::vector<LaunchHost> hosts;
  int line_no = 0;
  for (std::string line; std::getline(f, line);) {
    ++line_no;
    if (const auto hash = line.find('#'); hash != std::string::npos) line.erase(hash);
    const auto words = split_words(line);
    if (words.empty()) continue;
    LaunchHost h;
    h.name = words[0];
    const std::string where = path + ":" + std::to_string(line_no);
    if (words.size() != 2 || words[1].rfind("slots=", 0) != 0)
      throw UserError(where + ": '" + line + "' is not 'hostname slots=N'", "one host per line, e.g. worker-1 slots=8");
    char* end = nullptr;
    const long n = std::strtol(words[1].c_str() + 6, &end, 10);
    if (*end != '\0' || n < 1 || n > (1 << 16)) throw UserError(where + ": slots must be a positive integer", "");
    h.slots = static_cast<int>(n);
    for (const auto& other : hosts)
      if (other.name == h.name) throw UserError(where + ": host '" + h.name + "' is listed twice", "give each host one line");
    hosts.push_back(h);
  }
  if (hosts.empty()) throw UserError("hostfile '" + path + "' lists no hosts", "one 'hostname slots=N' per line");
  return hosts;
}

namespace {

// One rank's place: its host, its index and count there, whether that host is this machine.
struct Placed {
  std::string host;
  int local_rank = 0, local_world = 1;
  bool here = true;
};

// What every rank is started with.
struct RankStart {
  const LaunchSpec& spec;
  const std::vector<Placed>& ranks;
  std::string exe, addr, port, cwd;
  std::vector<std::string> ssh;
  std::string log_path(int r) const {
    return (std::filesystem::path(spec.log_dir) / ("rank_" + std::to_string(r) + ".log")).string();
  }
};

// In the forked child: becomes rank r (here, with torchrun's variables; elsewhere, through ssh). Never returns.
[[noreturn]] void exec_rank(const RankStart& st, int r, const int lifeline[2], pid_t launcher_pid) {
  // A rank dies with its launcher (kill -9 included): SIGTERM makes it save after the current step
  // and exit, as its peers get the same signal. (The launcher may already be gone by now.)
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  unblock_stop_signals_in_child();  // the launcher blocks them in every thread; ssh and the rank must not
  if (getppid() != launcher_pid) _exit(143);
  const Placed& p = st.ranks[static_cast<size_t>(r)];
  const std::vector<std::pair<std::string, std::string>> env{
      {"RANK", std::to_string(r)},          {"LOCAL_RANK", std::to_string(p.local_rank)},
      {"WORLD_SIZE", std::to_string(st.spec.nproc)}, {"LOCAL_WORLD_SIZE", std::to_string(p.local_world)},
      {"MASTER_ADDR", st.addr},             {"MASTER_PORT", st.port}};
  if (r > 0) {
    const int fd = open(st.log_path(r).c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW, 0644);  // never through a link
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
      close(fd);
    }
  }
  if (lifeline[0] >= 0) {
    dup2(lifeline[0], STDIN_FILENO);
    close(lifeline[0]);
    close(lifeline[1]);
  }
  std::vector<std::string> argv;
  if (p.here) {
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    for (int fd : st.spec.inherit_fds) fcntl(fd, F_SETFD, 0);  // the run directory's lock goes with the rank
    argv.push_back(st.exe);
    argv.insert(argv.end(), st.spec.args.begin(), st.spec.args.end());
  } else {
    // One shell command on the remote host: same directory, the rank's environment, same binary; a
    // watcher interrupts the rank (as Ctrl-C would) when ssh's input closes.
    // (An asynchronous list's input is /dev/null unless redirected: the watcher reads fd 3, a copy.)
    std::string command = "cd " + shell_quote(st.cwd) + " && exec 3<&0 && { env";
    for (const auto& [k, v] : env) command += " " + k + "=" + shell_quote(v);
    for (const char* pass : {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "DS_RUN_LOCK", "DS_LAUNCH_COMMAND"})
      if (const char* v = std::getenv(pass)) command += std::string(" ") + pass + "=" + shell_quote(v);
    command += " " + shell_quote(st.exe);
    for (const auto& a : st.spec.args) command += " " + shell_quote(a);
    command += " </dev/null 3<&- & rank=$!; { cat >/dev/null; kill -INT $rank; } <&3 >/dev/null 2>&1 & watcher=$!; "
               "wait $rank; status=$?; kill $watcher 2>/dev/null; exit $status; }";
    argv = st.ssh;
    argv.push_back(p.host);
    argv.push_back(command);
  }
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  execvp(cargv[0], cargv.data());
  std::fprintf(stderr, "ds train: cannot start rank %d: %s: %s\n", r, cargv[0], std::strerror(errno));
  _exit(127);
}

// Starts rank r and records its pid (and a remote rank's lifeline: the pipe its ssh reads).
void start_rank(const RankStart& st, int r) {
  // A remote rank's ssh reads a pipe we hold open: when ssh goes (killed, or the launcher is), the
  // remote watcher sees end-of-file and interrupts the rank, so nothing is left running there.
  int lifeline[2] = {-1, -1};
  if (!st.ranks[static_cast<size_t>(r)].here && pipe(lifeline) != 0)
    throw std::runtime_error(std::string("pipe failed: ") + std::strerror(errno));
  const pid_t launcher_pid = getpid();
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error(std::string("fork failed: ") + std::strerror(errno));
  if (pid == 0) exec_rank(st, r, lifeline, launcher_pid);
  g_children[static_cast<size_t>(r)] = pid;
  if (lifeline[0] >= 0) {
    close(lifeline[0]);
    fcntl(lifeline[1], F_SETFD, FD_CLOEXEC);  // later ranks' children must not hold it
    g_lifelines[static_cast<size_t>(r)] = lifeline[1];
  }
}

// How the ranks ended: the first to fail (and how), and a rank found stopped then.
struct RanksEnded {
  int failed_rank = -1, failed_status = 0, stopped_rank = -1;
};

// Reaps every rank. The first one to fail ends the others (they would wait for it at their next
// collective); any still there after the grace period are killed.
RanksEnded wait_for_ranks(int nproc, std::chrono::milliseconds grace) {
  RanksEnded e;
  int remaining = nproc;
  auto deadline = std::chrono::steady_clock::time_point::max();
  bool killed = false;
  while (remaining > 0) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid == 0) {
      if (std::chrono::steady_clock::now() > deadline && !killed) {
        for (pid_t p : g_children)
          if (p > 0) kill(p, SIGKILL);
        killed = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    int r = 0;
    while (r < nproc && g_children[static_cast<size_t>(r)] != pid) ++r;
    if (r == nproc) continue;
    g_children[static_cast<size_t>(r)] = -1;
    --remaining;
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    // After Ctrl-C or SIGTERM a rank ends with 130/143 once it has saved, or dies of the signal itself when
    // it came before the rank installed its handler (its first second or so): both are the user's stop.
    const bool by_stop_signal = (WIFEXITED(status) && (WEXITSTATUS(status) == 130 || WEXITSTATUS(status) == 143)) ||
                                (WIFSIGNALED(status) && (WTERMSIG(status) == SIGINT || WTERMSIG(status) == SIGTERM));
    const bool interrupted = by_stop_signal && g_forwarded_signal;
    if (ok || interrupted || e.failed_rank >= 0) continue;
    e.failed_rank = r;
    e.failed_status = status;
    // A rank that is stopped (SIGSTOP, a debugger) makes the others time out: it is the one to name.
    for (int other = 0; other < nproc; ++other)
      if (const pid_t p = g_children[static_cast<size_t>(other)]; p > 0 && !g_remote[static_cast<size_t>(other)] && is_stopped(p))
        e.stopped_rank = other;
    for (pid_t p : g_children)
      if (p > 0) kill(p, SIGKILL);
    cut_lifelines();
    deadline = std::chrono::steady_clock::now() + grace;
  }
  return e;
}

// Names the rank that failed (and a stopped one that made it fail); returns the launcher's exit code.
int report_failure(const RankStart& st, const RanksEnded& e) {
  const int nproc = st.spec.nproc;
  if (e.stopped_rank >= 0) {
    std::cerr << "ds train: rank " << e.stopped_rank << " of " << nproc
              << " was stopped (SIGSTOP or a debugger) and never reached the collective the others waited in; rank "
              << e.failed_rank << " gave up after train.comm_timeout_s and the other ranks were stopped\n";
    return 1;
  }
  const Placed& where = st.ranks[static_cast<size_t>(e.failed_rank)];
  std::cerr << "ds train: rank " << e.failed_rank << " of " << nproc << (where.here ? "" : " (on " + where.host + ")") << " "
            << describe_status(e.failed_status) << "; the other ranks were stopped";
  if (e.failed_rank > 0)
    std::cerr << ". Last lines of " << st.log_path(e.failed_rank) << ":\n" << last_lines(st.log_path(e.failed_rank), 12);
  else
    std::cerr << " (its output is above)\n";
  return WIFEXITED(e.failed_status) && WEXITSTATUS(e.failed_status) != 0 ? WEXITSTATUS(e.failed_status) : 1;
}

}  // namespace

int launch_ranks(const LaunchSpec& spec_in) {
  LaunchSpec spec = spec_in;
  if (spec.hosts.empty()) spec.hosts = {{"localhost", spec.nproc}};
  std::vector<Placed> ranks;
  bool all_here = true;
  for (const auto& h : spec.hosts) {
    const bool here = is_this_machine(h.name);
    all_here = all_here && here;
    for (int i = 0; i < h.slots; ++i) ranks.push_back({h.name, i, h.slots, here});
  }
  spec.nproc = static_cast<int>(ranks.size());
  const char* ssh_env = std::getenv("DS_SSH");
  const RankStart st{spec,
                     ranks,
                     self_exe(),
                     !spec.master_addr.empty() ? spec.master_addr : all_here ? "127.0.0.1" : spec.hosts[0].name,
                     std::to_string(spec.master_port > 0 ? spec.master_port : all_here ? free_local_port() : 29500),
                     std::filesystem::current_path().string(),
                     split_words(ssh_env && *ssh_env ? ssh_env : "ssh -o BatchMode=yes")};
  std::filesystem::create_directories(spec.log_dir);
  g_children = std::vector<std::atomic<pid_t>>(static_cast<size_t>(spec.nproc));
  g_lifelines = std::vector<std::atomic<int>>(static_cast<size_t>(spec.nproc));
  g_remote.assign(static_cast<size_t>(spec.nproc), 0);
  for (size_t r = 0; r < ranks.size(); ++r) {
    g_children[r] = -1;
    g_lifelines[r] = -1;
    g_remote[r] = !ranks[r].here;
  }
  g_forwarded_signal = 0;
  const StopHandler previous = set_stop_handler(forward_signal);
  for (int r = 0; r < spec.nproc; ++r) start_rank(st, r);
  const RanksEnded ended = wait_for_ranks(spec.nproc, spec.grace);
  cut_lifelines();
  set_stop_handler(previous);
  if (ended.failed_rank >= 0) return report_failure(st, ended);
  return g_forwarded_signal == SIGTERM ? 143 : g_forwarded_signal ? 130 : 0;
}

std::vector<std::string> rank_arguments(const std::vector<std::string>& argv) {
  std::vector<std::string> out;
  for (size_t i = 0; i < argv.size(); ++i) {
    bool launcher_only = argv[i] == "--overwrite";  // --no-fit-check goes on: ranks check too
    for (const char* flag : {"--nproc-per-node", "--gpus", "--num_gpus", "--num-gpus", "--hostfile", "--master-addr",
                             "--master_addr", "--master-port", "--master_port"}) {
      if (argv[i] == flag) {
        ++i;  // and its value
        launcher_only = true;
        break;
      }
      if (argv[i].rfind(std::string(flag) + "=", 0) == 0) launcher_only = true;
    }
    if (!launcher_only) out.push_back(argv[i]);
  }
  return out;
}

}  // namespace ds
