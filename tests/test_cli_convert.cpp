// ds convert-ckpt as a user runs it: Hugging Face export and import round trips, an independent reader
// of the exported weights, tokenizer files, and init_from's checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "cli_helpers.hpp"

using namespace cli_test;

namespace {
// 17 uint16 tokens (i * mul + add) % 256: a 16-token window a test scores a model on.
void write_window(const std::string& path, int mul, int add) {
  std::ofstream tokens(path, std::ios::binary);
  for (int i = 0; i < 17; ++i) {
    const uint16_t t = static_cast<uint16_t>((i * mul + add) % 256);
    tokens.write(reinterpret_cast<const char*>(&t), 2);
  }
}

// The fp32 quickstart run the merge tests start from (steps, eval off); `dir`/window.bin is a window to score on.
const std::string kFp32Quickstart = "train examples/quickstart.json bf16.enabled=false train.eval_every=0 ";
const std::string kOnWindow = "data.type=tokens data.token_format=uint16 data.seq_len=16 data.val_fraction=0 train_micro_batch_size_per_gpu=1 ";

// A 5-step base run in `dir`/base, exported as a Hugging Face directory `dir`/base-hf, and a window.
void base_and_window(const std::string& dir, int mul, int add) {
  std::filesystem::create_directories(dir);
  write_window(dir + "/window.bin", mul, add);
  ASSERT_EQ(ds(kFp32Quickstart + "train.steps=5 train.output_dir=" + dir + "/base").code, 0);
  ASSERT_EQ(ds("convert-ckpt " + dir + "/base " + dir + "/base-hf").code, 0);
}

// The loss the model at `init_from` scores on `dir`'s window: a one-step run's, taken before its update.
double window_loss(const std::string& dir, const std::string& init_from, const std::string& name) {
  const Result r = ds(kFp32Quickstart + kOnWindow + "data.path=" + dir + "/window.bin train.steps=1 model.init_from=" + init_from +
                      " train.output_dir=" + dir + "/" + name);
  EXPECT_EQ(r.code, 0) << r.err;
  return metrics_of(dir + "/" + name).front()["loss"].get<double>();
}
}  // namespace

