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
// Whether the plan's weight tiles cut `span` (a staged span: the tiles of one in memory, the windows of an NVMe one's
// sub-groups).
bool tiles_span(const std::vector<SubGroup>& tiles, const StateSpan& span) {
  return !tiles.empty() && tiles.front().begin == span.begin && tiles.back().end == span.end;
}

// Elements [g.begin, g.end) of `t`, a tensor of the elements from `from` on (undefined stays undefined).
torch::Tensor part(const torch::Tensor& t, int64_t from, const SubGroup& g) {
  return t.defined() ? t.narrow(0, g.begin - from, g.numel()) : torch::Tensor();
}
}  // namespace

int64_t OptimizerStates::largest_chunk(const StateSpan& span) const {
  const bool tiled = tiles_span(flat_.weight_tiles, span);
  if (span.place != Place::nvme && !tiled) return span.numel();
  int64_t most = 0;
  for (const SubGroup& g : tiled ? flat_.weight_tiles : swapper_->sub_groups())
    if (g.begin >= span.begin && g.end <= span.end) most = std::max(most, g.numel());
  return most;
}

StateChunk OptimizerStates::tile_chunk(size_t tile) const {
  const StateSpan& span = flat_.spans.at(0);
  DS_CHECK(span.place != Place::nvme && tiles_span(flat_.weight_tiles, span) && tile < flat_.weight_tiles.size(),
           "weight tile ", tile, " of a span not tiled in memory");
  const FlatParams::States& st = flat_.states[0];
  const SubGroup& g = flat_.weight_tiles[tile];
  return StateChunk{0, g.begin, g.numel(), memory_of(span), part(st.master, span.begin, g), part(st.exp_avg, span.begin, g),
                    part(st.exp_avg_sq, span.begin, g)};
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
      for (const SubGroup& g : flat_.weight_tiles)
        fn(StateChunk{i, g.begin, g.numel(), memory_of(span), part(st.master, span.begin, g), part(st.exp_avg, span.begin, g),
                      part(st.exp_avg_sq, span.begin, g)});
      continue;
    }
    const int states = swapper_->states();
    // A staged span's sub-groups are stepped in the plan's windows once read in (a window's weights per staging buffer).
    const std::vector<SubGroup>* windows = tiles_span(flat_.weight_tiles, span) ? &flat_.weight_tiles : nullptr;
    size_t next = 0;  // the first window not yet stepped
    swapper_->for_each(
        [&](size_t g, float* const* st) {
          const SubGroup& sub = swapper_->sub_groups()[g];
          DS_CHECK(sub.begin >= span.begin && sub.end <= span.end, "a sub-group outside its span");
          const auto wrap = [&](int s) {
            return s < states ? torch::from_blob(st[s], {sub.numel()}, torch::kFloat32) : torch::Tensor();
          };
          const torch::Tensor master = wrap(0), exp_avg = wrap(1), exp_avg_sq = wrap(2);
          if (!windows) {
            fn(StateChunk{i, sub.begin, sub.numel(), memory_of(span), master, exp_avg, exp_avg_sq});
            return;
          }
          while (next < windows->size() && (*windows)[next].end <= sub.begin) ++next;  // (sub-groups not read this walk)
          for (; next < windows->size() && (*windows)[next].begin < sub.end; ++next) {
            const SubGroup& w = (*windows)[next];
            DS_CHECK(w.begin >= sub.begin && w.end <= sub.end, "a window across sub-groups ", sub.begin, "-", sub.end);
            fn(StateChunk{i, w.begin, w.numel(), memory_of(span), part(master, sub.begin, w), part(exp_avg, sub.begin, w),
                          part(exp_avg_sq, sub.begin, w)});
          }
        },
        read, write);
  }
}

}  // namespace ds
