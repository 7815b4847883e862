// plan.json as a record (engine/plan/plan_record.hpp): what plan_to_json writes, read_plan_record reads
// back, for every family; older records read as their runs had them; damage named; and a checkpoint
// written by an earlier ds (tests/data/checkpoint-46924e5, kept as written) read by today's code.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/plan/plan_record.hpp"
#include "engine/runtime/io/checkpoint.hpp"
#include "engine/runtime/io/weights.hpp"
#include "schema/rope_scaling.hpp"
#include "test_helpers.hpp"

namespace ds {
namespace {

namespace fs = std::filesystem;

void expect_same_model(const ModelHyper& got, const ModelHyper& want) {
  EXPECT_EQ(got.name, want.name);
  EXPECT_EQ(got.arch, want.arch) << model_arch_name(got.arch) << " vs " << model_arch_name(want.arch);
  EXPECT_EQ(got.vocab_size, want.vocab_size);
  EXPECT_EQ(got.hidden_size, want.hidden_size);
  EXPECT_EQ(got.num_layers, want.num_layers);
  EXPECT_EQ(got.num_heads, want.num_heads);
  EXPECT_EQ(got.num_kv_heads, want.num_kv_heads);
  EXPECT_EQ(got.intermediate_size, want.intermediate_size);
  EXPECT_EQ(got.max_position_embeddings, want.max_position_embeddings);
  EXPECT_EQ(got.tie_word_embeddings, want.tie_word_embeddings);
  EXPECT_EQ(got.norm_eps, want.norm_eps);
  EXPECT_EQ(got.rope_theta, want.rope_theta);
  EXPECT_TRUE(got.rope_scaling == want.rope_scaling) << rope_scaling_json(got.rope_scaling).dump();
  EXPECT_EQ(got.head_dim(), want.head_dim());
  EXPECT_EQ(got.attention_bias, want.attention_bias);
  EXPECT_EQ(got.mlp_bias, want.mlp_bias);
  EXPECT_EQ(got.sliding_window, want.sliding_window);
  EXPECT_EQ(got.attn_softcap, want.attn_softcap);
  EXPECT_EQ(got.final_softcap, want.final_softcap);
  EXPECT_EQ(got.query_pre_attn_scalar, want.query_pre_attn_scalar);
  EXPECT_EQ(got.attn_pdrop, want.attn_pdrop);
  EXPECT_EQ(got.resid_pdrop, want.resid_pdrop);
  EXPECT_EQ(got.embd_pdrop, want.embd_pdrop);
  EXPECT_EQ(got.bos_token_id, want.bos_token_id);
  EXPECT_EQ(got.eos_token_id, want.eos_token_id);
}

void expect_same_tensors(const std::vector<RecordedTensor>& got, const FlatLayout& want) {
  ASSERT_EQ(got.size(), want.params.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].name, want.params[i].name);
    EXPECT_EQ(got[i].shape, want.params[i].shape) << got[i].name;
    EXPECT_EQ(got[i].offset, want.params[i].offset) << got[i].name;
  }
}

const char* kBase = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "bf16": {"enabled": true},
  "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5}}, "data": {"seq_len": 32}, "train": {"steps": 40},
  "model": {"preset": "gpt2-tiny"}})";