TEST(CliConvert, AnExportedRunRoundTripsThroughHuggingFaceBitForBitAndInitFromStartsAtItsLoss) {
  const std::string dir = scratch_dir() + "/convert";
  // A short fp32 run, exported as a Hugging Face directory and as one bf16 file.
  Result r = ds("train examples/quickstart.json bf16.enabled=false train.steps=40 train.eval_every=0 train.output_dir=" + dir + "/run");
  ASSERT_EQ(r.code, 0) << r.err;
  r = ds("convert-ckpt " + dir + "/run " + dir + "/hf");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* f : {"config.json", "generation_config.json", "model.safetensors"}) EXPECT_TRUE(std::filesystem::exists(dir + "/hf/" + f)) << f;
  const nlohmann::json cfg = nlohmann::json::parse(slurp(dir + "/hf/config.json"));
  EXPECT_EQ(cfg["model_type"], "gpt2");
  EXPECT_EQ(cfg["architectures"][0], "GPT2LMHeadModel");
  EXPECT_EQ(cfg["n_embd"], 64);
  EXPECT_EQ(cfg["n_layer"], 2);
  EXPECT_EQ(cfg["torch_dtype"], "float32");
  // A byte vocabulary has no special tokens: said as null, so transformers does not take GPT-2's 50256
  // (outside these 256 ids); generation_config.json says the same.
  EXPECT_TRUE(cfg.contains("bos_token_id") && cfg["bos_token_id"].is_null()) << cfg.dump();
  EXPECT_TRUE(cfg.contains("eos_token_id") && cfg["eos_token_id"].is_null()) << cfg.dump();
  const nlohmann::json gen = nlohmann::json::parse(slurp(dir + "/hf/generation_config.json"));
  EXPECT_TRUE(gen.contains("eos_token_id") && gen["eos_token_id"].is_null()) << gen.dump();
  // --info reads it back: the tied head written once, GPT-2's Conv1D weights [in, out].
  r = ds("convert-ckpt --info " + dir + "/hf --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json info = nlohmann::json::parse(r.out);
  EXPECT_EQ(info["num_params"], 124672);
  EXPECT_EQ(info["tensors"].size(), 28u);
  EXPECT_FALSE(contains(r.out, "lm_head"));
  EXPECT_TRUE(contains(r.out, R"("transformer.h.0.attn.c_attn.weight")")) << r.out;
  r = ds("convert-ckpt --info " + dir + "/run");
  EXPECT_TRUE(contains(r.out, "step        40")) << r.out;
  // HF -> ds -> HF: one step at the warmup's learning rate 0 leaves the weights as loaded; exported again,
  // the file is the same bytes.
  r = ds("train examples/quickstart.json bf16.enabled=false train.steps=1 train.eval_every=0 model.init_from=" + dir +
         "/hf train.output_dir=" + dir + "/run2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "weights from Hugging Face directory")) << r.err;
  r = ds("convert-ckpt " + dir + "/run2 " + dir + "/hf2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(slurp(dir + "/hf/model.safetensors"), slurp(dir + "/hf2/model.safetensors"));
  // Training from the exported weights (or the run itself) starts at the trained loss, not at ln(256).
  const double trained = metrics_of(dir + "/run").back()["loss"].get<double>();
  const double first = metrics_of(dir + "/run2").front()["loss"].get<double>();
  EXPECT_LT(first, std::log(256.0) - 0.5);
  EXPECT_NEAR(first, trained, 0.25);
  // A bf16 consolidated file, then a destination that exists: refused without --overwrite.
  r = ds("convert-ckpt " + dir + "/run " + dir + "/w.safetensors --dtype bf16");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(std::filesystem::file_size(dir + "/w.safetensors") < std::filesystem::file_size(dir + "/hf/model.safetensors") / 2 + 4096, true);
  r = ds("convert-ckpt " + dir + "/run " + dir + "/w.safetensors");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "already exists")) << r.err;
  EXPECT_EQ(ds("convert-ckpt " + dir + "/run " + dir + "/w.safetensors --overwrite").code, 0);
  // A file in a folder that does not exist yet: made, as a directory export's is; the same tensors.
  r = ds("convert-ckpt " + dir + "/run " + dir + "/new/out/w.safetensors");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(slurp(dir + "/new/out/w.safetensors"), slurp(dir + "/w.safetensors"));
  // Shards above --max-shard-size, with their index.
  r = ds("convert-ckpt " + dir + "/run " + dir + "/sharded --max-shard-size 200KB");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json index = nlohmann::json::parse(slurp(dir + "/sharded/model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 124672 * 4);
  EXPECT_TRUE(std::filesystem::exists(dir + "/sharded/model-00003-of-00003.safetensors"));
  r = ds("convert-ckpt --info " + dir + "/sharded --json");
  EXPECT_EQ(nlohmann::json::parse(r.out)["num_params"], 124672);
}

TEST(CliConvert, AnIndependentReaderOfTheExportComputesTheLossDsComputes) {
  // tests/tools/hf_lm_loss.py reads model.safetensors with Python's json and struct modules and runs a plain
  // GPT-2 or Llama written against Hugging Face's names and layouts (Llama: RMSNorm, rotary halves, grouped-query
  // attention, SwiGLU, an untied head); ds evaluates the same weights on the same 16 tokens (a first step's loss
  // is computed before any update).
  if (std::system("python3 -c 'import json, struct' >/dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  const std::string dir = scratch_dir() + "/reader";
  std::filesystem::create_directories(dir);
  write_window(dir + "/window.bin", 37, 11);
  const std::string window = " data.type=tokens data.path=" + dir + "/window.bin data.token_format=uint16 data.seq_len=16 "
                             "data.val_fraction=0 train_micro_batch_size_per_gpu=1 train.steps=1 train.eval_every=0 ";
  for (const std::string model : {"model.preset=gpt2-tiny", "model.preset=llama-tiny model.tie_word_embeddings=false"}) {
    SCOPED_TRACE(model);
    const std::string d = dir + "/" + model.substr(13, 4);
    const std::string base = "train examples/quickstart.json bf16.enabled=false " + model;
    ASSERT_EQ(ds(base + " train.steps=30 train.eval_every=0 train.output_dir=" + d + "/run").code, 0);
    ASSERT_EQ(ds("convert-ckpt " + d + "/run " + d + "/hf").code, 0);
    Result r = ds(base + window + "model.init_from=" + d + "/hf train.output_dir=" + d + "/eval");
    ASSERT_EQ(r.code, 0) << r.err;
    const double ds_loss = metrics_of(d + "/eval").front()["loss"].get<double>();
    const std::string cmd = "python3 " DS_SOURCE_DIR "/tests/tools/hf_lm_loss.py " + d + "/hf " + dir + "/window.bin > " + d + "/py.txt";
    ASSERT_EQ(std::system(cmd.c_str()), 0);
    const double py_loss = std::stod(slurp(d + "/py.txt"));
    EXPECT_NEAR(py_loss, ds_loss, 1e-4 * ds_loss);
    // ...and they are the trained weights: the random initialisation scores the same window differently.
    r = ds(base + window + "train.output_dir=" + d + "/eval_random");
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_GT(std::fabs(metrics_of(d + "/eval_random").front()["loss"].get<double>() - py_loss), 1e-2);
  }
}

TEST(CliConvert, HuggingFaceToDsToHuggingFaceIsBitIdenticalForGpt2AndLlamaTiedOrNot) {
  const std::string dir = scratch_dir() + "/hf_round";
  for (const std::string& model : {std::string("model.preset=gpt2-tiny"), std::string("model.preset=llama-tiny model.tie_word_embeddings=false"),
                                   std::string("model.preset=llama-tiny model.tie_word_embeddings=true"),
                                   std::string("model.preset=llama-tiny model.bos_token_id=1 model.eos_token_id=[2,3]")}) {
    SCOPED_TRACE(model);
    const std::string d = dir + "/" + std::to_string(std::hash<std::string>{}(model));
    ASSERT_EQ(ds("train examples/quickstart.json " + model + " train.steps=3 train.eval_every=0 train.output_dir=" + d + "/run").code, 0);
    ASSERT_EQ(ds("convert-ckpt " + d + "/run " + d + "/hf").code, 0);
    Result r = ds("convert-ckpt " + d + "/hf " + d + "/ds");  // Hugging Face -> a ds run directory at step 0
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(contains(r.err, "step 0, optimizer fresh")) << r.err;
    ASSERT_EQ(ds("convert-ckpt " + d + "/ds " + d + "/hf2").code, 0);
    EXPECT_EQ(slurp(d + "/hf/model.safetensors"), slurp(d + "/hf2/model.safetensors"));
    const nlohmann::json cfg = nlohmann::json::parse(slurp(d + "/hf2/config.json"));
    // The special tokens survive the round trip (a list of ends, as Llama 3 has, included).
    const nlohmann::json first = nlohmann::json::parse(slurp(d + "/hf/config.json"));
    EXPECT_EQ(cfg["bos_token_id"], first["bos_token_id"]);
    EXPECT_EQ(cfg["eos_token_id"], first["eos_token_id"]);
    if (contains(model, "eos_token_id")) {
      EXPECT_EQ(cfg["bos_token_id"], 1);
      EXPECT_EQ(cfg["eos_token_id"], nlohmann::json::parse("[2, 3]"));
    }
    if (contains(model, "llama")) {
      EXPECT_EQ(cfg["architectures"][0], "LlamaForCausalLM");
      EXPECT_EQ(cfg["num_key_value_heads"], 2);  // llama-tiny: 4 query heads share 2 key/value heads
      EXPECT_EQ(cfg["num_attention_heads"], 4);
      EXPECT_EQ(cfg["tie_word_embeddings"], contains(model, "=true"));
      EXPECT_EQ(contains(slurp(d + "/hf2/model.safetensors"), "lm_head.weight"), !cfg["tie_word_embeddings"].get<bool>());
    }
    // The imported run trains on from its weights.
    r = ds("train examples/quickstart.json " + model + " train.steps=2 train.eval_every=0 model.init_from=" + d + "/ds train.output_dir=" + d + "/again");
    EXPECT_EQ(r.code, 0) << r.err;
  }
}

TEST(CliConvert, AGpt2BpeRunsTokenizerFilesGoWithItsExport) {
  const std::string dir = scratch_dir() + "/bpe";
  std::filesystem::create_directories(dir);
  {
    std::ofstream text(dir + "/corpus.txt");
    for (int i = 0; i < 200; ++i) text << "To be, or not to be, that is the question " << i << ".\n";
  }
  const std::string shared = DS_SHARED_DIR "/data/gpt2";
  Result r = ds("train examples/quickstart.json model.vocab_size=50257 data.type=text data.tokenizer=gpt2 data.path=" + dir +
                "/corpus.txt data.vocab_file=" + shared + "/vocab.json data.merges_file=" + shared +
                "/merges.txt data.seq_len=32 train.steps=2 train.eval_every=0 train.output_dir=" + dir + "/run");
  ASSERT_EQ(r.code, 0) << r.err;
  r = ds("convert-ckpt " + dir + "/run " + dir + "/hf");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(slurp(dir + "/hf/vocab.json"), slurp(shared + "/vocab.json"));
  EXPECT_EQ(slurp(dir + "/hf/merges.txt"), slurp(shared + "/merges.txt"));
  EXPECT_EQ(nlohmann::json::parse(slurp(dir + "/hf/config.json"))["eos_token_id"], 50256);
}

TEST(CliConvert, InitFromIsCheckedTensorByTensorBeforeTraining) {
  // Planning on another machine: a warning. Training: exit 2, naming the key.
  Result r = ds("plan examples/quickstart.json model.init_from=/nonexistent");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "model.init_from")) << r.err;
  r = ds("train examples/quickstart.json model.init_from=/nonexistent train.output_dir=" + scratch_dir() + "/never");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "model.init_from: '/nonexistent' does not exist")) << r.err;
  // A model of another shape than the source's: the key and both values are named.
  const std::string run = scratch_dir() + "/init_src";
  ASSERT_EQ(ds("train examples/quickstart.json train.steps=2 train.eval_every=0 train.output_dir=" + run).code, 0);
  r = ds("train examples/quickstart.json model.max_position_embeddings=256 model.init_from=" + run);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "model.max_position_embeddings: the config gives 256, but model.init_from (" + run + ") was trained with 128"))
      << r.err;
  // A lone safetensors file names no architecture: its tensors are checked against the config's, naming
  // the tensor and both shapes.
  ASSERT_EQ(ds("convert-ckpt " + run + " " + run + ".safetensors").code, 0);
  r = ds("train examples/quickstart.json model.max_position_embeddings=256 model.init_from=" + run + ".safetensors");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "tensor 'transformer.wpe.weight' is [128, 64]") && contains(r.err, "but [256, 64] in this model")) << r.err;
  r = ds("convert-ckpt " + scratch_dir() + "/nothing_here out");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "does not exist")) << r.err;
}

