// ds — the host's offload work in a step, span by span, as it runs (ds profile): its waits for the gradients' copies
// and the copies it makes itself, the gradients summed in host memory as they arrive, the optimizer's step of the
// host's states (tile by tile where it is tiled), its waits for and copies of the updated weights, the speculated
// tiles' backup. The plan predicts each as a row of its offload table (engine/plan/step_time.hpp); the profile sets
// them side by side. Off unless a run keeps its step measurements: then a clock read before and after each piece.
#pragma once

#include <chrono>
#include <utility>
#include <vector>

#include "engine/runtime/run/trainer_api.hpp"

namespace ds {

class HostWorkLog {
 public:
  using Clock = std::chrono::steady_clock;
  bool on = false;
  // Where the step is (set by the step's driver and ZeRO's hooks): copied into each span taken.
  HostWorkSpan::During during = HostWorkSpan::During::after;
  int64_t micro_step = -1, hook = -1;

  // Runs `work` and keeps its span under `what` (an offload row's name; a string literal).
  template <class Work>
  void time(const char* what, int64_t index, Work&& work) {
    if (!on) return std::forward<Work>(work)();
    const Clock::time_point begin = Clock::now();
    std::forward<Work>(work)();
    add(what, index, begin, Clock::now());
  }
  // A span timed by the caller (parts of one piece of work measured apart).
  void add(const char* what, int64_t index, Clock::time_point begin, Clock::time_point end) {
    if (on) spans_.push_back({what, index, hook, micro_step, during, begin, end});
  }
  // The spans since the last take, timed from `step_start`.
  std::vector<HostWorkSpan> take(Clock::time_point step_start) {
    std::vector<HostWorkSpan> out;
    for (const Taken& t : spans_)
      out.push_back({t.what, t.index, t.hook, t.micro_step, t.during, std::chrono::duration<double>(t.begin - step_start).count(),
                     std::chrono::duration<double>(t.end - t.begin).count()});
    spans_.clear();
    return out;
  }

 private:
  struct Taken {
    const char* what;
    int64_t index, hook, micro_step;
    HostWorkSpan::During during;
    Clock::time_point begin, end;
  };
  std::vector<Taken> spans_;
};

}  // namespace ds