TEST(PlanRecord, EveryFamilyReadsBackAsWritten) {
  const std::vector<std::vector<std::string>> cases = {
      {"model.preset=gpt2-tiny", "model.attn_pdrop=0.1", "model.resid_pdrop=0.05", "zero_optimization.stage=3"},
      {"model.preset=llama-tiny", "model.attention_bias=true", "model.mlp_bias=true", "model.head_dim=24",
       R"(model.rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32})",
       "zero_optimization.stage=2"},
      {"model.preset=mistral-tiny", "model.sliding_window=8", "bf16.enabled=false"},
      {"model.preset=qwen2-tiny", "zero_optimization.stage=1"},
      {"model.preset=qwen3-tiny", "model.attention_bias=true", "model.lora.r=4", "model.lora.alpha=8", "model.lora.dropout=0.1",
       "model.lora.init=gaussian"},
      {"model.preset=phi3-tiny", "model.freeze=[\"model.embed_tokens.weight\"]"},
      {"model.preset=gemma2-tiny", "bf16.enabled=false", "fp16.enabled=true"},
  };
  const std::vector<TokenizerFileRecord> files = {{"vocab_file", "vocab.json", "/data/vocab.json", "00ff00ff00ff00ff", 1042301},
                                                  {"init_from", "tokenizer.json", "/models/x/tokenizer.json", "0123456789abcdef", 9}};
  for (const auto& overrides : cases) {
    SCOPED_TRACE(overrides.front());
    const Plan p = test::plan_of(kBase, 2, 0, overrides);
    const PlanRecord r = read_plan_record(plan_to_json(p, files), "test");
    EXPECT_EQ(r.schema_version, kPlanSchemaVersion);
    ASSERT_TRUE(r.model.has_value());
    expect_same_model(*r.model, p.model.hp);
    ASSERT_EQ(r.lora.has_value(), p.lora.enabled);
    if (r.lora) {
      EXPECT_EQ(r.lora->r, p.lora.r);
      EXPECT_EQ(r.lora->alpha, p.lora.alpha);
      EXPECT_EQ(r.lora->dropout, p.lora.dropout);
      EXPECT_EQ(r.lora->target_modules, p.lora.target_modules);
      EXPECT_EQ(r.lora->init, p.lora.init);
    }
    EXPECT_EQ(r.frozen, !p.frozen.empty());
    EXPECT_EQ(r.world_size, 2);
    EXPECT_EQ(r.train_batch_size, p.batch.train_batch_size);
    EXPECT_EQ(r.micro_batch, p.batch.micro_batch);
    EXPECT_EQ(r.steps, p.steps);
    EXPECT_EQ(r.scheduler, "WarmupCosineLR");
    EXPECT_EQ(r.warmup_num_steps, p.scheduler.params.warmup_num_steps);
    EXPECT_EQ(r.total_num_steps, p.scheduler.params.total_num_steps);
    EXPECT_EQ(r.zero_stage, p.zero_stage());
    EXPECT_EQ(r.precision, p.precision.mode);
    EXPECT_EQ(r.layout_numel, p.layout.numel);
    EXPECT_EQ(r.layout_world_size, p.layout.world_size);
    expect_same_tensors(r.params, p.layout);
    ASSERT_TRUE(r.tokenizer_files.has_value());
    ASSERT_EQ(r.tokenizer_files->size(), files.size());
    for (size_t i = 0; i < files.size(); ++i) {
      EXPECT_EQ((*r.tokenizer_files)[i].role, files[i].role);
      EXPECT_EQ((*r.tokenizer_files)[i].name, files[i].name);
      EXPECT_EQ((*r.tokenizer_files)[i].path, files[i].path);
      EXPECT_EQ((*r.tokenizer_files)[i].checksum64, files[i].checksum64);
      EXPECT_EQ((*r.tokenizer_files)[i].bytes, files[i].bytes);
    }
  }
}

TEST(PlanRecord, TheWrittenTextIsDsPlanJson) {
  // One writer: the record with no tokenizer files is `ds plan --json`'s text, which it recognises as a plan.
  const Plan p = test::plan_of(kBase, 1, 0);
  const std::string text = plan_to_json(p);
  EXPECT_EQ(text.find("tokenizer_files"), std::string::npos);
  EXPECT_TRUE(looks_like_plan_record(nlohmann::json::parse(text)));
  EXPECT_FALSE(read_plan_record(text, "test").tokenizer_files.has_value()) << "no record: the run's files are the config's";
  EXPECT_FALSE(looks_like_plan_record(nlohmann::json::parse(R"({"train": {"output_dir": "x"}})")));
}