TEST(CliConvert, InitFromTakesTheSourcesArchitectureAndRefusesAConfigThatDisagrees) {
  const std::string dir = scratch_dir() + "/init_arch";
  std::filesystem::remove_all(dir);
  Result r = ds("train examples/quickstart.json bf16.enabled=false train.steps=10 train.eval_every=0 train.output_dir=" + dir + "/run");
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_EQ(ds("convert-ckpt " + dir + "/run " + dir + "/hf").code, 0);
  // No architecture in the config: the source's, from a Hugging Face directory and from a ds run alike.
  for (const std::string& source : {dir + "/hf", dir + "/run"}) {
    const std::string out = dir + "/from_" + std::filesystem::path(source).filename().string();
    r = ds("train examples/quickstart.json ~model.preset model.init_from=" + source + " train.steps=2 train.eval_every=0 train.output_dir=" + out);
    ASSERT_EQ(r.code, 0) << source << "\n" << r.err;
    EXPECT_TRUE(contains(r.err, "the model is model.init_from's: gpt2, 2 layers x 64 wide, vocab 256")) << r.err;
    // The run's stored config says what it trained (explicit keys), so it resumes and exports on its own.
    const nlohmann::json cfg = nlohmann::json::parse(slurp(out + "/config.json"));
    EXPECT_EQ(cfg["model"]["hidden_size"], 64) << cfg["model"].dump();
    EXPECT_EQ(cfg["model"]["arch"], "gpt2");
    // `ds plan --resolved-config` shows the config the run stored: the same model block, source's keys taken.
    r = ds("plan examples/quickstart.json ~model.preset model.init_from=" + source + " train.steps=2 train.eval_every=0 train.output_dir=" +
           out + " --resolved-config");
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(nlohmann::json::parse(r.out)["model"], cfg["model"]);
  }
  // A key the config gives without naming an architecture is the user's: checked against the source, never
  // replaced by its value.
  r = ds("train examples/quickstart.json ~model.preset model.hidden_size=32 model.init_from=" + dir + "/hf train.steps=2 train.output_dir=" +
         dir + "/narrow");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "model.hidden_size: the config gives 32, but model.init_from (" + dir + "/hf) was trained with 64")) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir + "/narrow"));
  // The config's own mistakes come before a source that is not there.
  r = ds("train examples/quickstart.json ~model.preset model.init_from=" + dir + "/nowhere zero_optimization.stage=7 train.output_dir=" +
         dir + "/never");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "zero_optimization.stage")) << r.err;
  EXPECT_FALSE(contains(r.err, "nowhere")) << r.err;
  r = ds("train examples/quickstart.json ~model.preset model.init_from=" + dir + "/nowhere train.output_dir=" + dir + "/never");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "model.init_from: '" + dir + "/nowhere' does not exist")) << r.err;
  // A config whose architecture computes another function: refused, naming the key and both values.
  r = ds("train examples/quickstart.json model.init_from=" + dir + "/hf model.norm_eps=1e-6 train.steps=2 train.output_dir=" + dir + "/eps");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "model.norm_eps: the config gives 1e-06, but model.init_from (" + dir + "/hf) was trained with 1e-05")) << r.err;
  r = ds("train examples/quickstart.json ~model.preset model.preset=llama-tiny model.init_from=" + dir + "/run train.steps=2 train.output_dir=" +
         dir + "/arch");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "model.arch: the config gives llama, but model.init_from")) << r.err;
  // A Hugging Face config whose values change the function in ways ds does not implement: refused.
  std::ofstream(dir + "/hf/config.json.tmp") << slurp(dir + "/hf/config.json");
  nlohmann::json hf = nlohmann::json::parse(slurp(dir + "/hf/config.json"));
  hf["scale_attn_by_inverse_layer_idx"] = true;
  std::ofstream(dir + "/hf/config.json") << hf.dump();
  r = ds("train examples/quickstart.json ~model.preset model.init_from=" + dir + "/hf train.steps=2 train.output_dir=" + dir + "/scaled");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "scale_attn_by_inverse_layer_idx true is not supported")) << r.err;
}

