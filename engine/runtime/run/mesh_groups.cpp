#include "engine/runtime/run/mesh_groups.hpp"

#include <algorithm>
#include <string>

namespace ds {

MeshGroups::MeshGroups(const Plan& plan, Communicator* world_comm) : world(world_comm), data_comm(world_comm) {
  if (!world || !plan.mesh.shape.splits_the_model()) return;
  // A group of one rank needs no communicator. The pipeline's stages only send each other messages.
  const auto split = [&](MeshAxis axis) -> std::unique_ptr<Communicator> {
    for (const std::vector<int>& g : mesh_groups(plan.mesh.shape, axis))
      if (g.size() > 1 && std::find(g.begin(), g.end(), world->rank()) != g.end()) {
        const std::string name = std::string(mesh_axis_name(axis)) + "-" + std::to_string(g.front());
        return axis == MeshAxis::pipeline ? world->split_for_messages(name, g) : world->split(name, g);
      }
    return nullptr;
  };
  tensor = split(MeshAxis::tensor);
  data = split(MeshAxis::data);
  pipeline = split(MeshAxis::pipeline);
  data_comm = data.get();
  const MeshShape& shape = plan.mesh.shape;
  const MeshCoord at = mesh_coord(shape, world->rank());
  if (shape.pipeline > 1 && plan.mesh.tied_exchange() && (at.pipeline == 0 || at.pipeline == shape.pipeline - 1)) {
    const std::vector<int> ends{mesh_rank(shape, {at.data, at.tensor, 0}), mesh_rank(shape, {at.data, at.tensor, shape.pipeline - 1})};
    tied = world->split_for_messages("tied-" + std::to_string(ends.front()), ends);  // (the table's gradient and weights)
  }
  if (!plan.execution.sharded && at.data == 0) {
    std::vector<int> ranks;
    for (int r = 0; r < world->world_size(); ++r)
      if (mesh_coord(shape, r).data == 0) ranks.push_back(r);
    if (ranks.size() > 1) writers = world->split("writers", ranks);
  }
}

std::vector<Communicator*> MeshGroups::all() const {
  std::vector<Communicator*> out;
  for (Communicator* c : {world, tensor.get(), data.get(), pipeline.get(), tied.get(), writers.get()})
    if (c) out.push_back(c);
  return out;
}

void MeshGroups::settle() const {
  for (Communicator* c : all()) c->settle();
}

void MeshGroups::abort(const std::string& reason) const {
  for (Communicator* c : all()) c->abort(reason);
}

CommLedger MeshGroups::ledger() const {
  CommLedger sum;
  for (const Communicator* c : all())
    for (const auto& [kind, st] : c->ledger()) {
      CommStats& into = sum[kind];
      into.op = st.op;
      into.calls += st.calls;
      into.bytes += st.bytes;
      into.seconds += st.seconds;
    }
  return sum;
}

}  // namespace ds