// plan.json's device block: the traits the compiler and the trainer ask, and the device's refusals, each of
// them also in not_yet_runnable (what ds train refuses); the build only where the topology carries it.
TEST(PlanRecord, TheDeviceBlockSaysWhatThePlanAskedAndWhatItRefuses) {
  const nlohmann::json cpu = nlohmann::json::parse(plan_to_json(test::plan_of(kBase, 2, 0)));
  EXPECT_EQ(cpu["device"]["name"], cpu["topology"]["device"]);
  EXPECT_EQ(cpu["device"]["communicator"], cpu["zero_execution"]["backend"]);
  EXPECT_EQ(cpu["device"]["memory_is_host"], true);
  EXPECT_TRUE(cpu["device"]["build"].is_null());
  EXPECT_TRUE(cpu["device"]["refuses"].empty());

  Config c = load_config_text(kBase, "test.json", {"bf16.enabled=false", "fp16.enabled=true"});
  Topology gpus = test::thread_ranks(2, 0);
  gpus.device = DeviceKind::cuda;
  gpus.build = BuildSupport{};  // CPU LibTorch
  const Plan p = compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), gpus);
  const nlohmann::json j = nlohmann::json::parse(plan_to_json(p));
  EXPECT_EQ(j["device"]["communicator"], j["zero_execution"]["backend"]);
  EXPECT_EQ(j["device"]["communicator"], "nccl");
  EXPECT_EQ(j["device"]["build"]["torch_cuda"], false);
  EXPECT_EQ(j["precision"]["compute_dtype"], "fp16") << "a GPU computes in fp16";
  const std::vector<std::string> refuses = j["device"]["refuses"];
  ASSERT_EQ(refuses.size(), 3u) << j["device"].dump();  // the build, several GPU ranks, fp16 on several GPU ranks
  EXPECT_NE(refuses[0].find("with this build"), std::string::npos) << refuses[0];
  const std::vector<std::string> not_yet = j["not_yet_runnable"];
  for (const std::string& r : refuses) EXPECT_NE(std::find(not_yet.begin(), not_yet.end(), r), not_yet.end()) << r;
  gpus.build->torch_cuda = true;
  gpus.build->cuda_kernels = "CUDA 13.0, sm_90";
  EXPECT_EQ(device_refusals(compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), gpus)).size(), 2u);
  // With the NCCL communicator built in, several GPU ranks are planned, with a warning that says how far they have
  // been checked (and one for fp16 on a GPU), fp16 still refused across them; the record names NCCL's version.
  gpus.build->nccl = "2.27.7";
  const Plan with_nccl = compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), gpus);
  const std::vector<std::string> left = device_refusals(with_nccl);
  ASSERT_EQ(left.size(), 1u);
  EXPECT_NE(left[0].find("fp16 on several GPU ranks"), std::string::npos) << left[0];
  Topology one_gpu = test::thread_ranks(1, 0);
  one_gpu.device = DeviceKind::cuda;
  one_gpu.build = gpus.build;
  EXPECT_TRUE(device_refusals(compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), one_gpu)).empty()) << "one GPU trains fp16";
  bool warned = false, fp16_warned = false;
  for (const ConfigIssue& w : with_nccl.warnings) {
    warned = warned || w.message.find("several GPU ranks over NCCL 2.27.7") != std::string::npos;
    fp16_warned = fp16_warned || (w.path == "fp16.enabled" && w.message.find("fp16 on a GPU is new") != std::string::npos);
  }
  EXPECT_TRUE(warned);
  EXPECT_FALSE(fp16_warned) << "fp16 on a GPU has run on one: not new";
  const Plan fp16_on_cpu = test::plan_of(kBase, 2, 0, {"bf16.enabled=false", "fp16.enabled=true"});
  for (const ConfigIssue& w : fp16_on_cpu.warnings) EXPECT_NE(w.path, "fp16.enabled") << "the CPU's fp16 is not new: " << w.message;
  EXPECT_EQ(nlohmann::json::parse(plan_to_json(with_nccl))["device"]["build"]["nccl"], "2.27.7");
}

