// Shared by the tests: load a config from text and get its problems as "path: message" lines.
#pragma once

#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "common/error.hpp"
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

}  // namespace ds::test
