// ds — what this version of ds can train, decided from the plan alone: the plans it cannot run yet on their
// device, each with the reason. ds plan shows them, estimate-memory never recommends such a plan, and ds train
// refuses it before any work (adding only what the build and machine lack: CUDA LibTorch, a visible GPU).
#pragma once

#include <string>
#include <vector>

#include "engine/plan/plan.hpp"

namespace ds {

// Empty when ds trains this plan (on a build that has its device).
std::vector<std::string> not_yet_runnable(const Plan& plan);

}  // namespace ds
