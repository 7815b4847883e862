// Every key of the schema acts, warns that it has no effect, or is refused: never silently ignored.
// The schema says which keys warn (x-ds-ignored) and which are refused (x-ds-refused, or a const that
// allows one value); this file lists the keys that act, with where. A key added to the schema without
// a place in one of the three lists fails the first test.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "schema/config.hpp"
#include "schema/schema_walk.hpp"
#include "test_helpers.hpp"

using namespace ds;
using namespace ds::test;

namespace {

// Keys ds acts on, and where. (Rewritten spellings, x-ds-deprecated / x-ds-alias-of, act through the
// key they become.)
const std::map<std::string, const char*> kActs = {
    {"train_batch_size", "plan: batch triangle"},
    {"train_micro_batch_size_per_gpu", "plan: batch triangle"},
    {"gradient_accumulation_steps", "plan: batch triangle"},
    {"optimizer.type", "plan: optimizer; runtime: kernel"},
    {"optimizer.params", "the block of the type's parameters"},
    {"optimizer.params.lr", "optimizer kernel"},
    {"optimizer.params.betas", "optimizer kernel"},
    {"optimizer.params.eps", "optimizer kernel"},
    {"optimizer.params.weight_decay", "optimizer kernel"},
    {"optimizer.params.bias_correction", "optimizer kernel"},
    {"optimizer.params.adam_w_mode", "plan: decoupled weight decay"},
    {"optimizer.params.momentum", "SGD kernel"},
    {"optimizer.params.dampening", "SGD kernel"},
    {"optimizer.params.nesterov", "SGD kernel"},
    {"optimizer.params.eps_inside_sqrt", "Lamb kernel"},
    {"optimizer.params.max_coeff", "Lamb kernel"},
    {"optimizer.params.min_coeff", "Lamb kernel"},
    {"scheduler.type", "lr schedule"},
    {"scheduler.params", "the block of the type's parameters"},
    {"scheduler.params.warmup_min_lr", "lr schedule"},
    {"scheduler.params.warmup_max_lr", "lr schedule"},
    {"scheduler.params.warmup_num_steps", "lr schedule"},
    {"scheduler.params.warmup_type", "lr schedule"},
    {"scheduler.params.total_num_steps", "lr schedule"},
    {"scheduler.params.warmup_min_ratio", "lr schedule"},
    {"scheduler.params.cos_min_ratio", "lr schedule"},
    {"scheduler.params.cycle_min_lr", "lr schedule"},
    {"scheduler.params.cycle_max_lr", "lr schedule"},
    {"scheduler.params.decay_lr_rate", "lr schedule"},
    {"scheduler.params.cycle_first_step_size", "lr schedule"},
    {"scheduler.params.cycle_second_step_size", "lr schedule"},
    {"scheduler.params.cycle_first_stair_count", "lr schedule"},
    {"scheduler.params.cycle_second_stair_count", "lr schedule"},
    {"scheduler.params.decay_step_size", "lr schedule"},
    {"scheduler.params.cycle_momentum", "lr schedule: beta1"},
    {"scheduler.params.cycle_min_mom", "lr schedule: beta1"},
    {"scheduler.params.cycle_max_mom", "lr schedule: beta1"},
    {"scheduler.params.decay_mom_rate", "lr schedule: beta1"},
    {"scheduler.params.lr_range_test_min_lr", "lr schedule"},
    {"scheduler.params.lr_range_test_step_size", "lr schedule"},
    {"scheduler.params.lr_range_test_step_rate", "lr schedule"},
    {"scheduler.params.lr_range_test_staircase", "lr schedule"},
    {"fp16.enabled", "plan: precision"},
    {"fp16.loss_scale", "loss scaler"},
    {"fp16.initial_scale_power", "loss scaler"},
    {"fp16.loss_scale_window", "loss scaler"},
    {"fp16.hysteresis", "loss scaler"},
    {"fp16.consecutive_hysteresis", "loss scaler"},
    {"fp16.min_loss_scale", "loss scaler"},
    {"bf16.enabled", "plan: precision"},
    {"bf16.check_grad_overflow", "trainer: skip inf/NaN steps"},
    {"data_types.grad_accum_dtype", "plan: gradient dtype; fp32 over bf16 weights adds each micro-batch's gradients in fp32 (micro_grads)"},
    {"zero_optimization.stage", "plan and runtime: ZeRO"},
    {"zero_optimization.reduce_scatter", "plan: collectives"},
    {"zero_optimization.reduce_bucket_size", "runtime: reduce pieces"},
    {"zero_optimization.allgather_bucket_size", "runtime: gather pieces"},
    {"zero_optimization.overlap_comm", "runtime: reduce beside backward"},
    {"zero_optimization.offload_optimizer.device", "plan: placement (train refuses offload)"},
    {"zero_optimization.offload_optimizer.nvme_path", "plan: required for nvme"},
    {"zero_optimization.offload_optimizer.buffer_count", "plan: NVMe swap buffer sets (swap_sets); too few is an error"},
    {"zero_optimization.offload_optimizer.pipeline_read", "runtime: OptimizerSwapper reads the next sub-group ahead"},
    {"zero_optimization.offload_optimizer.pipeline_write", "runtime: OptimizerSwapper writes the last sub-group behind"},
    {"zero_optimization.offload_optimizer.speculative_step", "plan: ZeroExecution::step_in_backward; runtime: OptimizerStep::speculate"},
    {"aio.block_size", "runtime: SwapIo request size"},
    {"aio.queue_depth", "runtime: SwapIo io_uring size, requests in flight"},
    {"aio.single_submit", "runtime: SwapIo submits each request on its own"},
    {"zero_optimization.offload_optimizer.ratio", "plan + runtime: share offloaded"},
    {"zero_optimization.offload_optimizer.pin_memory", "plan: ZeroBuffer::pinned of the optimizer's copied host buffers (GPU); warned on the CPU"},
    {"zero_optimization.offload_param.pin_memory", "plan: ZeroBuffer::pinned of the parameters' host partitions (GPU); warned on the CPU"},
    {"zero_optimization.offload_param.device", "plan + runtime: where the partition lives"},
    {"zero_optimization.offload_param.nvme_path", "runtime: the swap folder"},
    {"zero_optimization.offload_param.buffer_count", "plan + runtime: NVMe parameter buffers"},
    {"zero_optimization.offload_param.buffer_size", "plan + runtime: NVMe parameter buffers"},
    {"zero_optimization.sub_group_size", "plan: NVMe staging buffers"},
    {"zero_optimization.stage3_param_persistence_threshold", "runtime: small parameters kept whole"},
    {"gradient_clipping", "trainer: clip"},
    {"communication_data_type", "plan: ZeroExecution::wire_dtype, reduce_cast; runtime: ZeroExchange casts each piece"},
    {"gradient_allreduce_op", "trainer: sum or mean over ranks"},
    {"steps_per_print", "trainer: progress lines"},
    {"wall_clock_breakdown", "trainer: fwd/bwd/step times, every phase in metrics.jsonl"},
    {"tensorboard.enabled", "monitor"},
    {"tensorboard.output_path", "monitor"},
    {"tensorboard.job_name", "monitor"},
    {"csv_monitor.enabled", "monitor"},
    {"csv_monitor.output_path", "monitor"},
    {"csv_monitor.job_name", "monitor"},
    {"comms_logger.enabled", "trainer: per-step collective line"},
    {"flops_profiler.enabled", "ds train: blocks timed, the profile report at the end (test_cli_profile)"},
    {"flops_profiler.profile_step", "ds train: the step the report describes"},
    {"flops_profiler.module_depth", "ds train: module rows of the report"},
    {"flops_profiler.top_modules", "ds train: how many modules the report names"},
    {"flops_profiler.detailed", "ds train: the per-module table shown or not"},
    {"flops_profiler.output_file", "ds train: where the report goes"},
    {"model.preset", "model"},
    {"model.hf_config", "model"},
    {"model.arch", "model"},
    {"model.vocab_size", "model"},
    {"model.hidden_size", "model"},
    {"model.num_layers", "model"},
    {"model.num_heads", "model"},
    {"model.num_kv_heads", "model"},
    {"model.intermediate_size", "model"},
    {"model.max_position_embeddings", "model"},
    {"model.tie_word_embeddings", "model"},
    {"model.norm_eps", "model"},
    {"model.rope_theta", "model"},
    {"model.rope_scaling", "model: rotary frequencies (engine/plan/rope.cpp)"},
    {"model.head_dim", "model: the q/k/v/o shapes and the attention's head width (model_spec, llama_model)"},
    {"model.attention_bias", "model: q, k, v and o biases (model_spec build_rotary, llama_model)"},
    {"model.mlp_bias", "model: gate, up and down biases (model_spec build_rotary, llama_model)"},
    {"model.sliding_window", "model: the attention's window (llama_model, fused_attention's materialised path)"},
    {"model.attn_logit_softcapping", "model: the attention's capped scores (llama_model, fused_attention)"},
    {"model.final_logit_softcapping", "model: the capped logits (fused_head_loss)"},
    {"model.query_pre_attn_scalar", "model: the attention's scale (llama_model)"},
    {"model.bos_token_id", "model"},
    {"model.eos_token_id", "model"},
    {"model.activation_checkpointing", "runtime: recompute blocks"},
    {"model.dropout", "model: dropout"},
    {"model.attn_pdrop", "model: dropout"},
    {"model.resid_pdrop", "model: dropout"},
    {"model.embd_pdrop", "model: dropout"},
    {"model.freeze", "plan: frozen tensors leave the layout for the frozen_params buffer"},
    {"model.lora.r", "plan: adapter shapes; runtime: A (r, in), B (out, r)"},
    {"model.lora.alpha", "runtime: the adapter's scale alpha / r"},
    {"model.lora.dropout", "runtime: dropout on the adapter's input"},
    {"model.lora.target_modules", "plan: which projections get an adapter"},
    {"model.lora.init", "runtime: A's initial values"},
    {"model.lora.layers_to_transform", "plan: which blocks get an adapter (resolve_lora); the blocks below them run forward only"},
    {"model.init_from", "runtime: initial weights (engine/runtime/io/weights.cpp)"},
    {"data.type", "data"},
    {"data.path", "data"},
    {"data.tokenizer", "data"},
    {"data.vocab_file", "data"},
    {"data.merges_file", "data"},
    {"data.token_format", "data"},
    {"data.dataset", "data"},
    {"data.seq_len", "plan: tokens per sample"},
    {"data.val_fraction", "data: validation split"},
    {"data.shuffle", "data: the sampler's order (BatchSampler::sample_offset)"},
    {"data.tokenizer_path", "data: the hf tokenizer (HfTokenizer)"},
    {"data.chat_template", "data: how jsonl conversations are rendered (resolve_chat_format)"},
    {"data.train_on_prompt", "data: which jsonl tokens the loss counts (JsonlSamples)"},
    {"data.packing", "data: several jsonl samples a row, each attending to itself (BatchSampler, LanguageModel::per_sample)"},
    {"data.val_path", "data: the jsonl validation samples (open_samples, SampleSet::held_out_from)"},
    {"data.skip_bad_lines", "data: jsonl lines that are no sample skipped and counted (JsonlSamples)"},
    {"data.tokens_in_memory", "data: jsonl samples kept in memory or as an index of their lines, read again per batch (open_samples, SampleSet::indexed)"},
    {"tensor_parallel.autotp_size", "plan: the mesh (engine/plan/mesh), the batch's data ranks; the trainer's tensor groups (make_model)"},
    {"pipeline.stages", "plan: the mesh (engine/plan/mesh), the batch's data ranks; train: each rank runs its stage, 1F1B (engine/runtime/run/pipeline)"},
    {"pipeline.partition", "plan: how the mesh's stages are cut"},
    {"pipeline.activation_checkpoint_interval", "plan: recompute_group (activations); runtime: blocks recomputed in groups (run_blocks)"},
    {"train.steps", "trainer"},
    {"train.epochs", "plan: train.steps from the training split's measured tokens"},
    {"train.eval_every", "trainer"},
    {"train.eval_batches", "trainer"},
    {"train.save_every", "trainer"},
    {"train.keep_last", "checkpoints"},
    {"train.divergence_factor", "trainer: divergence check"},
    {"train.weight_decay_params", "plan: which tensors the optimizer decays (TensorSpec::weight_decay)"},
    {"train.output_dir", "trainer"},
    {"train.seed", "trainer"},
    {"train.threads", "plan: threads"},
    {"train.comm_timeout_s", "communicator"},
    {"train.resume", "ds train"},
};

enum class Kind { acts, ignored, refused, rewritten };

struct Key {
  std::string path;
  Kind kind;
  std::string scheduler_type;  // the branch a scheduler.params key came from
  const json* schema = nullptr;
};

bool has(const SchemaWalk& w, const json& node, const char* a) { return w.annotation(node, a) != nullptr; }

void collect(const SchemaWalk& w, const json& node, const std::string& path, const std::string& sched, std::vector<Key>& out);

void collect_properties(const SchemaWalk& w, const json& obj, const std::string& path, const std::string& sched,
                        std::vector<Key>& out) {
  const json& r = w.resolve(obj);
  auto visit_props = [&](const json& props, const std::string& branch) {
    for (const auto& [k, sub] : props.items()) collect(w, sub, path.empty() ? k : path + "." + k, branch, out);
  };
  if (r.contains("properties")) visit_props(r["properties"], sched);
  if (r.contains("anyOf"))
    for (const auto& a : r["anyOf"]) {
      const json& ra = w.resolve(a);
      if (ra.contains("properties")) visit_props(ra["properties"], sched);
    }
  if (r.contains("allOf"))
    for (const auto& a : r["allOf"])
      if (a.contains("then") && a["then"].contains("properties"))
        for (const auto& [k, sub] : a["then"]["properties"].items()) {
          const std::string type = a["if"]["properties"]["type"]["const"].get<std::string>();
          collect_properties(w, sub, path + "." + k, path == "scheduler" ? type : sched, out);
        }
}

void collect(const SchemaWalk& w, const json& node, const std::string& path, const std::string& sched, std::vector<Key>& out) {
  const json& r = w.resolve(node);
  if (has(w, node, "x-ds-deprecated") || has(w, node, "x-ds-alias-of")) return out.push_back({path, Kind::rewritten, sched, &node});
  if (const json* i = w.annotation(node, "x-ds-ignored"); i && *i == true) return out.push_back({path, Kind::ignored, sched, &node});
  if (has(w, node, "x-ds-refused") || r.contains("const")) return out.push_back({path, Kind::refused, sched, &node});
  const bool object = r.contains("properties") || r.contains("allOf") ||
                      (r.contains("anyOf") && std::any_of(r["anyOf"].begin(), r["anyOf"].end(),
                                                          [&](const json& a) { return w.resolve(a).contains("properties"); }));
  if (object && kActs.count(path) == 0) return collect_properties(w, node, path, sched, out);
  out.push_back({path, Kind::acts, sched, &node});
}

std::vector<Key> all_keys() {
  SchemaWalk w(config_schema());
  std::vector<Key> out;
  collect_properties(w, config_schema(), "", "", out);
  return out;
}

// A value the key accepts that is not its default.
json other_value(const SchemaWalk& w, const json& node) {
  const json& r = w.resolve(node);
  const json dflt = node.contains("default") ? node["default"] : r.value("default", json());
  std::set<std::string> types;
  auto add_types = [&](const json& s) {
    const json& rs = w.resolve(s);
    if (rs.contains("type")) {
      if (rs["type"].is_array())
        for (const auto& t : rs["type"]) types.insert(t.get<std::string>());
      else
        types.insert(rs["type"].get<std::string>());
    }
    if (rs.contains("enum"))
      for (const auto& e : rs["enum"])
        if (e != dflt) types.insert("enum:" + e.dump());
  };
  add_types(node);
  if (r.contains("anyOf"))
    for (const auto& a : r["anyOf"]) add_types(a);
  for (const auto& t : types)
    if (t.rfind("enum:", 0) == 0) return json::parse(t.substr(5));
  if (types.count("boolean")) return dflt.is_boolean() ? json(!dflt.get<bool>()) : json(true);
  if (types.count("integer")) return dflt.is_number() ? json(dflt.get<int64_t>() + 1) : json(2);
  if (types.count("number")) return dflt.is_number() && dflt.get<double>() != 0 ? json(dflt.get<double>() / 2) : json(1);
  if (types.count("string")) return json("x");
  if (types.count("array")) {
    const json& items = r.contains("items") ? w.resolve(r["items"]) : json::object();
    return json::array({items.value("type", "") == "integer" ? json(1) : json("x")});
  }
  if (types.count("object")) return json::object({{"x", 1}});
  return json(1);
}

}  // namespace

