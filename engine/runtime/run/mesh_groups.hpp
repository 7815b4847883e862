// ds — the communicators one rank of a split model runs over: the mesh's groups (engine/plan/mesh's
// mesh_groups) that hold it, split from the world's communicator. Its tensor group carries the model's
// all-reduces, its data group ZeRO's collectives (and decides the batches it reads), its pipeline group the
// stages' sends; the tied group is the first and the last stage's ranks of a tied token table; the writers
// are the ranks of data rank 0, who write a checkpoint at ZeRO stage 0. The pipeline and tied groups carry
// messages only (Communicator::split_for_messages).
#pragma once

#include <memory>
#include <vector>

#include "engine/plan/plan.hpp"
#include "engine/runtime/comm/comm.hpp"

namespace ds {

struct MeshGroups {
  MeshGroups() = default;
  // Forms this rank's groups: every rank calls it, and forms them in the same order. `world` null (one rank),
  // or a model the plan does not split: no groups, and the data group is the world.
  MeshGroups(const Plan& plan, Communicator* world);

  Communicator* world = nullptr;  // borrowed
  // Each null where this rank is in no such group of two or more ranks.
  std::unique_ptr<Communicator> tensor, data, pipeline, tied, writers;
  Communicator* data_comm = nullptr;  // ZeRO's: the data group, or the world when the model is whole

  // The world's communicator and the groups, those this rank has.
  std::vector<Communicator*> all() const;
  // What they have counted, kind by kind, summed.
  CommLedger ledger() const;
  // Before the host reads what the device computed: each communicator's collectives so far end, or time out
  // naming the step (Communicator::settle; a split model's go over its groups, not the world's).
  void settle() const;
  // This rank failed with `reason`: each communicator is told (Communicator::abort).
  void abort(const std::string& reason) const;
};

}  // namespace ds