TEST(CliConvert, TokenizerFilesAreTheOnesTheRunReadWhereverTheExportRuns) {
  // The run names its tokenizer files relative to its working directory; the export runs elsewhere, where
  // the same relative path holds another vocab.json. It ships the run's files (absolute path and checksum
  // kept in the run's plan), and refuses once they have changed.
  const std::string dir = scratch_dir() + "/bpe_where";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/elsewhere/tok");
  std::filesystem::create_directories(work_dir() + "/tok");
  const std::string shared = DS_SHARED_DIR "/data/gpt2";
  std::filesystem::copy_file(shared + "/vocab.json", work_dir() + "/tok/vocab.json", std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(shared + "/merges.txt", work_dir() + "/tok/merges.txt", std::filesystem::copy_options::overwrite_existing);
  std::ofstream(dir + "/elsewhere/tok/vocab.json") << "{\"not\": 0, \"the\": 1, \"vocab\": 2}";
  std::ofstream(dir + "/elsewhere/tok/merges.txt") << "#version: 0.2\n";
  {
    std::ofstream text(dir + "/corpus.txt");
    for (int i = 0; i < 200; ++i) text << "All the world's a stage " << i << ".\n";
  }
  Result r = ds("train examples/quickstart.json model.vocab_size=50257 data.type=text data.tokenizer=gpt2 data.path=" + dir +
                "/corpus.txt data.vocab_file=tok/vocab.json data.merges_file=tok/merges.txt data.seq_len=32 train.steps=2 "
                "train.eval_every=0 train.output_dir=" + dir + "/run");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string export_from_elsewhere =
      "cd " + dir + "/elsewhere && " DS_BINARY " convert-ckpt " + dir + "/run " + dir + "/hf --overwrite >" + dir + "/out 2>" + dir + "/err";
  ASSERT_EQ(std::system(export_from_elsewhere.c_str()), 0) << slurp(dir + "/err");
  EXPECT_EQ(slurp(dir + "/hf/vocab.json"), slurp(shared + "/vocab.json"));
  EXPECT_EQ(slurp(dir + "/hf/merges.txt"), slurp(shared + "/merges.txt"));
  // Resharded, the run keeps its record: the reshard's export ships the same files, not the decoys here.
  const std::string reshard_and_export = "cd " + dir + "/elsewhere && " DS_BINARY " convert-ckpt " + dir + "/run " + dir +
                                         "/one --world-size 1 --stage 1 >" + dir + "/out 2>" + dir + "/err && " DS_BINARY " convert-ckpt " +
                                         dir + "/one " + dir + "/one-hf >" + dir + "/out 2>" + dir + "/err";
  ASSERT_EQ(std::system(reshard_and_export.c_str()), 0) << slurp(dir + "/err");
  EXPECT_EQ(slurp(dir + "/one-hf/vocab.json"), slurp(shared + "/vocab.json"));
  EXPECT_EQ(slurp(dir + "/one-hf/merges.txt"), slurp(shared + "/merges.txt"));
  // The file the run read has changed: the export is refused, naming it, before it writes anything.
  const std::string weights = slurp(dir + "/hf/model.safetensors");
  std::ofstream(work_dir() + "/tok/vocab.json", std::ios::app) << " ";
  EXPECT_NE(std::system(export_from_elsewhere.c_str()), 0);
  EXPECT_TRUE(contains(slurp(dir + "/err"), "tok/vocab.json' has changed since the run read it")) << slurp(dir + "/err");
  EXPECT_EQ(slurp(dir + "/hf/model.safetensors"), weights);
  EXPECT_EQ(slurp(dir + "/hf/vocab.json"), slurp(shared + "/vocab.json"));
}

TEST(CliConvert, ALoraRunsPeftAdapterMergedOnItsBaseByAnIndependentReaderScoresWhatDsScores) {
  if (std::system("python3 -c 'import json, struct' >/dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  const std::string dir = scratch_dir() + "/lora";
  std::filesystem::create_directories(dir);
  write_window(dir + "/window.bin", 53, 7);
  // The base: a short fp32 run, exported. The LoRA run freezes it and trains an adapter on every projection.
  ASSERT_EQ(ds("train examples/quickstart.json bf16.enabled=false train.steps=30 train.save_every=10 train.eval_every=0 train.output_dir=" + dir + "/base").code, 0);
  ASSERT_EQ(ds("convert-ckpt " + dir + "/base " + dir + "/base-hf").code, 0);
  const std::string lora = "train examples/lora.json bf16.enabled=false model.init_from=" + dir + "/base-hf model.lora.dropout=0 ";
  Result r = ds(lora + "train.steps=20 train.eval_every=0 train.output_dir=" + dir + "/run");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "frozen base from Hugging Face directory")) << r.err;
  // A LoRA checkpoint holds the adapter: exporting it as a whole model is refused, --adapter writes PEFT's files.
  r = ds("convert-ckpt " + dir + "/run " + dir + "/whole");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "holds a LoRA adapter, not a whole model")) << r.err;
  r = ds("convert-ckpt " + dir + "/run " + dir + "/adapter --adapter");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json cfg = nlohmann::json::parse(slurp(dir + "/adapter/adapter_config.json"));
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["r"], 8);
  EXPECT_EQ(cfg["lora_alpha"], 16.0);
  EXPECT_EQ(cfg["bias"], "none");
  EXPECT_EQ(cfg["fan_in_fan_out"], true);  // GPT-2's Conv1D
  EXPECT_EQ(cfg["target_modules"], nlohmann::json::parse(R"(["c_attn", "c_proj", "c_fc"])"));
  EXPECT_EQ(cfg["base_model_name_or_path"], dir + "/base-hf");
  r = ds("convert-ckpt --info " + dir + "/run --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["tensors"].size(), 2u * 4u * 2u);  // A and B x 4 projections x 2 blocks
  // ds's loss of the window with the trained adapter: one more step, resumed on the window (its loss is taken
  // before the update), against the independent reader's with the adapter merged into the base.
  r = ds(lora + "train.steps=21 train.output_dir=" + dir + "/run --resume data.type=tokens data.path=" + dir +
         "/window.bin data.token_format=uint16 data.seq_len=16 data.val_fraction=0 train_micro_batch_size_per_gpu=1 train.eval_every=0");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json last = metrics_of(dir + "/run").back();
  ASSERT_EQ(last["step"], 21);
  const double ds_loss = last["loss"].get<double>();
  const std::string py = "python3 " DS_SOURCE_DIR "/tests/tools/hf_lm_loss.py " + dir + "/base-hf " + dir + "/window.bin ";
  ASSERT_EQ(std::system((py + dir + "/adapter > " + dir + "/merged.txt").c_str()), 0);
  EXPECT_NEAR(std::stod(slurp(dir + "/merged.txt")), ds_loss, 1e-4 * ds_loss);
  // ...and the adapter matters: the base alone scores the window differently.
  ASSERT_EQ(std::system((py + "> " + dir + "/base.txt").c_str()), 0);
  EXPECT_GT(std::fabs(std::stod(slurp(dir + "/base.txt")) - ds_loss), 1e-3);
  // The PEFT adapter as model.init_from continues from it: its first step on the window scores what the run did.
  const std::string on_window = "data.type=tokens data.path=" + dir + "/window.bin data.token_format=uint16 data.seq_len=16 "
                                "data.val_fraction=0 train_micro_batch_size_per_gpu=1 train.eval_every=0 train.steps=1 ";
  r = ds("train examples/lora.json bf16.enabled=false model.lora.dropout=0 model.init_from=" + dir + "/adapter " + on_window +
         "train.output_dir=" + dir + "/continued");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "adapter from " + dir + "/adapter")) << r.err;
  EXPECT_NEAR(metrics_of(dir + "/continued").front()["loss"].get<double>(), ds_loss, 1e-6 * ds_loss);
  r = ds("train examples/lora.json model.lora.r=4 model.init_from=" + dir + "/adapter " + on_window + "train.output_dir=" + dir + "/r4");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "model.lora.r is 4, but the adapter")) << r.err;
  // --merge: the base with the adapter folded in is a plain Hugging Face model scoring the same, for the
  // independent reader and for ds starting from it.
  r = ds("convert-ckpt " + dir + "/run " + dir + "/merged --merge -t step_00000020");  // the adapter exported above (the resume saved 21)
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string merged_py = "python3 " DS_SOURCE_DIR "/tests/tools/hf_lm_loss.py " + dir + "/merged " + dir + "/window.bin > " + dir + "/m.txt";
  ASSERT_EQ(std::system(merged_py.c_str()), 0);
  EXPECT_NEAR(std::stod(slurp(dir + "/m.txt")), ds_loss, 1e-4 * ds_loss);
  r = ds("train examples/quickstart.json bf16.enabled=false model.init_from=" + dir + "/merged train.output_dir=" + dir +
         "/from_merged data.type=tokens data.path=" + dir + "/window.bin data.token_format=uint16 data.seq_len=16 data.val_fraction=0 "
         "train_micro_batch_size_per_gpu=1 train.steps=1 train.eval_every=0");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NEAR(metrics_of(dir + "/from_merged").front()["loss"].get<double>(), ds_loss, 1e-4 * ds_loss);
  // Another base than the run's is refused by its checksum; a run that trained every weight has no adapter.
  r = ds("convert-ckpt " + dir + "/run " + dir + "/merged2 --merge --base " + dir + "/base/checkpoints/step_00000010");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "is not the base")) << r.err;
  r = ds("convert-ckpt " + dir + "/base " + dir + "/merged3 --merge");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "holds no LoRA adapter")) << r.err;
}

