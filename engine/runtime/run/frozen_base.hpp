// ds — the frozen weights of a fine-tune (model.freeze's tensors, LoRA's base): read from model.init_from (or the
// base a PEFT adapter names) or drawn from the seed, one tensor at a time in fp32, folded into a checksum of the
// whole base (the same at any mesh: a resume or an exported adapter checks it), and each tensor the rank holds (its
// tensor rank's share, a tied head's copy, its stage-3 partition) rounded to the compute dtype and copied into the
// plan's frozen buffers. What checkpoints record of it, and the check a resume makes.
#pragma once

#include <functional>
#include <string>

#include "engine/plan/plan.hpp"
#include "engine/runtime/device/device.hpp"
#include "engine/runtime/run/flat_params.hpp"

namespace ds {

struct FrozenBase {
  std::string record;  // JSON: source, path (absolute, or null when drawn), params, checksum: what checkpoints carry
  std::string note;    // the run log's line when read from a file ("" when drawn)
};

// `data_rank`: the rank's place in its data group (stage 3's partitions); `tensor_ranks`, `tensor_rank`: its tensor
// group (1, 0 without one). `stop_point` is called before each tensor (a signal while starting stops there). Throws
// UserError when a PEFT adapter's recorded base is not the one its config names.
FrozenBase load_frozen_base(const Plan& plan, FlatParams& flat, Device& device, int data_rank, int tensor_ranks, int tensor_rank,
                            const std::function<void(const char*)>& stop_point);

// A run resumed from `resumed_from` continues on the frozen weights it trained on: `theirs` is the checkpoint's
// record ("" when it trained every weight), `ours` this run's. Throws UserError naming both otherwise.
void check_frozen_base(const Plan& plan, const std::string& resumed_from, const std::string& theirs, const std::string& ours);

}  // namespace ds