TEST(PlanRecord, OlderRecordsReadAsTheirRunsHadThem) {
  // A record from before the rotary families' keys, the special tokens and the layout: GPT-2's BPE vocabulary
  // then had its end-of-text token 50256 as both, and nothing else was there.
  const Plan p = test::plan_of(kBase, 1, 0, {"model.vocab_size=50257"});
  nlohmann::json j = nlohmann::json::parse(plan_to_json(p));
  for (const char* key : {"head_dim", "attention_bias", "mlp_bias", "sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
                          "query_pre_attn_scalar", "rope_scaling", "bos_token_id", "eos_token_id", "attn_pdrop", "resid_pdrop", "embd_pdrop"})
    j["model"].erase(key);
  j.erase("layout");
  j.erase("freeze");
  const PlanRecord r = read_plan_record(j.dump(), "test");
  ASSERT_TRUE(r.model.has_value());
  EXPECT_EQ(r.model->bos_token_id, 50256);
  EXPECT_EQ(r.model->eos_token_id, std::vector<int64_t>{50256});
  EXPECT_EQ(r.model->head_dim_given, 0);
  EXPECT_EQ(r.model->rope_scaling.type, RopeType::none);
  EXPECT_TRUE(r.params.empty());
  EXPECT_FALSE(r.frozen);
  // A byte-level vocabulary's record says none, and null is read as none.
  const PlanRecord bytes = read_plan_record(plan_to_json(test::plan_of(kBase, 1, 0)), "test");
  EXPECT_EQ(bytes.model->bos_token_id, -1);
  EXPECT_TRUE(bytes.model->eos_token_id.empty());
  // Records of tokenizer files from before they were named carried GPT-2's pair, named by role.
  nlohmann::json t = nlohmann::json::parse(plan_to_json(p));
  t["tokenizer_files"] = {{{"role", "merges_file"}, {"path", "/m.txt"}, {"checksum64", "ab"}}};
  EXPECT_EQ(read_plan_record(t.dump(), "test").tokenizer_files->at(0).name, "merges.txt");
}

std::string error_of(const std::string& text) {
  try {
    read_plan_record(text, "checkpoint 'c/step_00000001'");
  } catch (const UserError& e) {
    return e.what();
  }
  return "(read)";
}

TEST(PlanRecord, DamageIsNamedByItsField) {
  const Plan p = test::plan_of(kBase, 1, 0);
  const nlohmann::json good = nlohmann::json::parse(plan_to_json(p));
  auto with = [&](const std::function<void(nlohmann::json&)>& damage) {
    nlohmann::json j = good;
    damage(j);
    return error_of(j.dump());
  };
  EXPECT_EQ(error_of(good.dump()), "(read)");
  EXPECT_EQ(error_of("not json"), "checkpoint 'c/step_00000001' has no readable plan.json (not a JSON object)");
  EXPECT_NE(with([](auto& j) { j["model"]["hidden_size"] = "64"; }).find("(model.hidden_size is not an integer)"), std::string::npos);
  EXPECT_NE(with([](auto& j) { j["model"].erase("name"); }).find("(model.name is missing)"), std::string::npos);
  EXPECT_NE(with([](auto& j) { j["layout"]["params"][1]["shape"] = {2, "x"}; }).find("layout.params[1].shape is not a list of integers"),
            std::string::npos);
  EXPECT_NE(with([](auto& j) { j["batch"] = 16; }).find("batch is not an object"), std::string::npos);
  EXPECT_NE(with([](auto& j) { j["tokenizer_files"] = {{{"role", 3}}}; }).find("tokenizer_files[0].role is not a string"), std::string::npos);
  EXPECT_NE(with([](auto& j) { j.erase("schema_version"); }).find("schema_version is missing"), std::string::npos);
  EXPECT_NE(with([](auto& j) { j["batch"]["train_batch_size"] = 0; }).find("batch.train_batch_size is not a positive count"), std::string::npos);
  EXPECT_NE(with([](auto& j) { j.erase("zero"); }).find("(zero is missing)"), std::string::npos);
  EXPECT_NE(with([](auto& j) { j["layout"]["params"][0] = 7; }).find("(layout.params[0] is not an object)"), std::string::npos);
  const std::string arch = with([](auto& j) { j["model"]["arch"] = "mamba"; });
  EXPECT_NE(arch.find("is of architecture 'mamba', which this build of ds does not know"), std::string::npos) << arch;
  // A newer record is read for what this build knows: fields are only ever added.
  EXPECT_EQ(with([](auto& j) {
              j["schema_version"] = kPlanSchemaVersion + 1;
              j["pipeline"] = {{"stages", 4}};
            }),
            "(read)");
}

