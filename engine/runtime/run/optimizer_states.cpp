#include "engine/runtime/run/optimizer_states.hpp"

#include <algorithm>

#include "common/error.hpp"

namespace ds {

OptimizerStates::OptimizerStates(FlatParams& flat, OptimizerSwapper* swapper) : flat_(flat), swapper_(swapper) {
  bool on_nvme = false;
  for (const StateSpan& s : flat.spans) on_nvme = on_nvme || s.place == Place::nvme;
  DS_CHECK(on_nvme == (swapper != nullptr), "NVMe states without a swapper, or a swapper without them");
  DS_CHECK(flat.states.size() == flat.spans.size(), "a state span without its buffers");
}

namespace {
bool tiles_span(const std::vector<SubGroup>& tiles, const StateSpan& span) {
  return !tiles.empty() && span.place != Place::nvme && tiles.front().begin == span.begin && tiles.back().end == span.end;
}
}  // namespace

int64_t OptimizerStates::largest_chunk(const StateSpan& span) const {
  const bool nvme = span.place == Place::nvme;
  if (!nvme && !tiles_span(flat_.weight_tiles, span)) return span.numel();
  int64_t most = 0;
  for (const SubGroup& g : nvme ? swapper_->sub_groups() : flat_.weight_tiles)
    if (g.begin >= span.begin && g.end <= span.end) most = std::max(most, g.numel());
  return most;
}

void OptimizerStates::for_each(const std::function<void(const StateChunk&)>& fn, bool read, bool write) const {
  for (size_t i = 0; i < flat_.spans.size(); ++i) {
    const StateSpan& span = flat_.spans[i];
    if (span.place != Place::nvme) {
      const FlatParams::States& st = flat_.states[i];
      if (!tiles_span(flat_.weight_tiles, span)) {
        fn(StateChunk{i, span.begin, span.numel(), memory_of(span), st.master, st.exp_avg, st.exp_avg_sq});
        continue;
      }
      const auto part = [&](const torch::Tensor& t, const SubGroup& g) {
        return t.defined() ? t.narrow(0, g.begin - span.begin, g.numel()) : torch::Tensor();
      };
      for (const SubGroup& g : flat_.weight_tiles)
        fn(StateChunk{i, g.begin, g.numel(), memory_of(span), part(st.master, g), part(st.exp_avg, g), part(st.exp_avg_sq, g)});
      continue;
    }
    const int states = swapper_->states();
    swapper_->for_each(
        [&](size_t g, float* const* st) {
          const SubGroup& sub = swapper_->sub_groups()[g];
          DS_CHECK(sub.begin >= span.begin && sub.end <= span.end, "a sub-group outside its span");
          const auto wrap = [&](int s) {
            return s < states ? torch::from_blob(st[s], {sub.numel()}, torch::kFloat32) : torch::Tensor();
          };
          fn(StateChunk{i, sub.begin, sub.numel(), memory_of(span), wrap(0), wrap(1), wrap(2)});
        },
        read, write);
  }
}

}  // namespace ds