// PEFT's layers_to_transform: the adapter on block 1 alone (block 0 below it runs forward only). The exported
// adapter names the block and holds its tensors alone; the independent reader, merging what the adapter holds,
// scores the window as ds does; ds continues it only with the same blocks.
TEST(CliConvert, AnAdapterOnSomeBlocksExportsTheirNumbersAndScoresWhatDsScores) {
  if (std::system("python3 -c 'import json, struct' >/dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  const std::string dir = scratch_dir() + "/lora_layers";
  std::filesystem::create_directories(dir);
  write_window(dir + "/window.bin", 41, 5);
  ASSERT_EQ(ds("train examples/quickstart.json bf16.enabled=false train.steps=20 train.eval_every=0 train.output_dir=" + dir + "/base").code, 0);
  ASSERT_EQ(ds("convert-ckpt " + dir + "/base " + dir + "/base-hf").code, 0);
  const std::string lora = "train examples/lora.json bf16.enabled=false model.init_from=" + dir + "/base-hf model.lora.dropout=0 "
                           "model.lora.layers_to_transform=1 ";
  Result r = ds("plan" + lora.substr(5));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "block 0 runs forward only")) << r.out;
  r = ds(lora + "train.steps=15 train.eval_every=0 train.output_dir=" + dir + "/run");
  ASSERT_EQ(r.code, 0) << r.err;
  r = ds("convert-ckpt " + dir + "/run " + dir + "/adapter --adapter");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json cfg = nlohmann::json::parse(slurp(dir + "/adapter/adapter_config.json"));
  EXPECT_EQ(cfg["layers_to_transform"], nlohmann::json::parse("[1]"));
  r = ds("convert-ckpt --info " + dir + "/run --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json info = nlohmann::json::parse(r.out);
  ASSERT_EQ(info["tensors"].size(), 2u * 4u);  // A and B x 4 projections of block 1
  for (const auto& t : info["tensors"]) EXPECT_TRUE(contains(t["name"].get<std::string>(), ".h.1.")) << t["name"];
  // One more step on the window (its loss taken before the update) against the reader's with the adapter merged.
  r = ds(lora + "train.steps=16 train.output_dir=" + dir + "/run --resume data.type=tokens data.path=" + dir +
         "/window.bin data.token_format=uint16 data.seq_len=16 data.val_fraction=0 train_micro_batch_size_per_gpu=1 train.eval_every=0");
  ASSERT_EQ(r.code, 0) << r.err;
  const double ds_loss = metrics_of(dir + "/run").back()["loss"].get<double>();
  const std::string py = "python3 " DS_SOURCE_DIR "/tests/tools/hf_lm_loss.py " + dir + "/base-hf " + dir + "/window.bin ";
  ASSERT_EQ(std::system((py + dir + "/adapter > " + dir + "/merged.txt").c_str()), 0);
  EXPECT_NEAR(std::stod(slurp(dir + "/merged.txt")), ds_loss, 1e-4 * ds_loss);
  // Continued from the PEFT files with the same blocks; refused with others, naming the key and both.
  const std::string on_window = "data.type=tokens data.path=" + dir + "/window.bin data.token_format=uint16 data.seq_len=16 "
                                "data.val_fraction=0 train_micro_batch_size_per_gpu=1 train.eval_every=0 train.steps=1 ";
  const std::string from = "train examples/lora.json bf16.enabled=false model.lora.dropout=0 model.init_from=" + dir + "/adapter " + on_window;
  r = ds(from + "model.lora.layers_to_transform=[1] train.output_dir=" + dir + "/continued");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NEAR(metrics_of(dir + "/continued").front()["loss"].get<double>(), ds_loss, 1e-6 * ds_loss);
  r = ds(from + "train.output_dir=" + dir + "/every");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "model.lora.layers_to_transform is every block (null), but the adapter")) << r.err;
  EXPECT_TRUE(contains(r.err, "has [1]")) << r.err;
  // A block the model does not have is the config's error.
  r = ds("plan examples/lora.json model.lora.layers_to_transform=[0,7] model.init_from=" + dir + "/base-hf");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "block 7 is past the model's 2 blocks")) << r.err;
}

