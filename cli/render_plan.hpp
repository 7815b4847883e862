// ds — the plan as text for people: one line per decision, a memory table in GiB, the flat layout's
// shards, the collectives per step, and every value ds decided with its source.
#pragma once

#include <string>

#include "engine/plan/plan.hpp"

namespace ds::cli {

std::string render_plan_text(const Plan& plan, bool color, bool full_layout);

}  // namespace ds::cli
