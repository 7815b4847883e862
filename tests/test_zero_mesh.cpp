// A model split over ranks as real processes: tensor-parallel and pipeline meshes (with data parallelism and ZeRO
// beside them) train the one-rank run, into a checkpoint of the whole model that convert-ckpt consolidates and
// any mesh resumes.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "zero_runs.hpp"

using namespace zero_test;

TEST(Zero, TensorParallelMeshesTrainTheSingleRankRunIntoTheWholeModelsCheckpoint) {
  const std::string& one = single_rank_run();
  const auto base = losses_of(one);
  ASSERT_EQ(base.size(), 10u);
  const WholeState base_state = whole_state(one);
  struct Mesh {
    std::string name, shape;
  };
  const std::vector<Mesh> meshes = {
      {"t2", "train_micro_batch_size_per_gpu=8 gradient_accumulation_steps=3 --nproc-per-node 2 zero_optimization.stage=0"},
      {"t2d2z1", "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 4 zero_optimization.stage=1"},
      {"t2d2z2", "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 4 zero_optimization.stage=2"},
      {"t2d2z3", "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 4 zero_optimization.stage=3 "
                 "model.activation_checkpointing=true"},
  };
  for (const Mesh& m : meshes) {
    SCOPED_TRACE(m.name);
    const std::string dir = scratch_dir() + "/tp_" + m.name;
    Result r = cli_test::ds(kRun + m.shape + " tensor_parallel.autotp_size=2 train.steps=10 train.save_every=5 train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(contains(slurp(dir + "/train.log"), "(tensor 2 x data ")) << slurp(dir + "/train.log");
    const auto losses = losses_of(dir);
    ASSERT_EQ(losses.size(), base.size());
    for (size_t i = 0; i < base.size(); ++i) EXPECT_NEAR(losses[i], base[i], 1e-5 * base[i]) << "step " << i + 1;
    // Bytes sent per step: ZeRO's collectives over the data group and the tensor group's all-reduces, as planned.
    const json plan = json::parse(slurp(dir + "/plan.json"));
    double planned = plan["mesh"]["stages"][0]["traffic_per_rank_per_step"]["tensor_wire_bytes"].get<double>();
    EXPECT_GT(planned, 0);
    for (const json& c : plan["collectives"]) planned += c["wire_bytes_per_rank_per_step"].get<double>();
    for (const json& m : metrics_of(dir)) EXPECT_NEAR(m["comm_bytes"].get<double>(), planned, 1.0) << "step " << m["step"];
    expect_state_and_export(dir, base_state, one);
  }
  // The step-5 checkpoint of tensor 2 x data 2 at stage 3, resumed on one rank: steps 6-10 are the one-rank run's.
  const std::string resumed = scratch_dir() + "/tp_resumed";
  Result r = cli_test::ds(kRun + shape(1) + "train.steps=10 train.output_dir=" + resumed + " train.resume=" + scratch_dir() +
                          "/tp_t2d2z3/checkpoints/step_00000005");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto losses = losses_of(resumed);
  ASSERT_EQ(losses.size(), 5u);
  for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], base[i + 5], 1e-5 * base[i + 5]) << "step " << i + 6;
  // And on another mesh: tensor 2 x data 2 at stage 1's step 5, continued by tensor 2 alone at stage 0.
  const std::string remeshed = scratch_dir() + "/tp_remeshed";
  r = cli_test::ds(kRun + meshes[0].shape + " tensor_parallel.autotp_size=2 train.steps=10 train.output_dir=" + remeshed +
                   " train.resume=" + scratch_dir() + "/tp_t2d2z1/checkpoints/step_00000005");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto continued = losses_of(remeshed);
  ASSERT_EQ(continued.size(), 5u);
  for (size_t i = 0; i < continued.size(); ++i) EXPECT_NEAR(continued[i], base[i + 5], 1e-5 * base[i + 5]) << "step " << i + 6;
  // --info says who wrote it.
  r = cli_test::ds("convert-ckpt --info " + scratch_dir() + "/tp_t2d2z1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "saved by    4 ranks (tensor 2 x data 2) at ZeRO stage 1")) << r.out;
  // convert-ckpt reshards a mesh's checkpoint as data parallelism's (3 ranks at stage 3): the same state, bit for bit.
  const std::string resharded = scratch_dir() + "/tp_resharded";
  r = cli_test::ds("convert-ckpt " + scratch_dir() + "/tp_t2d2z1 " + resharded + " --world-size 3 --stage 3");
  ASSERT_EQ(r.code, 0) << r.err;
  const WholeState before = whole_state(scratch_dir() + "/tp_t2d2z1", one), after = whole_state(resharded, one);
  EXPECT_TRUE(before.master == after.master && before.exp_avg == after.exp_avg && before.exp_avg_sq == after.exp_avg_sq);
  // Validation: the data ranks split the held-out rows, each tensor group evaluates its rows together; the same loss.
  double val[2] = {0, 0};
  for (int tp = 0; tp < 2; ++tp) {
    const std::string dir = scratch_dir() + "/tp_val" + std::to_string(tp);
    r = cli_test::ds(kRun + (tp ? meshes[1].shape + " tensor_parallel.autotp_size=2" : shape(1)) +
                     " train.steps=2 train.eval_every=2 train.eval_batches=2 train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    val[tp] = metrics_of(dir).back()["val_loss"].get<double>();
  }
  EXPECT_NEAR(val[1], val[0], 1e-5 * val[0]);
  // bf16: the same run within bf16's rounding (the tensor group sums its parts in another order).
  std::vector<double> bf16[2];
  for (int tp = 0; tp < 2; ++tp) {
    const std::string dir = scratch_dir() + "/tp_bf16_" + std::to_string(tp);
    r = cli_test::ds(kRun + (tp ? meshes[2].shape + " tensor_parallel.autotp_size=2" : shape(1)) +
                     " bf16.enabled=true train.steps=10 train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    bf16[tp] = losses_of(dir);
  }
  ASSERT_EQ(bf16[1].size(), 10u);
  ASSERT_EQ(bf16[0].size(), 10u);
  for (size_t i = 0; i < 10; ++i) EXPECT_NEAR(bf16[1][i], bf16[0][i], 1e-3 * bf16[0][i]) << "bf16 step " << i + 1;
  // Started from a checkpoint's weights (model.init_from): each tensor rank reads the whole tensors and keeps its
  // share; the first steps' losses are one rank's from the same weights.
  std::vector<double> from[2];
  for (int tp = 0; tp < 2; ++tp) {
    const std::string dir = scratch_dir() + "/tp_init" + std::to_string(tp);
    r = cli_test::ds(kRun + (tp ? meshes[1].shape + " tensor_parallel.autotp_size=2" : shape(1)) + " train.steps=2 model.init_from=" +
                     ds::find_latest_checkpoint(one) + " train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    from[tp] = losses_of(dir);
  }
  ASSERT_EQ(from[0].size(), 2u);
  ASSERT_EQ(from[1].size(), 2u);
  EXPECT_LT(from[0][0], base[0] - 0.1);  // the trained weights, not a fresh draw
  for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(from[1][i], from[0][i], 1e-5 * from[0][i]) << "step " << i + 1;
}

TEST(Zero, PipelineMeshesTrainTheSingleRankRunIntoTheWholeModelsCheckpoint) {
  // Real processes over Gloo: pipeline stages alone, with data parallelism under ZeRO 1, and tensor 2 x pipeline 2
  // x data 2 (8 ranks). GPT-2's head is tied: the last stage holds a copy of the token table, whose gradient is
  // summed with the first stage's every step.
  const std::string& one = single_rank_run();
  const auto base = losses_of(one);
  ASSERT_EQ(base.size(), 10u);
  const WholeState base_state = whole_state(one);
  struct Mesh {
    std::string name, shape, says;
  };
  const std::vector<Mesh> meshes = {
      {"p2", "train_micro_batch_size_per_gpu=8 gradient_accumulation_steps=3 --nproc-per-node 2 zero_optimization.stage=0 pipeline.stages=2",
       "(tensor 1 x pipeline 2"},
      {"p2d2z1", "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 4 zero_optimization.stage=1 pipeline.stages=2 "
                 "model.activation_checkpointing=true",
       "(tensor 1 x pipeline 2 x data 2"},
      {"t2p2d2", "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 8 zero_optimization.stage=1 pipeline.stages=2 "
                 "tensor_parallel.autotp_size=2",
       "(tensor 2 x pipeline 2 x data 2"},
  };
  for (const Mesh& m : meshes) {
    SCOPED_TRACE(m.name);
    const std::string dir = scratch_dir() + "/pp_" + m.name;
    Result r = cli_test::ds(kRun + m.shape + " train.steps=10 train.save_every=5 train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    const std::string log = slurp(dir + "/train.log");
    EXPECT_TRUE(contains(log, m.says)) << log;
    const auto losses = losses_of(dir);
    ASSERT_EQ(losses.size(), base.size());
    for (size_t i = 0; i < base.size(); ++i) EXPECT_NEAR(losses[i], base[i], 1e-5 * base[i]) << "step " << i + 1;
    // Bytes rank 0 (the first stage) sends per step: its ZeRO collectives, its activations (and their gradients
    // none: the first stage sends no gradient back), the tied table's gradient and the tensor all-reduces, as planned.
    const json plan = json::parse(slurp(dir + "/plan.json"));
    const json& traffic = plan["mesh"]["stages"][0]["traffic_per_rank_per_step"];
    double planned = traffic["pipeline_bytes"].get<double>() + traffic["tied_bytes"].get<double>() + traffic["tensor_wire_bytes"].get<double>() +
                     traffic["zero_wire_bytes"].get<double>();  // (the plan's collectives are its heaviest stage's)
    EXPECT_GT(traffic["pipeline_bytes"].get<double>(), 0);
    EXPECT_GT(traffic["tied_bytes"].get<double>(), 0);
    for (const json& c : plan["collectives"])
      if (c["what"] == "loss, norm and stop flag") planned += c["wire_bytes_per_rank_per_step"].get<double>();
    for (const json& x : metrics_of(dir)) EXPECT_NEAR(x["comm_bytes"].get<double>(), planned, 1.0) << "step " << x["step"];
    EXPECT_TRUE(contains(log, "pipeline activations: 3.0 calls")) << log;  // the run report's row beside the plan's
    if (m.name == "p2") {  // the last stage sends the gradients back, a kind of its own
      const std::string last = slurp(dir + "/logs/rank_1.log");
      EXPECT_TRUE(contains(last, "pipeline activations' gradients: 3.0 calls, 384.00 KiB (3 calls, 384.00 KiB)")) << last;
    }
    // The stage's measured idle share beside the plan's bubble (p 2, m 3: 25%): a share of the step, whatever the machine.
    const std::string said = "stage 0 waited for the other stages (their activations, gradients, the step's end) ";
    const size_t waited = log.find(said);
    ASSERT_NE(waited, std::string::npos) << log;
    char* end = nullptr;
    const double share = std::strtod(log.c_str() + waited + said.size(), &end);
    EXPECT_EQ(*end, '%') << log.substr(waited, 200);
    EXPECT_GE(share, 0.0);
    EXPECT_LE(share, 100.0);
    EXPECT_TRUE(contains(log, "the plan's bubble: 25.0%, (p - 1) / (m + p - 1) with p 2, m 3")) << log;
    expect_state_and_export(dir, base_state, one);
  }
  Result info = cli_test::ds("convert-ckpt --info " + scratch_dir() + "/pp_t2p2d2");
  ASSERT_EQ(info.code, 0) << info.err;
  EXPECT_TRUE(contains(info.out, "saved by    8 ranks (tensor 2 x pipeline 2 x data 2) at ZeRO stage 1")) << info.out;
  info = cli_test::ds("convert-ckpt --info --json " + scratch_dir() + "/pp_t2p2d2");
  ASSERT_EQ(info.code, 0) << info.err;
  const json saved = json::parse(info.out);
  EXPECT_EQ(saved["world_size"], 8);
  EXPECT_EQ(saved["data_parallel"], 2);
  // Resharded for 2 data ranks, the command it prints resumes it from the run's own config (which names its mesh
  // and batch shape): the overrides it gives are all the new shape needs.
  const std::string two = scratch_dir() + "/pp_resharded2";
  Result c = cli_test::ds("convert-ckpt " + scratch_dir() + "/pp_t2p2d2/checkpoints/step_00000005 " + two + " --world-size 2");
  ASSERT_EQ(c.code, 0) << c.err;
  const size_t at = c.err.find("resume it: ds train CONFIG ");
  ASSERT_NE(at, std::string::npos) << c.err;
  const std::string resume = c.err.substr(at + 27, c.err.find('\n', at) - at - 27);
  for (const char* o : {"pipeline.stages=1", "tensor_parallel.autotp_size=1", "train_batch_size=24", "--nproc-per-node 2", "--resume"})
    EXPECT_TRUE(contains(resume, o)) << resume;
  c = cli_test::ds(kRun + meshes[2].shape.substr(0, meshes[2].shape.find("--nproc")) + "pipeline.stages=2 tensor_parallel.autotp_size=2 "
                   "train.steps=10 " + resume);
  ASSERT_EQ(c.code, 0) << c.err;
  const auto continued = losses_of(two);
  ASSERT_EQ(continued.size(), 5u);
  for (size_t i = 0; i < continued.size(); ++i) EXPECT_NEAR(continued[i], base[i + 5], 1e-5 * base[i + 5]) << "step " << i + 6;
  // The 2 x 2 x 2 mesh's step-5 checkpoint resumed on one rank, and on pipeline 2 x data 2 at ZeRO stage 0: steps 6-10
  // are the one-rank run's.
  for (const std::string& shape_then : {shape(1), std::string("train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 "
                                                              "--nproc-per-node 4 pipeline.stages=2 zero_optimization.stage=0 ")}) {
    SCOPED_TRACE(shape_then);
    const std::string resumed = scratch_dir() + "/pp_resumed" + std::to_string(shape_then.size());
    Result r = cli_test::ds(kRun + shape_then + "train.steps=10 train.output_dir=" + resumed + " train.resume=" + scratch_dir() +
                            "/pp_t2p2d2/checkpoints/step_00000005");
    ASSERT_EQ(r.code, 0) << r.err;
    // The same global batch on another mesh: its micro batch and mesh keys changed, not the run (only
    // train.save_every, which this resume leaves out, is a change to report).
    const size_t said = r.err.find("the config differs from the checkpoint's at: ");
    ASSERT_NE(said, std::string::npos) << r.err;
    const std::string changes = r.err.substr(said, r.err.find('\n', said) - said);
    EXPECT_TRUE(contains(changes, "train.save_every")) << changes;
    for (const char* key : {"train_micro_batch_size_per_gpu", "pipeline.stages", "tensor_parallel", "zero_optimization.stage"})
      EXPECT_FALSE(contains(changes, key)) << changes;
    const auto losses = losses_of(resumed);
    ASSERT_EQ(losses.size(), 5u);
    for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], base[i + 5], 1e-5 * base[i + 5]) << "step " << i + 6;
  }
  // Validation: the last stage's losses, the same as one rank's.
  double val[2] = {0, 0};
  for (int pp = 0; pp < 2; ++pp) {
    const std::string dir = scratch_dir() + "/pp_val" + std::to_string(pp);
    Result r = cli_test::ds(kRun + (pp ? meshes[1].shape : shape(1)) + " train.steps=2 train.eval_every=2 train.eval_batches=2 train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    val[pp] = metrics_of(dir).back()["val_loss"].get<double>();
  }
  EXPECT_NEAR(val[1], val[0], 1e-5 * val[0]);
  // Started from a checkpoint's weights (model.init_from): each stage reads its tensors (the last the table too).
  std::vector<double> from[2];
  for (int pp = 0; pp < 2; ++pp) {
    const std::string dir = scratch_dir() + "/pp_init" + std::to_string(pp);
    Result r = cli_test::ds(kRun + (pp ? meshes[0].shape : shape(1)) + " train.steps=2 model.init_from=" + ds::find_latest_checkpoint(one) +
                            " train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    from[pp] = losses_of(dir);
  }
  ASSERT_EQ(from[0].size(), 2u);
  ASSERT_EQ(from[1].size(), 2u);
  EXPECT_LT(from[0][0], base[0] - 0.1);
  for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(from[1][i], from[0][i], 1e-5 * from[0][i]) << "step " << i + 1;
  // Three data ranks sum a gradient in an order that depends on where it lies in a rank's buffer, which differs
  // between the first stage's table and the last stage's copy: the copy takes the table's weights every step, so
  // a run resumed at step 5 is the uninterrupted one, bit for bit (pipeline 2 x data 3, 6 ranks).
  const std::string d3 = "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=2 --nproc-per-node 6 zero_optimization.stage=1 "
                         "pipeline.stages=2 train.steps=10 train.output_dir=";
  const std::string straight = scratch_dir() + "/pp_d3", again = scratch_dir() + "/pp_d3_resumed";
  Result r = cli_test::ds(kRun + d3 + straight + " train.save_every=5");
  ASSERT_EQ(r.code, 0) << r.err;
  r = cli_test::ds(kRun + d3 + again + " train.resume=" + straight + "/checkpoints/step_00000005");
  ASSERT_EQ(r.code, 0) << r.err;
  const WholeState a = whole_state(straight, one), b = whole_state(again, one);
  EXPECT_TRUE(a.master == b.master && a.exp_avg == b.exp_avg && a.exp_avg_sq == b.exp_avg_sq);
}

TEST(Zero, AMemoryCutPipelineTrainsTheSingleRankRun) {
  // pipeline.partition "memory": 8 blocks on 4 stages with 12 micro-batches, the first stage holding the most
  // activations takes the fewest blocks; the stages run the one-rank run all the same.
  const std::string eight = kRun + "model.num_layers=8 train.steps=4 train_micro_batch_size_per_gpu=2 gradient_accumulation_steps=12 ";
  const std::string one = scratch_dir() + "/memory_cut_one", four = scratch_dir() + "/memory_cut_p4";
  Result r = cli_test::ds(eight + "train.output_dir=" + one);
  ASSERT_EQ(r.code, 0) << r.err;
  r = cli_test::ds(eight + "pipeline.stages=4 pipeline.partition=memory --nproc-per-node 4 train.output_dir=" + four);
  ASSERT_EQ(r.code, 0) << r.err;
  const json stages = json::parse(slurp(four + "/plan.json"))["mesh"]["stages"];
  ASSERT_EQ(stages.size(), 4u);
  EXPECT_LT(stages[0]["blocks"].get<int>(), stages[3]["blocks"].get<int>()) << stages.dump();
  const auto a = losses_of(one), b = losses_of(four);
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-5 * a[i]) << "step " << i + 1;
  expect_close(whole_state(four, one).master, whole_state(one).master, "weights");
}


TEST(Zero, SplitModelsWithTheirOptimizerOffloadedTrainTheSingleRankRun) {
  // The optimizer's states where offload puts them, on tensor and pipeline meshes: a span on the host, or half of
  // each rank's part on NVMe and half on the device; and a tensor rank's parameter partition in a file on NVMe. The one-rank run's losses, a checkpoint of the whole model
  // holding its weights and moments, and (tensor ranks all alike) the bytes moved per step the plan's.
  const std::string& one = single_rank_run();
  const auto base = losses_of(one);
  ASSERT_EQ(base.size(), 10u);
  const WholeState base_state = whole_state(one);
  const std::string nvme = scratch_dir() + "/split_nvme";
  std::filesystem::create_directories(nvme);
  struct Mesh {
    std::string name, shape;
    bool same_ranks;  // every rank holds as much as rank 0, whose bytes metrics.jsonl records
  };
  const std::vector<Mesh> meshes = {
      {"t2z2cpu", "train_micro_batch_size_per_gpu=8 gradient_accumulation_steps=3 --nproc-per-node 2 zero_optimization.stage=2 "
                  "tensor_parallel.autotp_size=2 zero_optimization.offload_optimizer.device=cpu", true},
      {"t2d2z3nvme", "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 4 zero_optimization.stage=3 "
                     "tensor_parallel.autotp_size=2 zero_optimization.offload_optimizer.device=nvme zero_optimization.offload_optimizer.nvme_path=" +
                         nvme + " zero_optimization.offload_optimizer.ratio=0.5 zero_optimization.sub_group_size=5000", true},
      {"t2d2z3params", "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 4 zero_optimization.stage=3 "
                       "tensor_parallel.autotp_size=2 zero_optimization.offload_optimizer.device=cpu zero_optimization.offload_param.device=nvme "
                       "zero_optimization.offload_param.nvme_path=" + nvme, true},
      {"p2d2z1cpu", "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 4 zero_optimization.stage=1 "
                    "pipeline.stages=2 zero_optimization.offload_optimizer.device=cpu", false},
  };
  for (const Mesh& m : meshes) {
    SCOPED_TRACE(m.name);
    const std::string dir = scratch_dir() + "/split_offload_" + m.name;
    Result r = cli_test::ds(kRun + m.shape + " train.steps=10 train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    const auto losses = losses_of(dir);
    ASSERT_EQ(losses.size(), base.size());
    for (size_t i = 0; i < base.size(); ++i) EXPECT_NEAR(losses[i], base[i], 1e-5 * base[i]) << "step " << i + 1;
    expect_state_and_export(dir, base_state, one);
    const json plan = json::parse(slurp(dir + "/plan.json"));
    ASSERT_FALSE(plan["zero_execution"]["transfers"].empty());
    if (!m.same_ranks) continue;
    double planned = 0;
    for (const json& t : plan["zero_execution"]["transfers"]) planned += t["bytes_per_step"].get<double>();
    for (const json& s : metrics_of(dir)) EXPECT_DOUBLE_EQ(s["offload_bytes"].get<double>(), planned) << "step " << s["step"];
  }
  EXPECT_TRUE(std::filesystem::is_empty(nvme)) << "a swap directory outlived its run";
}

namespace {
// A safetensors file's tensors, in its order, joined.
std::vector<float> values_of(const std::string& path) {
  ds::SafetensorsFile file(path);
  std::vector<float> out;
  for (const ds::StTensor& t : file.view().tensors()) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    file.view().read_f32(t, v.data());
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}
}  // namespace

TEST(Zero, SplitModelsFineTuneWithFrozenTensorsAndLoraAsOneRank) {
  // Fine-tuning a loaded model on a split model: each rank freezes its share of model.freeze's tensors (a tensor
  // rank its slices; the last stage's copy of a frozen tied table loaded, not exchanged), or a pipeline stage trains
  // LoRA's adapters on its blocks. The one-rank run's losses, a checkpoint of the whole run's trained tensors with
  // its moments, the same merged model or PEFT adapter, the plan's bytes, and a resume on another mesh (the base's
  // checksum is the whole base's at any mesh).
  const std::string tuned = kRun + "train.steps=6 train.save_every=3 model.init_from=" + ds::find_latest_checkpoint(single_rank_run()) + " ";
  const std::string p2 = "train_micro_batch_size_per_gpu=8 gradient_accumulation_steps=3 --nproc-per-node 2 zero_optimization.stage=0 pipeline.stages=2 ";
  const std::string p2d2 = "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 4 zero_optimization.stage=1 pipeline.stages=2 ";
  const std::string lora = R"('model.lora={"r": 4, "alpha": 8, "target_modules": ["c_attn", "c_proj", "c_fc"]}' )";
  struct Case {
    std::string name, what, mesh;
    bool tied_exchange, adapter;
  };
  const std::vector<Case> cases = {
      {"freeze_table", R"('model.freeze=["transformer.wte.weight", "transformer.h.0.attn.*"]' )", p2d2, false, false},
      {"freeze_last", R"('model.freeze=["transformer.h.1.*"]' )", p2, true, false},
      {"freeze_t2d2z3", R"('model.freeze=["transformer.wte.weight", "transformer.h.0.attn.*"]' )",
       "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 4 zero_optimization.stage=3 tensor_parallel.autotp_size=2 ",
       false, false},
      {"freeze_t2p2d2", R"('model.freeze=["transformer.h.1.*", "transformer.wpe.weight"]' )",
       "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 8 zero_optimization.stage=1 pipeline.stages=2 "
       "tensor_parallel.autotp_size=2 ", true, false},
      {"lora", lora, p2d2, false, true},
      // The same micro batch as one rank's: the same dropout masks, each drawn from its adapted tensor's stream.
      {"lora_dropout", lora + "model.lora.dropout=0.1 ", p2, false, true},
      {"lora_t2p2d2", lora, "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 8 zero_optimization.stage=1 "
                            "pipeline.stages=2 tensor_parallel.autotp_size=2 ", false, true},
      // Tensor ranks at one rank's micro batch: a row-parallel input's mask cut from the whole input's.
      {"lora_dropout_t2", lora + "model.lora.dropout=0.1 ",
       "train_micro_batch_size_per_gpu=8 gradient_accumulation_steps=3 --nproc-per-node 2 zero_optimization.stage=0 tensor_parallel.autotp_size=2 ",
       false, true},
      // A stage training nothing: the first below every trained tensor runs forward only (the second sends it no
      // gradient); the last, its blocks, final norm and the tied table's copy frozen, still passes gradients back.
      {"freeze_first_stage", R"('model.freeze=["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.*"]' )", p2d2, false,
       false},
      {"freeze_last_stage", R"('model.freeze=["transformer.wte.weight", "transformer.h.1.*", "transformer.ln_f.*"]' )", p2, false, false},
      {"lora_t2d2z2", lora, "train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=3 --nproc-per-node 4 zero_optimization.stage=2 "
                            "tensor_parallel.autotp_size=2 ", false, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string one = scratch_dir() + "/tune_one_" + c.name, dir = scratch_dir() + "/tune_pp_" + c.name;
    Result r = cli_test::ds(tuned + shape(1) + c.what + "train.output_dir=" + one);
    ASSERT_EQ(r.code, 0) << r.err;
    r = cli_test::ds(tuned + c.mesh + c.what + "train.output_dir=" + dir);
    ASSERT_EQ(r.code, 0) << r.err;
    const auto base = losses_of(one), losses = losses_of(dir);
    ASSERT_EQ(base.size(), 6u);
    ASSERT_EQ(losses.size(), base.size());
    for (size_t i = 0; i < base.size(); ++i) EXPECT_NEAR(losses[i], base[i], 1e-5 * base[i]) << "step " << i + 1;
    const WholeState a = whole_state(dir, one), b = whole_state(one);  // (the mesh's plan.json lays out its heaviest stage)
    expect_close(a.master, b.master, "weights");
    expect_close(a.exp_avg, b.exp_avg, "exp_avg");
    expect_close(a.exp_avg_sq, b.exp_avg_sq, "exp_avg_sq");
    // Rank 0 (the first stage) sends its activations, its tensor all-reduces, its ZeRO collectives, the step's
    // agreement, and the tied table's weights only where the table trains.
    const json plan = json::parse(slurp(dir + "/plan.json"));
    const json& traffic = plan["mesh"]["stages"][0]["traffic_per_rank_per_step"];
    EXPECT_EQ(traffic["tied_bytes"].get<double>() > 0, c.tied_exchange);
    double planned = traffic["pipeline_bytes"].get<double>() + traffic["tied_bytes"].get<double>() + traffic["tensor_wire_bytes"].get<double>() +
                     traffic["zero_wire_bytes"].get<double>();
    for (const json& x : plan["collectives"])
      if (x["what"] == "loss, norm and stop flag") planned += x["wire_bytes_per_rank_per_step"].get<double>();
    for (const json& x : metrics_of(dir)) EXPECT_NEAR(x["comm_bytes"].get<double>(), planned, 1.0) << "step " << x["step"];
    // What a user takes away: the merged model, or the PEFT adapter.
    std::string exported[2];
    for (int k = 0; k < 2; ++k) {
      const std::string run = k ? dir : one;
      exported[k] = run + (c.adapter ? "/adapter" : "/merged.safetensors");
      r = cli_test::ds("convert-ckpt " + run + " " + exported[k] + (c.adapter ? " --adapter" : " --merge"));
      ASSERT_EQ(r.code, 0) << r.err;
      if (c.adapter) exported[k] += "/adapter_model.safetensors";
    }
    expect_close(values_of(exported[1]), values_of(exported[0]), "exported");
  }
  // The frozen table's mesh at step 3 resumed on one rank, tensor 2 x data 2's on pipeline 2, and LoRA's on pipeline
  // 2 alone: steps 4-6 are one rank's.
  for (const auto& [name, then] : std::vector<std::pair<std::string, std::string>>{{"freeze_table", shape(1) + cases[0].what},
                                                                                   {"freeze_t2d2z3", p2 + cases[2].what},
                                                                                   {"lora", p2 + cases[4].what},
                                                                                   {"freeze_first_stage", shape(1) + cases[8].what}}) {
    SCOPED_TRACE(name);
    const std::string resumed = scratch_dir() + "/tune_resumed_" + name;
    Result r = cli_test::ds(tuned + then + "train.output_dir=" + resumed + " train.resume=" + scratch_dir() + "/tune_pp_" + name +
                            "/checkpoints/step_00000003");
    ASSERT_EQ(r.code, 0) << r.err;
    const auto base = losses_of(scratch_dir() + "/tune_one_" + name), losses = losses_of(resumed);
    ASSERT_EQ(losses.size(), 3u);
    for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], base[i + 3], 1e-5 * base[i + 3]) << "step " << i + 4;
  }
  // ds plan says which blocks run forward only, and so does the stage's log.
  const Result r = cli_test::ds("plan" + tuned.substr(tuned.find(' ')) + p2d2 + cases[8].what);  // (tuned begins "train ")
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "block 0 runs forward only (nothing in or below it trains")) << r.out;
  const std::string first = slurp(scratch_dir() + "/tune_pp_freeze_first_stage/train.log");
  EXPECT_TRUE(contains(first, "this stage runs forward only")) << "rank 0's log";
  EXPECT_FALSE(contains(first, "gradients: 0.0 calls")) << first;  // nothing to reduce: no row
  // Its checkpoints hold a file from each rank (the frozen stage's say which save they belong to), as its log says.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(scratch_dir() + "/tune_pp_freeze_first_stage/checkpoints/step_00000003"))
    files += e.path().extension() == ".h5" ? 1 : 0;
  EXPECT_EQ(files, 4);
  EXPECT_TRUE(contains(first, "step_00000003 (") && contains(first, ", a file from each of 4 ranks)")) << first;
}