TEST(CliConvert, AFrozenRunCheckpointsWhatTrainedAndMergesWithItsBaseIntoTheModelItTrained) {
  const std::string dir = scratch_dir() + "/freeze";
  base_and_window(dir, 29, 3);
  const std::string frozen = kFp32Quickstart + "model.init_from=" + dir + "/base-hf 'model.freeze=[\"transformer.wte.weight\", \"transformer.h.0.*\"]' ";
  Result r = ds(frozen + "train.steps=10 train.output_dir=" + dir + "/run");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "frozen tensors from Hugging Face directory")) << r.err;
  r = ds("convert-ckpt --info " + dir + "/run --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["tensors"].size(), 28u - 1u - 12u);  // without wte and block 0's 12 tensors
  r = ds("convert-ckpt " + dir + "/run " + dir + "/whole");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "holds only the tensors that trained")) << r.err;
  r = ds("convert-ckpt " + dir + "/run " + dir + "/merged --merge");
  ASSERT_EQ(r.code, 0) << r.err;
  // The merged model is the one the run trained: scored on a window from it, and by the run itself resumed on
  // that window (its loss taken before the update), the same.
  const double merged = window_loss(dir, dir + "/merged", "eval");
  r = ds(frozen + kOnWindow + "data.path=" + dir + "/window.bin train.steps=11 train.output_dir=" + dir + "/run --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  const double resumed = metrics_of(dir + "/run").back()["loss"].get<double>();
  EXPECT_NEAR(merged, resumed, 1e-6 * resumed);
  EXPECT_GT(std::fabs(window_loss(dir, dir + "/base-hf", "eval_base") - resumed), 1e-3);  // ...and not the base's: what trained is in it
}

