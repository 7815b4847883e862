#include "engine/runtime/run/frozen_base.hpp"

#include <filesystem>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/hash.hpp"
#include "engine/runtime/io/weights.hpp"
#include "engine/runtime/model/language_model.hpp"
#include "engine/runtime/model/tensor_parallel.hpp"

namespace ds {

FrozenBase load_frozen_base(const Plan& plan, FlatParams& flat, Device& device, int data_rank, int tensor_ranks, int tensor_rank,
                            const std::function<void(const char*)>& stop_point) {
  const ModelSpec& model = plan.model;
  std::unique_ptr<WeightSource> source;
  std::vector<std::string> names;
  std::unique_ptr<InitialWeights> drawn;
  std::string adapter_base_checksum, adapter_path;  // an adapter ds exported records its base's checksum
  if (!plan.run.init_from.empty()) {
    source = open_weights(plan.run.init_from);
    if (source->kind() == WeightsKind::peft_adapter) {  // the adapter continues on the base it names
      adapter_base_checksum = source->base_checksum;
      adapter_path = source->path();
      source = open_adapter_base(*source);
    }
    names = match_weights(*source, model);
  } else {
    drawn = std::make_unique<InitialWeights>(plan, plan.run.seed, true);  // what a full run from this seed starts from
  }
  // One tensor at a time: read (or drawn) in fp32, summed into the checksum whole, rounded to the compute
  // dtype on the host and copied to the device: whole, or this rank's partition where stage 3 gathers it. A rank
  // of a split model reads the whole base for its checksum (the same at any mesh, so a resume or an adapter export
  // checks it) and keeps its own tensors (a tied head's copy too), each its tensor rank's share.
  const ZeroExecution& z = plan.execution;
  const StageShare& own = plan.own;
  std::vector<std::vector<size_t>> held(model.tensors.size());  // per tensor of the model: where the rank holds it
  for (size_t j = 0; j < own.tensors.size(); ++j)
    if (own.is_frozen(j)) held[static_cast<size_t>(own.tensors[j].whole)].push_back(j);
  uint64_t checksum = kWeightsChecksumSeed;
  std::vector<float> values;
  for (size_t i = 0; i < model.tensors.size(); ++i) {
    if (!plan.is_frozen(i)) continue;  // model.freeze: what trains is drawn into the layout
    stop_point(source ? "reading the frozen base" : "drawing the frozen base");
    const int64_t n = model.tensors[i].numel;
    const float* v = nullptr;
    if (source) {
      values.resize(static_cast<size_t>(n));
      source->read_f32(names[i], values.data());
      v = values.data();
    } else {
      v = drawn->param(static_cast<int>(i));
    }
    checksum = fold_weights_checksum(checksum, v, n);
    if (held[i].empty()) continue;
    torch::Tensor share;  // a tensor rank's share (its vocabulary rows padded), else the whole
    if (tensor_ranks > 1) {
      const TensorSpec& t = model.tensors[i];
      share = take_share(torch::from_blob(const_cast<float*>(v), t.shape, torch::kFloat32), tensor_slice_of(model, t, tensor_ranks, tensor_rank))
                  .view(-1);
      v = share.data_ptr<float>();
    }
    for (const size_t j : held[i]) {
      const int64_t n_held = own.model.tensors[j].numel;
      torch::Tensor dest;
      Place dest_place = Place::device;
      int64_t from = 0, count = n_held;
      if (const int slot = z.frozen_slot[j]; slot >= 0) {
        const ParamSlot& p = z.frozen_layout.params[static_cast<size_t>(slot)];
        const ShardRange mine = stage3_owned(p, data_rank);
        from = mine.begin;
        count = mine.real;
        dest = flat.frozen_partitions.narrow(0, p.partition_offset, count);
        dest_place = z.find_anywhere(BufferRole::frozen_partitions)->place;
      } else {
        dest = flat.frozen.narrow(0, z.frozen_offset[j], n_held);
      }
      if (count == 0) continue;
      const torch::Tensor host = torch::from_blob(const_cast<float*>(v) + from, {count}, torch::kFloat32).to(dest.scalar_type());
      device.copy(dest, dest_place, host, Place::host);
    }
  }
  if (!adapter_base_checksum.empty() && adapter_base_checksum != hex64(checksum))
    throw UserError("the adapter '" + adapter_path + "' was trained on another base: its ds_base.json records checksum " +
                        adapter_base_checksum + ", and '" + source->path() + "' has " + hex64(checksum),
                    "point base_model_name_or_path in its adapter_config.json at the base it was trained on");
  nlohmann::ordered_json j;
  j["source"] = source ? std::string(weights_kind_name(source->kind())) + " " + source->path()
                       : "random init from seed " + std::to_string(plan.run.seed);
  // Recorded absolute: an export of the adapter names its base wherever it is used from.
  j["path"] = source ? nlohmann::ordered_json(std::filesystem::absolute(source->path()).lexically_normal().string())
                     : nlohmann::ordered_json(nullptr);
  j["params"] = plan.frozen_numel();
  j["checksum"] = hex64(checksum);
  FrozenBase out{j.dump(), ""};
  if (source)
    out.note = std::string("ds train: frozen ") + (plan.lora.enabled ? "base" : "tensors") + " from " + weights_kind_name(source->kind()) +
               " " + source->path() + " (" + format_count(plan.frozen_numel()) + " parameters, checksum " + hex64(checksum) + ")";
  return out;
}

void check_frozen_base(const Plan& plan, const std::string& resumed_from, const std::string& theirs_text, const std::string& ours_text) {
  if (plan.frozen.empty()) return;
  if (theirs_text.empty())
    throw UserError("'" + resumed_from + "' holds a run that trained every weight, not one with frozen weights",
                    "resume it without model.lora or model.freeze, or start fresh (model.init_from can take that run's weights)");
  const auto theirs = nlohmann::json::parse(theirs_text, nullptr, false);
  const auto ours = nlohmann::json::parse(ours_text);
  if (theirs.is_discarded() || theirs.value("checksum", "") != ours["checksum"].get<std::string>())
    throw UserError("'" + resumed_from + "' trained on other frozen weights: " +
                        (theirs.is_discarded() ? std::string("(unreadable)") : theirs.value("source", "?") + ", checksum " + theirs.value("checksum", "?")) +
                        "; this run's base is " + ours["source"].get<std::string>() + ", checksum " + ours["checksum"].get<std::string>(),
                    "set model.init_from (and train.seed, for a random base) to what the adapter was trained on");
}

}  // namespace ds
