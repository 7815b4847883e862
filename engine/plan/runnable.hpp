// ds — what this version of ds can train, decided from the plan alone: the plans it cannot run on their device
// (device_traits.hpp: what the build lacks, what ds cannot do there yet) or at all yet, each with the reason.
// ds plan shows them, estimate-memory never recommends such a plan, and ds train refuses it before any work
// (adding only what the machine lacks at run time: a GPU the driver shows).
#pragma once

#include <string>
#include <vector>

#include "engine/plan/plan.hpp"

namespace ds {

// Empty when ds trains this plan (on a build that has its device, when the topology does not carry the build).
// `profiling` (ds profile) or the flops_profiler on: what keeps ds from timing a step phase by phase too.
std::vector<std::string> not_yet_runnable(const Plan& plan, bool profiling = false);

// Throws the UserError that lists `why` (not_yet_runnable's, with a caller's own), with the way out: --device cpu
// where only the GPU path is missing. Nothing when `why` is empty. ds train's ranks and its launcher (before it
// starts any rank) say the same.
void refuse_not_runnable(const Plan& plan, const std::vector<std::string>& why);

}  // namespace ds