TEST(ConfigKeys, EveryKeyActsWarnsOrIsRefused) {
  std::set<std::string> seen;
  std::string unclassified;
  for (const Key& k : all_keys()) {
    seen.insert(k.path);
    if (k.kind == Kind::acts && kActs.count(k.path) == 0) unclassified += "  " + k.path + "\n";
  }
  EXPECT_EQ(unclassified, "") << "keys that are in no list: annotate them x-ds-ignored (with x-ds-why) or x-ds-refused, "
                                 "or add them to kActs with where they act";
  for (const auto& [path, where] : kActs) EXPECT_TRUE(seen.count(path)) << path << " is listed as acting but is not in the schema";
  EXPECT_GT(seen.size(), 200u);  // the walk really covered the schema
}

TEST(ConfigKeys, EveryIgnoredKeyWarnsOnceWhenSet) {
  SchemaWalk w(config_schema());
  int checked = 0;
  for (const Key& k : all_keys()) {
    if (k.kind != Kind::ignored) continue;
    std::vector<std::string> overrides;
    if (!k.scheduler_type.empty()) overrides.push_back("scheduler.type=" + k.scheduler_type);
    if (k.scheduler_type == "OneCycle") overrides.insert(overrides.end(), {"scheduler.params.cycle_min_lr=0.001", "scheduler.params.cycle_max_lr=0.01"});
    if (k.path.rfind("zero_optimization.offload_", 0) == 0)
      overrides.push_back(k.path.substr(0, k.path.rfind('.')) + ".device=cpu");
    overrides.push_back(k.path + "=" + other_value(w, *k.schema).dump());
    try {
      const Config c = load_config_text(R"({"zero_optimization": {"stage": 2}})", "t.json", overrides);
      int warnings = 0;
      for (const auto& i : c.warnings) warnings += i.path == k.path || k.path.rfind(i.path + ".", 0) == 0;
      EXPECT_EQ(warnings, 1) << k.path << " set to " << overrides.back();
      ++checked;
    } catch (const ConfigError& e) {
      ADD_FAILURE() << k.path << " (" << overrides.back() << "): " << dump(e.issues());
    }
  }
  EXPECT_GT(checked, 60);
}

