// Optimizer offload to NVMe as a user meets it: a run killed with SIGKILL mid-swap resumes from its last
// checkpoint and names the swap directory the dead run left (with the command that removes it); a bad
// nvme_path is exit 2 before any work.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "cli_helpers.hpp"

namespace fs = std::filesystem;
using namespace cli_test;

TEST(CliOffload, KillNineDuringAnNvmeRunThenResumeContinuesAndNamesTheStaleSwapDirectory) {
  const std::string dir = scratch_dir() + "/nvme_kill", nvme = scratch_dir() + "/nvme_kill_swap";
  fs::remove_all(dir);
  fs::remove_all(nvme);
  fs::create_directories(nvme);
  const std::string config = "examples/offload-nvme.json zero_optimization.offload_optimizer.nvme_path=" + nvme +
                             " train.output_dir=" + dir + " train.save_every=5";
  // Killed once step 7 is logged: the checkpoint of step 5 is complete by then (saved before step 6 began).
  Result r = ds_signalled("train " + config + " train.steps=100000", SIGKILL, dir + "/metrics.jsonl", 7, 0.05);
  ASSERT_EQ(r.code, -SIGKILL) << r.err;
  std::ifstream latest(dir + "/checkpoints/latest");
  std::string name;
  latest >> name;
  ASSERT_EQ(name.rfind("step_", 0), 0u) << "no checkpoint before the kill";
  const int saved = std::stoi(name.substr(5));
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(nvme)) left.push_back(e.path().string());
  ASSERT_EQ(left.size(), 1u) << "the killed run's swap directory";
  r = ds("train " + config + " train.steps=" + std::to_string(saved + 3) + " --resume");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "resuming from")) << r.err;
  EXPECT_TRUE(contains(r.err, "(3 this run)")) << r.err;
  EXPECT_TRUE(contains(r.err, left[0] + " (")) << r.err;
  EXPECT_TRUE(contains(r.err, "which is gone: remove it with `rm -r " + left[0] + "`")) << r.err;
  // The resumed run removed its own swap directory and left the dead one for the user to remove.
  EXPECT_TRUE(fs::exists(left[0]));
  EXPECT_EQ(std::distance(fs::directory_iterator(nvme), fs::directory_iterator()), 1);
  fs::remove_all(nvme);
}

TEST(CliOffload, AMissingNvmePathIsExitTwoNamingThePath) {
  Result r = ds("train examples/offload-nvme.json zero_optimization.offload_optimizer.nvme_path=/nonexistent/nvme train.steps=1 "
                "train.output_dir=" + scratch_dir() + "/nvme_missing");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "'/nonexistent/nvme' does not exist")) << r.err;
  EXPECT_TRUE(contains(r.err, "mkdir -p /nonexistent/nvme")) << r.err;
  EXPECT_FALSE(fs::exists(scratch_dir() + "/nvme_missing/checkpoints")) << "nothing is written before the check";
}
