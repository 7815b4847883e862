#include "engine/runtime/launcher.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <csignal>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

namespace ds {
namespace {

std::vector<pid_t> g_children;
volatile sig_atomic_t g_forwarded_signal = 0;

void forward_signal(int sig) {
  g_forwarded_signal = sig;
  for (pid_t p : g_children)
    if (p > 0) kill(p, sig);
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

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + strsignal(WTERMSIG(status));
  return "stopped";
}

}  // namespace

int launch_local_ranks(const LaunchSpec& spec) {
  const std::string exe = self_exe();
  const std::string port = std::to_string(free_local_port());
  std::filesystem::create_directories(spec.log_dir);
  g_children.assign(static_cast<size_t>(spec.nproc), -1);
  g_forwarded_signal = 0;
  auto prev_int = std::signal(SIGINT, forward_signal);
  auto prev_term = std::signal(SIGTERM, forward_signal);

  auto log_path = [&](int r) { return (std::filesystem::path(spec.log_dir) / ("rank_" + std::to_string(r) + ".log")).string(); };
  for (int r = 0; r < spec.nproc; ++r) {
    const pid_t pid = fork();
    if (pid < 0) throw std::runtime_error(std::string("fork failed: ") + std::strerror(errno));
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(spec.nproc).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(spec.nproc).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", port.c_str(), 1);
      if (r > 0) {
        const int fd = open(log_path(r).c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
          dup2(fd, STDOUT_FILENO);
          dup2(fd, STDERR_FILENO);
          close(fd);
        }
      }
      std::vector<char*> argv;
      argv.push_back(const_cast<char*>(exe.c_str()));
      for (const auto& a : spec.args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(exe.c_str(), argv.data());
      _exit(127);
    }
    g_children[static_cast<size_t>(r)] = pid;
  }

  int remaining = spec.nproc, failed_rank = -1, failed_status = 0;
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
    while (r < spec.nproc && g_children[static_cast<size_t>(r)] != pid) ++r;
    if (r == spec.nproc) continue;
    g_children[static_cast<size_t>(r)] = -1;
    --remaining;
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    const bool interrupted = WIFEXITED(status) && WEXITSTATUS(status) == 130 && g_forwarded_signal;
    if (!ok && !interrupted && failed_rank < 0) {
      failed_rank = r;
      failed_status = status;
      // One rank is gone: the others would wait for it at their next collective. End them now.
      for (pid_t p : g_children)
        if (p > 0) kill(p, SIGTERM);
      deadline = std::chrono::steady_clock::now() + spec.grace;
    }
  }
  std::signal(SIGINT, prev_int);
  std::signal(SIGTERM, prev_term);
  if (failed_rank >= 0) {
    std::cerr << "ds train: rank " << failed_rank << " of " << spec.nproc << " " << describe_status(failed_status)
              << "; the other ranks were stopped";
    if (failed_rank > 0)
      std::cerr << ". Last lines of " << log_path(failed_rank) << ":\n" << last_lines(log_path(failed_rank), 12);
    else
      std::cerr << " (its output is above)\n";
    return WIFEXITED(failed_status) && WEXITSTATUS(failed_status) != 0 ? WEXITSTATUS(failed_status) : 1;
  }
  return g_forwarded_signal ? 130 : 0;
}

}  // namespace ds
