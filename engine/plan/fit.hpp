// ds — the one rule for "does it fit": ds plan's verdict, the "auto" choices of the plan, estimate-memory's
// rows and ds train's refusal all judge a plan's memory here, against the topology's device and host memory,
// leaving `headroom` of each free for what the memory model does not count (allocator slack, the CUDA
// context, library workspaces).
#pragma once

#include <string>

#include "engine/plan/plan.hpp"

namespace ds {

// unknown: no memory size to judge against (a GPU not given, a host not known); not_applicable: a CPU run's
// device is its host, judged there.
enum class Fit { unknown, not_applicable, fits, within_headroom, does_not_fit };

struct FitCheck {
  Fit device = Fit::unknown, host = Fit::unknown;
  double device_need = 0, device_have = 0;  // one rank's device memory
  double host_need = 0, host_have = 0;      // one node's host memory (on a CPU run, its devices' too)
  // Nothing known to be short, counting the headroom as taken.
  bool fits() const { return device != Fit::within_headroom && device != Fit::does_not_fit && host != Fit::within_headroom && host != Fit::does_not_fit; }
  bool does_not_fit() const { return device == Fit::does_not_fit || host == Fit::does_not_fit; }
};

Fit judge_fit(double need, double have, double headroom);
FitCheck check_fit(const Plan& plan, double headroom);

// "fits (72.00 GiB of 80.00 GiB free for it)", "DOES NOT FIT (...)", or "" when unknown or not applicable.
std::string fit_text(Fit fit, double need, double have, double headroom);

}  // namespace ds