// The checkpoint kept as an earlier ds wrote it (tests/data/checkpoint-46924e5/README.md says how): a qwen3
// model at 2 ranks, ZeRO stage 3, bf16, with rope scaling, q/k/v/o biases and its own head width.
const std::string kFixture = std::string(DS_SOURCE_DIR) + "/tests/data/checkpoint-46924e5";

std::string fixture_copy() {  // read from a scratch copy: the source tree is never written, not even a lock
  const fs::path dir = fs::temp_directory_path() / ("plan_record_fixture_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy(kFixture + "/step_00000004", dir / "step_00000004", fs::copy_options::recursive);
  return (dir / "step_00000004").string();
}

TEST(PlanRecord, ACheckpointOfTheFormatKeptAsAFixtureReads) {
  const std::string ckpt = fixture_copy();
  const PlanRecord r = read_plan_record(read_checkpoint_text(ckpt, "plan_json"), "checkpoint '" + ckpt + "'");
  // Its config, compiled today for the 2 ranks it ran on, gives the same model and the same flat layout.
  const Config c = load_config_text(test::read_text(kFixture + "/config.json"), kFixture + "/config.json");
  const Plan today = compile_plan(c, build_model_spec(resolve_model_hyper(c.model)), test::thread_ranks(2, 0));
  ASSERT_TRUE(r.model.has_value());
  expect_same_model(*r.model, today.model.hp);
  EXPECT_EQ(r.model->arch, ModelArch::qwen3);
  EXPECT_EQ(r.model->head_dim_given, 12);
  EXPECT_TRUE(r.model->attention_bias);
  EXPECT_EQ(r.model->rope_scaling.type, RopeType::llama3);
  expect_same_tensors(r.params, today.layout);
  EXPECT_EQ(r.layout_numel, today.layout.numel);
  EXPECT_EQ(r.world_size, 2);
  EXPECT_EQ(r.layout_world_size, 2);
  EXPECT_EQ(r.zero_stage, 3);
  EXPECT_EQ(r.precision, "bf16");
  EXPECT_EQ(r.train_batch_size, 8);  // micro 2 x accumulation 2 x 2 ranks
  EXPECT_EQ(r.micro_batch, 2);
  EXPECT_EQ(r.steps, 4);
  EXPECT_EQ(r.scheduler, "WarmupCosineLR");
  EXPECT_EQ(r.warmup_num_steps, std::optional<int64_t>(2));
  EXPECT_EQ(r.total_num_steps, std::optional<int64_t>(4));
  EXPECT_FALSE(r.lora.has_value());
  EXPECT_FALSE(r.tokenizer_files.has_value());
  // The weights as a source (convert-ckpt, init_from): every tensor from the shards holding it, checksums verified.
  const std::unique_ptr<WeightSource> w = open_weights(ckpt);
  ASSERT_EQ(w->kind(), WeightsKind::ds_checkpoint);
  EXPECT_EQ(w->step, 4);
  EXPECT_EQ(w->zero_stage, 3);
  EXPECT_EQ(w->world_size, 2);
  ASSERT_EQ(w->tensors().size(), today.layout.params.size());
  for (const NamedShape& t : w->tensors()) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    w->read_f32(t.name, v.data());
    double sum_sq = 0;
    for (float x : v) {
      ASSERT_TRUE(std::isfinite(x)) << t.name;
      sum_sq += double(x) * x;
    }
    EXPECT_GT(sum_sq, 0) << t.name << " read as zeros";
  }
  fs::remove_all(fs::path(ckpt).parent_path());
}

}  // namespace
}  // namespace ds
