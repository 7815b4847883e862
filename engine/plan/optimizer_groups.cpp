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

int64_t step_cut(const std::vector<StepRun>& runs, int64_t at) {
  for (const StepRun& r : runs)
    if (r.begin < at && at < r.end) return r.begin + (at - r.begin) / kStepGrain * kStepGrain;
  return at;
}

int64_t SubGroup::file_bytes() const { return swap_aligned(numel() * 4); }

namespace {

// [begin, stop) cut into pieces of at most `capacity` elements (at least kStepGrain), each cut on the grain of
// the run it falls in; `begin` must itself be on its run's grain (or between runs). File offsets left at 0.
std::vector<SubGroup> cut_on_grain(const std::vector<StepRun>& runs, int64_t begin, int64_t stop, int64_t capacity) {
  capacity = std::max(capacity, kStepGrain);
  std::vector<SubGroup> groups;
  int64_t start = begin;
  size_t r = 0;  // the first run that may hold the next cut
  while (start < stop) {
    int64_t end = std::min(stop, start + capacity);
    while (r < runs.size() && runs[r].end <= end) ++r;
    if (r < runs.size() && runs[r].begin < end) {
      // The cut falls inside a run: move it back onto the run's grain (still past `start`, since a run that
      // began before `start` was cut on its grain there and capacity >= one grain).
      const StepRun& run = runs[r];
      end = run.begin + (end - run.begin) / kStepGrain * kStepGrain;
      if (end <= start) end = std::min(run.end, start + kStepGrain);
    }
    DS_CHECK(end > start, "sub-group cut at ", start);
    groups.push_back(SubGroup{start, end, 0});
    start = end;
  }
  return groups;
}

}  // namespace

std::vector<SubGroup> optimizer_sub_groups(const std::vector<StepRun>& runs, int64_t local_numel, int64_t capacity) {
  std::vector<SubGroup> groups = cut_on_grain(runs, 0, local_numel, capacity);
  int64_t offset = 0;
  for (SubGroup& g : groups) {
    g.file_offset = offset;
    offset += g.file_bytes();
  }
  return groups;
}

std::vector<SubGroup> staging_windows(const std::vector<SubGroup>& groups, const std::vector<StepRun>& runs, int64_t capacity) {
  std::vector<SubGroup> windows;
  for (const SubGroup& g : groups) {
    const std::vector<SubGroup> part = cut_on_grain(runs, g.begin, g.end, capacity);
    windows.insert(windows.end(), part.begin(), part.end());
  }
  return windows;
}

int64_t swap_aligned(int64_t bytes) { return (bytes + kSwapAlignBytes - 1) / kSwapAlignBytes * kSwapAlignBytes; }

std::vector<SwapTransfer> swap_transfers(std::vector<std::pair<int64_t, int64_t>> ranges, int64_t max_bytes) {
  DS_CHECK(max_bytes >= kSwapAlignBytes && max_bytes % kSwapAlignBytes == 0, "swap transfers of ", max_bytes, " bytes");
  std::sort(ranges.begin(), ranges.end());
  // The blocks around each range, merged with the previous run where they overlap or touch.
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (const auto& [begin, end] : ranges) {
    if (end <= begin) continue;
    const int64_t lo = begin / kSwapAlignBytes * kSwapAlignBytes, hi = swap_aligned(end);
    if (!runs.empty() && lo <= runs.back().second)
      runs.back().second = std::max(runs.back().second, hi);
    else
      runs.push_back({lo, hi});
  }
  std::vector<SwapTransfer> out;
  for (const auto& [lo, hi] : runs)
    for (int64_t at = lo; at < hi; at += max_bytes) out.push_back({at, std::min(max_bytes, hi - at)});
  return out;
}

int64_t swap_transfer_bytes(std::vector<std::pair<int64_t, int64_t>> ranges, int64_t max_bytes) {
  int64_t total = 0;
  for (const SwapTransfer& t : swap_transfers(std::move(ranges), max_bytes)) total += t.bytes;
  return total;
}

int64_t swap_file_bytes(const std::vector<SubGroup>& groups) {
  return groups.empty() ? 0 : groups.back().file_offset + groups.back().file_bytes();
}

}  // namespace ds
