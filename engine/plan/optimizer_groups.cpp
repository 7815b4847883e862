#include "engine/plan/optimizer_groups.hpp"

#include <algorithm>

#include "common/error.hpp"

namespace ds {

std::vector<StepRun> optimizer_runs(const FlatLayout& layout, int rank, bool per_tensor) {
  std::vector<StepRun> runs;
  for (const OwnedSegment& s : owned_segments(layout, rank)) {
    const bool decay = layout.params[static_cast<size_t>(s.param)].weight_decay;
    if (!per_tensor && !runs.empty() && runs.back().end == s.local && runs.back().decay == decay)
      runs.back().end = s.local + s.numel;
    else
      runs.push_back({s.local, s.local + s.numel, decay, s.param});
  }
  return runs;
}

int64_t SubGroup::file_bytes() const {
  const int64_t bytes = numel() * 4;
  return (bytes + kSwapAlignBytes - 1) / kSwapAlignBytes * kSwapAlignBytes;
}

std::vector<SubGroup> optimizer_sub_groups(const std::vector<StepRun>& runs, int64_t local_numel, int64_t capacity) {
  capacity = std::max(capacity, kStepGrain);
  std::vector<SubGroup> groups;
  int64_t start = 0, offset = 0;
  size_t r = 0;  // the first run that may hold the next cut
  while (start < local_numel) {
    int64_t end = std::min(local_numel, start + capacity);
    while (r < runs.size() && runs[r].end <= end) ++r;
    if (r < runs.size() && runs[r].begin < end) {
      // The cut falls inside a run: move it back onto the run's grain (still past `start`, since a run that
      // began before `start` was cut on its grain there and capacity >= one grain).
      const StepRun& run = runs[r];
      end = run.begin + (end - run.begin) / kStepGrain * kStepGrain;
      if (end <= start) end = std::min(run.end, start + kStepGrain);
    }
    DS_CHECK(end > start, "sub-group cut at ", start);
    SubGroup g{start, end, offset};
    offset += g.file_bytes();
    groups.push_back(g);
    start = end;
  }
  return groups;
}

int64_t swap_file_bytes(const std::vector<SubGroup>& groups) {
  return groups.empty() ? 0 : groups.back().file_offset + groups.back().file_bytes();
}

}  // namespace ds