TEST(CliConvert, AFullRankLoraMergedIsTheFunctionTheAdapterComputed) {
  // r = 64 is full rank for every projection of gpt2-tiny (64 wide: c_attn 64 -> 192, c_fc 64 -> 256, the
  // MLP's c_proj 256 -> 64), alpha = r: W + B A is then any matrix, and the merged export must compute
  // what the base and the learned adapter computed together (loss equal to 1e-5).
  const std::string dir = scratch_dir() + "/lora_full";
  base_and_window(dir, 41, 5);
  const std::string lora = "train examples/lora.json bf16.enabled=false train.eval_every=0 model.init_from=" + dir +
                           "/base-hf model.lora.r=64 model.lora.alpha=64 model.lora.dropout=0 ";
  Result r = ds(lora + "train.steps=15 train.output_dir=" + dir + "/run");
  ASSERT_EQ(r.code, 0) << r.err;
  r = ds("convert-ckpt " + dir + "/run " + dir + "/merged --merge");
  ASSERT_EQ(r.code, 0) << r.err;
  const double merged = window_loss(dir, dir + "/merged", "eval");
  r = ds(lora + kOnWindow + "data.path=" + dir + "/window.bin train.steps=16 train.output_dir=" + dir + "/run --resume");  // loss before the update
  ASSERT_EQ(r.code, 0) << r.err;
  const double adapter = metrics_of(dir + "/run").back()["loss"].get<double>();
  EXPECT_NEAR(merged, adapter, 1e-5 * adapter);
  EXPECT_GT(std::fabs(window_loss(dir, dir + "/base-hf", "eval_base") - adapter), 1e-3);  // the adapter learned something
}