TEST(ConfigKeys, RefusedKeysAreErrorsNamingTheKey) {
  EXPECT_NE(find_issue(problems(R"({"zero_optimization": {"legacy_stage1": true}})"), "zero_optimization.legacy_stage1"), nullptr);
  EXPECT_NE(find_issue(problems(R"({"optimizer": {"type": "Adam", "params": {"amsgrad": true}}})"), "optimizer.params.amsgrad"), nullptr);
}

TEST(Keys, ModelArchNamesAreTheRegistrysBothWays) {
  // The schema's model.arch enum and the architecture registry (schema/config.hpp) list the same names,
  // and every name reads back as its architecture: a third architecture cannot pass validation and then be
  // read as one of the others.
  SchemaWalk w(config_schema());
  const json* arch = w.at({"model", "arch"}, json::object({{"model", json::object()}}));
  ASSERT_NE(arch, nullptr);
  std::set<std::string> in_schema;
  for (const json& n : w.resolve(*arch).at("enum")) in_schema.insert(n.get<std::string>());
  std::set<std::string> in_registry;
  for (ModelArch a : kModelArchs) {
    in_registry.insert(model_arch_name(a));
    EXPECT_EQ(model_arch_from_name(model_arch_name(a)), a);
  }
  EXPECT_EQ(in_schema, in_registry);
  EXPECT_FALSE(model_arch_from_name("gemma3").has_value());  // Gemma 3 is not built yet: refused, never read as another
}
