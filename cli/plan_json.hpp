// ds — the Plan as JSON: `ds plan --json` and the plan stored in every checkpoint. Versioned by
// kPlanSchemaVersion (engine/plan/plan.hpp); fields are only ever added.
#pragma once

#include <string>

#include "engine/plan/plan.hpp"

namespace ds {

std::string plan_to_json(const Plan& plan, int indent = 2);

}  // namespace ds