// Llama 3.1's rope scaling (and linear, yarn): a tiny Llama with each, trained, exported with its rope_scaling
// in config.json, scored by the independent reader (tests/tools/hf_lm_loss.py, Hugging Face's formulas written
// out in Python) as ds scores it; and the same weights scored without the scaling differ.
TEST(CliConvert, RopeScalingIsComputedAsHuggingFaceComputesIt) {
  if (std::system("python3 -c 'import json, struct' >/dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  const std::string dir = scratch_dir() + "/rope";
  std::filesystem::create_directories(dir);
  write_window(dir + "/window.bin", 41, 3);
  const std::string window = " data.type=tokens data.path=" + dir + "/window.bin data.token_format=uint16 data.seq_len=16 "
                             "data.val_fraction=0 train_micro_batch_size_per_gpu=1 train.steps=1 train.eval_every=0 ";
  // A short original context so that the 16 positions reach every branch of each formula.
  const std::vector<std::pair<std::string, std::string>> kinds = {
      {"llama3", R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32})"},
      {"linear", R"({"rope_type": "linear", "factor": 4.0})"},
      {"yarn", R"({"rope_type": "yarn", "factor": 4.0})"}};  // longrope, Phi-3's: EachFamilyTrainsExports...
  for (const auto& [name, scaling] : kinds) {
    SCOPED_TRACE(name);
    const std::string d = dir + "/" + name;
    const std::string base = "train examples/quickstart.json bf16.enabled=false model.preset=llama-tiny model.tie_word_embeddings=false "
                             "'model.rope_scaling=" + scaling + "'";
    ASSERT_EQ(ds(base + " train.steps=20 train.eval_every=0 train.output_dir=" + d + "/run").code, 0);
    Result r = ds("convert-ckpt " + d + "/run " + d + "/hf");
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(nlohmann::json::parse(slurp(d + "/hf/config.json"))["rope_scaling"], nlohmann::json::parse(scaling));
    r = ds(base + window + "model.init_from=" + d + "/hf train.output_dir=" + d + "/eval");
    ASSERT_EQ(r.code, 0) << r.err;
    const double ds_loss = metrics_of(d + "/eval").front()["loss"].get<double>();
    ASSERT_EQ(std::system(("python3 " DS_SOURCE_DIR "/tests/tools/hf_lm_loss.py " + d + "/hf " + dir + "/window.bin > " + d + "/py.txt").c_str()), 0);
    const double py_loss = std::stod(slurp(d + "/py.txt"));
    EXPECT_NEAR(py_loss, ds_loss, 2e-6 * ds_loss);  // fp32 against double: far closer than what the scaling moves
    // The reader without the scaling scores the same weights otherwise: the scaling is what ds computed.
    std::filesystem::remove_all(d + "/plain");
    std::filesystem::copy(d + "/hf", d + "/plain");
    nlohmann::json plain = nlohmann::json::parse(slurp(d + "/plain/config.json"));
    plain["rope_scaling"] = nullptr;
    std::ofstream(d + "/plain/config.json", std::ios::trunc) << plain.dump(2);
    ASSERT_EQ(std::system(("python3 " DS_SOURCE_DIR "/tests/tools/hf_lm_loss.py " + d + "/plain " + dir + "/window.bin > " + d + "/plain.txt").c_str()), 0);
    EXPECT_GT(std::fabs(std::stod(slurp(d + "/plain.txt")) - py_loss), 2e-5 * ds_loss);
    // A config that names another scaling than its init_from source trained with is refused.
    r = ds(base + window + "model.rope_scaling=null model.init_from=" + d + "/hf train.output_dir=" + d + "/eval_plain");
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_TRUE(contains(r.err, "model.rope_scaling")) << r.err;
  }
}

// Each family's tiny model (every feature of the family on) trains, exports a directory whose config.json
// names the family as transformers does, is scored by the independent reader as ds scores it, and comes
// back through ds byte for byte.
TEST(CliConvert, EachFamilyTrainsExportsAndRoundTripsAsHuggingFaceReadsIt) {
  if (std::system("python3 -c 'import json, struct' >/dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  const std::string dir = scratch_dir() + "/families";
  std::filesystem::create_directories(dir);
  write_window(dir + "/window.bin", 43, 5);
  const std::string window = " data.type=tokens data.path=" + dir + "/window.bin data.token_format=uint16 data.seq_len=16 "
                             "data.val_fraction=0 train_micro_batch_size_per_gpu=1 train.steps=1 train.eval_every=0 ";
  struct Case {
    std::string name, model, hf_class;
  };
  for (const Case& c : {Case{"llama", "model.preset=llama-tiny model.attention_bias=true model.mlp_bias=true model.head_dim=24", "LlamaForCausalLM"},
                        Case{"mistral", "model.preset=mistral-tiny model.sliding_window=8", "MistralForCausalLM"},
                        Case{"qwen2", "model.preset=qwen2-tiny", "Qwen2ForCausalLM"},
                        Case{"qwen3", "model.preset=qwen3-tiny model.attention_bias=true", "Qwen3ForCausalLM"},
                        // Phi-3 long-context style: longrope, its original context of 8 at config.json's top level on export
                        Case{"phi3", "model.preset=phi3-tiny model.sliding_window=10 'model.rope_scaling={\"type\": \"longrope\", "
                                     "\"short_factor\": [1, 1.2, 1.5, 2, 3, 4, 6, 8], \"long_factor\": [1, 2, 3, 5, 8, 13, 21, 34], "
                                     "\"original_max_position_embeddings\": 8}'", "Phi3ForCausalLM"},
                        Case{"gemma", "model.preset=gemma-tiny", "GemmaForCausalLM"},
                        Case{"gemma2", "model.preset=gemma2-tiny", "Gemma2ForCausalLM"}}) {
    SCOPED_TRACE(c.name);
    const std::string d = dir + "/" + c.name;
    const std::string base = "train examples/quickstart.json bf16.enabled=false " + c.model;
    Result r = ds(base + " train.steps=30 train.eval_every=0 train.output_dir=" + d + "/run");
    ASSERT_EQ(r.code, 0) << r.err;
    const auto losses = metrics_of(d + "/run");
    EXPECT_LT(losses.back()["loss"].get<double>(), losses.front()["loss"].get<double>() - 0.3);  // it learns
    r = ds("convert-ckpt " + d + "/run " + d + "/hf");
    ASSERT_EQ(r.code, 0) << r.err;
    const nlohmann::json cfg = nlohmann::json::parse(slurp(d + "/hf/config.json"));
    EXPECT_EQ(cfg["architectures"][0], c.hf_class);
    EXPECT_EQ(cfg["model_type"], c.name);
    if (c.name == "phi3") {
      EXPECT_EQ(cfg["original_max_position_embeddings"], 8);
      EXPECT_EQ(cfg["rope_scaling"]["type"], "longrope");
      EXPECT_FALSE(cfg["rope_scaling"].contains("original_max_position_embeddings"));
    }
    // The independent reader (biases, per-head norms, head_dim, the window as config.json says) against ds.
    r = ds(base + window + "model.init_from=" + d + "/hf train.output_dir=" + d + "/eval");
    ASSERT_EQ(r.code, 0) << r.err;
    const double ds_loss = metrics_of(d + "/eval").front()["loss"].get<double>();
    ASSERT_EQ(std::system(("python3 " DS_SOURCE_DIR "/tests/tools/hf_lm_loss.py " + d + "/hf " + dir + "/window.bin > " + d + "/py.txt").c_str()), 0);
    EXPECT_NEAR(std::stod(slurp(d + "/py.txt")), ds_loss, 1e-5 * ds_loss);
    // Hugging Face -> ds -> Hugging Face: the same bytes, the same config.json.
    r = ds("convert-ckpt " + d + "/hf " + d + "/ds");
    ASSERT_EQ(r.code, 0) << r.err;
    ASSERT_EQ(ds("convert-ckpt " + d + "/ds " + d + "/hf2").code, 0);
    EXPECT_EQ(slurp(d + "/hf/model.safetensors"), slurp(d + "/hf2/model.safetensors"));
    EXPECT_EQ(slurp(d + "/hf/config.json"), slurp(d + "/hf2/config.json"));
    // LoRA on the export, with PEFT's default modules for the family (q_proj and v_proj; Phi-3 has none, so
    // they are named), out as a PEFT adapter of the family's module names, merged by the reader as PEFT merges.
    const bool phi3 = c.name == "phi3";
    const std::string lora_block = std::string(R"({"r": 4, "alpha": 8)") + (phi3 ? R"(, "target_modules": ["qkv_proj", "gate_up_proj"]})" : "}");
    const std::string lora = "train examples/quickstart.json bf16.enabled=false ~model.preset 'model.lora=" + lora_block + "' ";
    r = ds(lora + "model.init_from=" + d + "/hf train.steps=10 train.eval_every=0 train.output_dir=" + d + "/lora");
    ASSERT_EQ(r.code, 0) << r.err;
    r = ds("convert-ckpt " + d + "/lora " + d + "/adapter --adapter");
    ASSERT_EQ(r.code, 0) << r.err;
    const nlohmann::json adapter = nlohmann::json::parse(slurp(d + "/adapter/adapter_config.json"));
    EXPECT_EQ(adapter["target_modules"], phi3 ? nlohmann::json({"qkv_proj", "gate_up_proj"}) : nlohmann::json({"q_proj", "v_proj"}));
    EXPECT_EQ(adapter["fan_in_fan_out"], false);
    const std::string module = phi3 ? "self_attn.qkv_proj" : "self_attn.v_proj";
    EXPECT_TRUE(contains(slurp(d + "/adapter/adapter_model.safetensors"), "base_model.model.model.layers.1." + module + ".lora_B.weight"));
    r = ds(lora + window + "model.init_from=" + d + "/adapter train.output_dir=" + d + "/lora_eval");
    ASSERT_EQ(r.code, 0) << r.err;
    const double lora_loss = metrics_of(d + "/lora_eval").front()["loss"].get<double>();
    const std::string merged = "python3 " DS_SOURCE_DIR "/tests/tools/hf_lm_loss.py " + d + "/hf " + dir + "/window.bin " + d + "/adapter > " + d + "/merged.txt";
    ASSERT_EQ(std::system(merged.c_str()), 0);
    EXPECT_NEAR(std::stod(slurp(d + "/merged.txt")), lora_loss, 1e-5 * lora_loss);
    EXPECT_GT(std::fabs(lora_loss - ds_loss), 1e-4);  // the adapter changed the function
  }
}
