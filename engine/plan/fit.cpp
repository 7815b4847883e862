#include "engine/plan/fit.hpp"

#include "common/format.hpp"

namespace ds {

Fit judge_fit(double need, double have, double headroom) {
  if (have <= 0) return Fit::unknown;
  if (need > have) return Fit::does_not_fit;
  return need > (1.0 - headroom) * have ? Fit::within_headroom : Fit::fits;
}

FitCheck check_fit(const Plan& plan, double headroom) {
  const Topology& t = plan.topology;
  FitCheck f;
  f.host_need = plan.host_bytes_per_node();
  f.host_have = t.host_memory_bytes;
  f.host = judge_fit(f.host_need, f.host_have, headroom);
  if (t.device_traits().memory_is_host) {
    f.device = Fit::not_applicable;
  } else {
    f.device_need = plan.memory.device.total();
    f.device_have = t.device_memory_bytes;
    f.device = judge_fit(f.device_need, f.device_have, headroom);
  }
  return f;
}

std::string fit_text(Fit fit, double need, double have, double headroom) {
  const std::string room = format_bytes((1.0 - headroom) * have) + " of " + format_bytes(have) + " usable at headroom " + format_double(headroom);
  switch (fit) {
    case Fit::fits: return "fits (" + room + ")";
    case Fit::within_headroom:
      return "TIGHT: within the headroom (" + room + "; " + format_bytes(have - need) + " would be left for what is not counted)";
    case Fit::does_not_fit: return "DOES NOT FIT (" + format_bytes(have) + " available)";
    case Fit::unknown:
    case Fit::not_applicable: return "";
  }
  return "";
}

}  // namespace ds
