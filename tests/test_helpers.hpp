// Shared by the tests: load a config from text and get its problems as "path: message" lines.
#pragma once

#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <exception>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "engine/plan/plan.hpp"
#include "engine/plan/topology.hpp"
#include "schema/config.hpp"
#include "schema/loader.hpp"

namespace ds::test {

// The problems a config has, or an empty list when it loads.
inline std::vector<ConfigIssue> problems(const std::string& text, const std::vector<std::string>& overrides = {}) {
  try {
    load_config_text(text, "test.json", overrides);
  } catch (const ConfigError& e) {
    return e.issues();
  }
  return {};
}

inline const ConfigIssue* find_issue(const std::vector<ConfigIssue>& issues, const std::string& path) {
  for (const auto& i : issues)
    if (i.path == path) return &i;
  return nullptr;
}

inline std::string dump(const std::vector<ConfigIssue>& issues) {
  std::string out;
  for (const auto& i : issues) out += i.path + ": " + i.message + (i.hint.empty() ? "" : " [" + i.hint + "]") + "\n";
  return out;
}

// A port nothing listens on now (the kernel's pick for port 0), for ranks that meet on this host.
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  return ok ? ntohs(a.sin_port) : 29650;
}

inline std::string read_text(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// ../shared (DeepSpeed's configs, the corpus) sits beside the checkout in CI; a bare clone may lack it.
#define DS_REQUIRE_SHARED_DATA()                                                                    \
  do {                                                                                              \
    if (!std::ifstream(std::string(DS_SHARED_DIR) + "/DESIGN.md"))                                  \
      GTEST_SKIP() << "no ../shared beside the checkout (" DS_SHARED_DIR "): its data is not here"; \
  } while (0)

// The topology of rank `rank` of `world` ranks on one machine (a core each, 8 GiB), as the tests that run
// ranks as threads plan them.
inline Topology thread_ranks(int world, int rank) {
  Topology t;
  t.world_size = t.ranks_per_node = world;
  t.rank = rank;
  t.cores_per_node = world;
  t.host_memory_bytes = 8.0 * (1 << 30);
  t.world_size_source = "test";
  return t;
}

// The plan of rank `rank` of `world` thread ranks for a config text with overrides.
inline Plan plan_of(const std::string& config_text, int world, int rank, const std::vector<std::string>& overrides = {}) {
  Config c = load_config_text(config_text, "test.json", overrides);
  return compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), thread_ranks(world, rank));
}

// The bytes rank `rank` of a split model's plan sends each step: its stage's tensor all-reduces, activations and
// gradients, the tied table's exchange and ZeRO's collectives over its data group, with the step's agreed loss, norm
// and stop flag (the world's).
inline double mesh_bytes_per_step(const Plan& plan, int rank) {
  const PipelineStage& stage = plan.mesh.stages.at(static_cast<size_t>(mesh_coord(plan.mesh.shape, rank).pipeline));
  double bytes = stage.traffic.sent_bytes() + stage.zero_wire_bytes;
  for (const Collective& c : plan.execution.collectives)
    if (c.kind == CollectiveKind::control) bytes += c.wire_bytes_per_rank_per_step;
  return bytes;
}

// Runs `body(rank)` on `world` threads and rethrows the first failure.
inline void on_ranks(int world, const std::function<void(int)>& body) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace ds::test
