// ds — how the optimizer walks a rank's local buffer: the runs it steps with one kernel call each, and,
// when its states are swapped to NVMe, the sub-groups those runs are cut into (each read, stepped and
// written back as a unit). Pure: the plan counts the swap files' bytes from here, the runtime steps
// and swaps exactly these ranges.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "engine/plan/layout.hpp"

namespace ds {

// A run of local elements stepped by one kernel call: consecutive parameters that share a weight-decay
// setting (Adam, SGD), or one parameter's part (`per_tensor`: Lamb, whose trust ratio is per tensor).
struct StepRun {
  int64_t begin = 0, end = 0;  // local elements
  bool decay = false;
  int param = 0;  // the first parameter in the run
};
std::vector<StepRun> optimizer_runs(const FlatLayout& layout, int rank, bool per_tensor);

// The vectorised kernels step 16 elements at a time from the start of a run and the last few one by one,
// so a run is only ever cut this many elements from where it starts: the update of every element is then
// bit for bit the one an uncut run gives.
constexpr int64_t kStepGrain = 16;
// NVMe I/O runs in whole blocks of this many bytes (O_DIRECT), so every sub-group starts its files on one.
constexpr int64_t kSwapAlignBytes = 4096;

// `at` moved back onto the grain of the run it falls inside (unchanged between runs): where a rank's
// local part may be split between two places (partial offload) without changing a bit of the update.
int64_t step_cut(const std::vector<StepRun>& runs, int64_t at);

struct SubGroup {
  int64_t begin = 0, end = 0;  // local elements [begin, end)
  int64_t file_offset = 0;     // bytes: where its elements start in each state's swap file
  int64_t numel() const { return end - begin; }
  int64_t file_bytes() const;  // its elements' bytes rounded up to kSwapAlignBytes
};

// Cuts [0, local_numel) into sub-groups of at most `capacity` elements (at least kStepGrain), each ending
// on a run's grain, laid out one after another in the swap files.
std::vector<SubGroup> optimizer_sub_groups(const std::vector<StepRun>& runs, int64_t local_numel, int64_t capacity);
// Each sub-group cut into windows of at most `capacity` elements on the runs' grain, in order (file offsets 0: a
// window is stepped from its sub-group's buffers, never read or written on its own).
std::vector<SubGroup> staging_windows(const std::vector<SubGroup>& groups, const std::vector<StepRun>& runs, int64_t capacity);
// Bytes of one state's swap file.
int64_t swap_file_bytes(const std::vector<SubGroup>& groups);

// `bytes` rounded up to whole swap blocks.
int64_t swap_aligned(int64_t bytes);

// NVMe parameter offload: a rank's partition is one file in the parameters' dtype, and a gather reads its
// parameters' partitions as the whole blocks around them, merged where they touch, in transfers of at most
// `max_bytes` (the host buffers they stream through). `ranges`: byte ranges [begin, end) in the file.
struct SwapTransfer {
  int64_t offset = 0, bytes = 0;
};
std::vector<SwapTransfer> swap_transfers(std::vector<std::pair<int64_t, int64_t>> ranges, int64_t max_bytes);
// The bytes those transfers move.
int64_t swap_transfer_bytes(std::vector<std::pair<int64_t, int64_t>> ranges, int64_t max_bytes);

}  // namespace ds
