// Fine-tuning on chat data as a user runs it: examples/sft.json (conversations in jsonl, the model's own
// tokenizer.json, ChatML recognised from tokenizer_config.json, the loss on the answers only), what
// ds plan and the run's log say of the data, a bad line refused with file:line before any work, and a
// resume that continues with the samples the uninterrupted run would have seen.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

#include "cli_helpers.hpp"

using namespace cli_test;

TEST(CliSft, PlanSaysHowTheChatDataIsRead) {
  Result r = ds("plan examples/sft.json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "jsonl examples/data/sft/chat.jsonl, tokenizer examples/data/sft, chat format auto, one sample a row, "
                              "the loss on the completions and the assistant's turns"))
      << r.out;
}

TEST(CliSft, TheExampleLearnsToAnswerAndSaysWhatItTrainedOn) {
  const std::string dir = fresh("sft");
  Result r = ds("train examples/sft.json train.steps=60 train.eval_every=30 train.output_dir=" + dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "examples/data/sft/chat.jsonl: 1,200 samples (1,200 conversations), ")) << r.err;
  EXPECT_TRUE(contains(r.err, " trained; examples/data/sft/tokenizer.json: byte-level BPE (qwen2 pattern), 291 ids, 3 added tokens; "
                              "chat format chatml"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "% of the training rows' positions are padding (one sample a row)")) << r.err;
  const auto m = metrics_of(dir);
  ASSERT_EQ(m.size(), 60u);
  // The answers are a few tokens of a sum: the loss on them falls well below the uniform guess (ln 320).
  EXPECT_LT(m.back()["loss"].get<double>(), 0.5 * m.front()["loss"].get<double>()) << m.front() << m.back();
  // The tokenizer's files travel with the run's record, so an export ships them.
  std::set<std::string> recorded;
  const nlohmann::json plan = nlohmann::json::parse(slurp(dir + "/plan.json"));  // held: the loop reads a member of it
  for (const auto& f : plan["tokenizer_files"])
    if (f["role"] == "tokenizer_path") recorded.insert(f["name"].get<std::string>());
  EXPECT_EQ(recorded, (std::set<std::string>{"tokenizer.json", "tokenizer_config.json"}));
  r = ds("convert-ckpt " + dir + " " + dir + "-hf");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(slurp(dir + "-hf/tokenizer.json"), slurp(work_dir() + "/examples/data/sft/tokenizer.json"));
  EXPECT_TRUE(std::filesystem::exists(dir + "-hf/tokenizer_config.json"));
}

TEST(CliSft, ResumeContinuesWithTheSamplesOfTheUninterruptedRun) {
  const std::string whole = fresh("sft_whole"), split = fresh("sft_split");
  const std::string fp32 = "train examples/sft.json bf16.enabled=false train.eval_every=0 train.save_every=10 ";
  ASSERT_EQ(ds(fp32 + "train.steps=20 train.output_dir=" + whole).code, 0);
  ASSERT_EQ(ds(fp32 + "train.steps=10 train.output_dir=" + split).code, 0);
  Result r = ds(fp32 + "train.steps=20 train.output_dir=" + split + " --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto a = metrics_of(whole), b = metrics_of(split);
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  for (size_t i = 10; i < 20; ++i) EXPECT_EQ(a[i]["loss"], b[i]["loss"]) << "step " << i + 1;
}

TEST(CliSft, ABadLineStopsTheRunBeforeAnyWorkNamingFileAndLine) {
  const std::string dir = fresh("sft_bad");
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/bad.jsonl") << "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}\n"
                                    << "{\"messages\": [{\"role\": \"narrator\", \"content\": \"Once\"}]}\n";
  Result r = ds("train examples/sft.json data.path=" + dir + "/bad.jsonl train.output_dir=" + dir + "/run");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, dir + "/bad.jsonl:2: messages[0] has the role \"narrator\"")) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir + "/run/metrics.jsonl"));
  // jsonl read with another tokenizer than the model's own is refused at the config.
  r = ds("plan examples/sft.json data.tokenizer=gpt2");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "data.tokenizer")) << r.err;
}

TEST(CliSft, ShowSamplePrintsTheConversationAsTheModelSeesIt) {
  Result r = ds("plan examples/sft.json --show-sample 1");  // chat.jsonl's second line
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "<|im_start|>system\nAnswer with one sentence.<|im_end|>\n<|im_start|>user\nWhat is 34 plus 6?<|im_end|>\n"
                              "<|im_start|>assistant\n[[34 plus 6 is 40.<|im_end|>]]\n"))
      << r.out;
  r = ds("plan examples/sft.json --show-sample 5000");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "holds 1200 samples")) << r.err;
  r = ds("plan examples/quickstart.json --show-sample 0");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "data.type is synthetic")) << r.err;
}

// The loss of a step is the mean over all its counted targets, however the global batch is cut into micro
// batches: 16 samples as one micro batch or as four of four give the same losses (to rounding), where a mean
// of the micro batches' own means would weigh a short answer's tokens more than a long one's.
TEST(CliSft, TheStepLossWeighsEveryTrainedTokenAlikeWhateverTheMicroBatch) {
  const std::string one = fresh("sft_micro16"), four = fresh("sft_micro4");
  const std::string fp32 = "train examples/sft.json bf16.enabled=false train.eval_every=0 train.steps=4 train_batch_size=16 ";
  ASSERT_EQ(ds(fp32 + "train_micro_batch_size_per_gpu=16 train.output_dir=" + one).code, 0);
  ASSERT_EQ(ds(fp32 + "train_micro_batch_size_per_gpu=4 train.output_dir=" + four).code, 0);
  const auto a = metrics_of(one), b = metrics_of(four);
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const double x = a[i]["loss"].get<double>(), y = b[i]["loss"].get<double>();
    EXPECT_NEAR(x, y, 2e-5 * x) << "step " << i + 1;
  }
}

// Two ranks (real processes over Gloo) train the global batch of one rank: the same samples, and the same
// step and validation losses, every trained token weighing alike across the ranks.
TEST(CliSft, TwoRanksTrainWhatOneRankTrains) {
  const std::string one = fresh("sft_rank1"), two = fresh("sft_rank2");
  const std::string fp32 = "train examples/sft.json bf16.enabled=false train.steps=6 train.eval_every=3 train_batch_size=16 ";
  ASSERT_EQ(ds(fp32 + "train_micro_batch_size_per_gpu=16 train.output_dir=" + one).code, 0);
  Result r = ds(fp32 + "train_micro_batch_size_per_gpu=8 --nproc-per-node 2 train.output_dir=" + two);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto a = metrics_of(one), b = metrics_of(two);
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  int validations = 0;
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_NEAR(a[i]["loss"].get<double>(), b[i]["loss"].get<double>(), 1e-5) << "step " << i + 1;
    if (!a[i].contains("val_loss")) continue;
    ++validations;
    EXPECT_NEAR(a[i]["val_loss"].get<double>(), b[i]["val_loss"].get<double>(), 1e-5) << "step " << i + 1;
  }
  EXPECT_EQ(validations, 2);
}

// A micro batch whose sample has no trained token in its row (a prompt longer than seq_len) contributes
// nothing to the step, and the validation right after it still scores the held-out samples.
TEST(CliSft, ARowWithNothingTrainedThenAValidationRun) {
  const std::string dir = fresh("sft_untrained");
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir + "/data.jsonl");
    f << "{\"prompt\": \"" << std::string(300, 'x') << "\", \"completion\": \" done\"}\n";
    for (int i = 0; i < 20; ++i) f << "{\"prompt\": \"What is " << i << "?\", \"completion\": \" " << i << ".\"}\n";
  }
  Result r = ds("train examples/sft.json data.path=" + dir + "/data.jsonl data.shuffle=false train_micro_batch_size_per_gpu=1 "
                "train.steps=2 train.eval_every=1 train.eval_batches=2 train.output_dir=" + dir + "/run");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto m = metrics_of(dir + "/run");
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0]["loss"].get<double>(), 0.0);  // sample 0: its row is all prompt
  EXPECT_EQ(m[0]["trained_tokens"].get<int64_t>(), 0);
  EXPECT_GT(m[0]["val_loss"].get<double>(), 0.0);
  EXPECT_GT(m[1]["loss"].get<double>(), 0.0);
  // Nothing to learn: the step is skipped (no AdamW momentum or decay applied), and the schedule waits for it.
  EXPECT_TRUE(m[0]["skipped"].get<bool>());
  EXPECT_FALSE(m[1]["skipped"].get<bool>());
  EXPECT_TRUE(contains(r.err, "step 1: its samples hold no trained token within data.seq_len")) << r.err;
  EXPECT_TRUE(contains(r.err, "; 1 step skipped")) << r.err;  // (the run's last line, in the singular)
  {
    std::ofstream f(dir + "/answers.jsonl");  // the same without the long prompt: no step skipped
    for (int i = 0; i < 20; ++i) f << "{\"prompt\": \"What is " << i << "?\", \"completion\": \" " << i << ".\"}\n";
  }
  // The schedule waits for the skipped step: each later step runs at the rate of the step before it in a run
  // that skipped nothing.
  const std::string four = "train examples/sft.json data.shuffle=false train_micro_batch_size_per_gpu=1 train.steps=4 "
                           "train.eval_every=0 scheduler.params.warmup_num_steps=2 ";
  ASSERT_EQ(ds(four + "data.path=" + dir + "/data.jsonl train.output_dir=" + dir + "/skipped").code, 0);
  ASSERT_EQ(ds(four + "data.path=" + dir + "/answers.jsonl train.output_dir=" + dir + "/plain").code, 0);
  const auto s = metrics_of(dir + "/skipped"), u = metrics_of(dir + "/plain");
  ASSERT_EQ(s.size(), 4u);
  ASSERT_EQ(u.size(), 4u);
  EXPECT_FALSE(u[0]["skipped"].get<bool>());
  EXPECT_EQ(s[3]["lr"], u[2]["lr"]);
  EXPECT_NE(s[3]["lr"], u[3]["lr"]);
}

// train.epochs on jsonl counts rows: steps = ceil(epochs x the training split's samples / the global batch),
// the samples being the file's lines that are not blank (counted here independently of ds), and a run of one
// epoch makes that many steps.
TEST(CliSft, EpochsCountStepsInSamples) {
  const std::string dir = fresh("sft_epochs");
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir + "/data.jsonl", std::ios::binary);
    for (int i = 0; i < 45; ++i) {
      f << "{\"prompt\": \"What is " << i << "?\", \"completion\": \" " << i << ".\"}" << (i == 7 ? "\r\n" : "\n");
      if (i % 20 == 3) f << (i == 3 ? "  \t\n" : "\n");  // blank lines hold no sample
    }
  }
  int64_t samples = 0;
  {
    std::ifstream f(dir + "/data.jsonl");
    for (std::string line; std::getline(f, line);)
      if (line.find_first_not_of(" \t\r") != std::string::npos) ++samples;
  }
  ASSERT_EQ(samples, 45);
  const int64_t split = samples - static_cast<int64_t>(samples * 0.1), batch = 8;
  const std::string data = "data.path=" + dir + "/data.jsonl data.val_fraction=0.1 train_batch_size=8 train_micro_batch_size_per_gpu=8 ~train.steps ";
  Result r = ds("plan examples/sft.json " + data + "train.epochs=2 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json p = nlohmann::json::parse(r.out);
  EXPECT_EQ(p["steps"].get<int64_t>(), (2 * split + batch - 1) / batch);
  bool said = false;
  for (const auto& v : p["resolved"])
    if (v["path"] == "train.steps") said = v["source"].get<std::string>() == "train.epochs 2 x 41 training samples / 8 samples per step";
  EXPECT_TRUE(said) << p["resolved"].dump();
  EXPECT_EQ(p["scheduler"]["total_num_steps"], p["steps"]);
  r = ds("train examples/sft.json " + data + "train.epochs=1 train.eval_every=0 train.output_dir=" + dir + "/run");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(static_cast<int64_t>(metrics_of(dir + "/run").size()), (split + batch - 1) / batch);
}

// Data with nothing to train on is refused when epochs count the steps, and ds profile measures its own steps
// whatever epochs the config asks for.
TEST(CliSft, EpochsOfNothingAreRefusedAndProfileIgnoresEpochs) {
  const std::string dir = fresh("sft_epochs_empty");
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/empty.jsonl") << "\n  \n";
  Result r = ds("plan examples/sft.json data.path=" + dir + "/empty.jsonl ~train.steps train.epochs=1");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "the training split holds no samples")) << r.err;
  r = ds("profile examples/sft.json ~train.steps train.epochs=3 --steps 1");
  EXPECT_EQ(r.code, 0) << r.err;
}

namespace {

// The "N samples packed into M rows" and the padding share a packed run's log says.
struct PackingNote {
  int64_t samples = -1, rows = -1;
  double padding = -1;
};
PackingNote packing_note(const std::string& log) {
  PackingNote n;
  const auto number = [](std::string s) {
    s.erase(std::remove(s.begin(), s.end(), ','), s.end());
    return std::stoll(s);
  };
  std::smatch m;
  if (std::regex_search(log, m, std::regex("([0-9.]+)% of the training rows' positions are padding \\(([0-9,]+) samples packed into ([0-9,]+) rows\\)"))) {
    n.padding = std::stod(m[1]);
    n.samples = number(m[2]);
    n.rows = number(m[3]);
  } else if (std::regex_search(log, m, std::regex("([0-9.]+)% of the training rows' positions are padding \\(one sample a row\\)"))) {
    n.padding = std::stod(m[1]);
  }
  return n;
}

}  // namespace

// data.packing: the example's conversations packed into rows of 256 positions leave a fraction of the padding
// one conversation a row leaves, still learn, and train.epochs counts the rows they fill.
TEST(CliSft, PackedRowsWasteLessAndEpochsCountTheRows) {
  Result r = ds("plan examples/sft.json data.packing=true");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "samples packed into rows (each attends only to itself)")) << r.out;
  r = ds("plan examples/quickstart.json data.packing=true");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "data.packing")) << r.err;

  const std::string one = fresh("sft_unpacked"), packed = fresh("sft_packed");
  const std::string common = "train examples/sft.json data.seq_len=256 train_micro_batch_size_per_gpu=4 train.eval_every=0 ";
  r = ds(common + "train.steps=1 train.output_dir=" + one);
  ASSERT_EQ(r.code, 0) << r.err;
  const PackingNote unpacked_note = packing_note(r.err);
  r = ds(common + "data.packing=true train.steps=40 train.output_dir=" + packed);
  ASSERT_EQ(r.code, 0) << r.err;
  const PackingNote note = packing_note(r.err);
  ASSERT_GT(note.rows, 0) << r.err;
  EXPECT_EQ(note.samples, 1140);  // chat.jsonl's 1,200 less the 5% held out
  EXPECT_LT(note.rows * 3, note.samples);  // several conversations a row
  EXPECT_LT(note.padding * 4, unpacked_note.padding) << note.padding << " vs " << unpacked_note.padding;
  const auto m = metrics_of(packed);
  ASSERT_EQ(m.size(), 40u);
  EXPECT_LT(m.back()["loss"].get<double>(), 0.5 * m.front()["loss"].get<double>()) << m.front() << m.back();

  r = ds("plan examples/sft.json data.seq_len=256 train_micro_batch_size_per_gpu=4 data.packing=true ~train.steps train.epochs=2 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json p = nlohmann::json::parse(r.out);
  EXPECT_EQ(p["steps"].get<int64_t>(), (2 * note.rows + 3) / 4);
  bool said = false;
  for (const auto& v : p["resolved"])
    if (v["path"] == "train.steps")
      said = v["source"].get<std::string>() == "train.epochs 2 x " + std::to_string(note.rows) + " packed training rows / 4 rows per step";
  EXPECT_TRUE(said) << p["resolved"].dump();
}

// Packed rows resume where they stopped, and two ranks (processes) train and validate what one rank does.
TEST(CliSft, PackedRowsResumeExactlyAndTwoRanksTrainWhatOneRankTrains) {
  const std::string whole = fresh("sft_packed_whole"), split = fresh("sft_packed_split"), two = fresh("sft_packed_two");
  const std::string fp32 = "train examples/sft.json bf16.enabled=false data.packing=true data.seq_len=128 train.eval_every=4 "
                           "train.eval_batches=2 train.save_every=4 train_batch_size=8 ";
  ASSERT_EQ(ds(fp32 + "train_micro_batch_size_per_gpu=8 train.steps=8 train.output_dir=" + whole).code, 0);
  ASSERT_EQ(ds(fp32 + "train_micro_batch_size_per_gpu=8 train.steps=4 train.output_dir=" + split).code, 0);
  Result r = ds(fp32 + "train_micro_batch_size_per_gpu=8 train.steps=8 train.output_dir=" + split + " --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  r = ds(fp32 + "train_micro_batch_size_per_gpu=4 train.steps=8 --nproc-per-node 2 train.output_dir=" + two);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto a = metrics_of(whole), b = metrics_of(split), c = metrics_of(two);
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  ASSERT_EQ(c.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    if (i >= 4) {
      EXPECT_EQ(a[i]["loss"], b[i]["loss"]) << "step " << i + 1;
    }
    EXPECT_NEAR(a[i]["loss"].get<double>(), c[i]["loss"].get<double>(), 1e-5) << "step " << i + 1;
    if (a[i].contains("val_loss")) {
      EXPECT_NEAR(a[i]["val_loss"].get<double>(), c[i]["val_loss"].get<double>(), 1e-5) << "step " << i + 1;
    }
  }
  EXPECT_TRUE(a[3].contains("val_loss") && a[7].contains("val_loss"));
}

// data.tokens_in_memory false: the samples kept as an index of their lines, each batch's read and tokenized again.
// The run trains, validates and resumes exactly as the one whose tokens are in memory, and says how it reads.
TEST(CliSft, AnIndexedDataSetTrainsAndResumesAsTheOneInMemory) {
  const std::string mem = fresh("sft_mem"), idx = fresh("sft_idx"), split = fresh("sft_idx_split");
  const std::string fp32 = "train examples/sft.json bf16.enabled=false data.packing=true data.seq_len=128 train.eval_every=4 "
                           "train.eval_batches=2 train.save_every=4 train_batch_size=8 train_micro_batch_size_per_gpu=4 ";
  ASSERT_EQ(ds(fp32 + "train.steps=8 train.output_dir=" + mem).code, 0);
  Result r = ds(fp32 + "data.tokens_in_memory=false train.steps=8 train.output_dir=" + idx);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "; indexed (data.tokens_in_memory false): each batch's lines are read and tokenized again")) << r.err;
  ASSERT_EQ(ds(fp32 + "data.tokens_in_memory=false train.steps=4 train.output_dir=" + split).code, 0);
  r = ds(fp32 + "data.tokens_in_memory=false train.steps=8 train.output_dir=" + split + " --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto a = metrics_of(mem), b = metrics_of(idx), c = metrics_of(split);
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  ASSERT_EQ(c.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(a[i]["loss"], b[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(a[i]["loss"], c[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(a[i].value("val_loss", -1.0), b[i].value("val_loss", -1.0)) << "step " << i + 1;
  }
  EXPECT_TRUE(a[3].contains("val_loss"));
  // The key acts on jsonl data only.
  r = ds("plan examples/quickstart.json data.tokens_in_memory=false");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_TRUE(contains(r.err, "data.tokens_in_memory")) << r.err;
}

// data.val_path: validation samples from a file of their own. The example's data cut in two (its first 1,140
// conversations to train on, its last 60 to validate) trains and validates exactly as the whole file with
// the default 5% held out; the two ways of naming a validation split are not taken together.
TEST(CliSft, AValidationFileIsTheSplitTheFractionWouldHoldOut) {
  const std::string dir = fresh("sft_valpath");
  std::filesystem::create_directories(dir);
  {
    std::ifstream in(work_dir() + "/examples/data/sft/chat.jsonl");
    std::ofstream train(dir + "/train.jsonl"), val(dir + "/val.jsonl");
    int n = 0;
    for (std::string line; std::getline(in, line); ++n) (n < 1140 ? train : val) << line << "\n";
    ASSERT_EQ(n, 1200);
  }
  const std::string split_data = "data.path=" + dir + "/train.jsonl data.val_path=" + dir + "/val.jsonl ~data.val_fraction ";
  Result r = ds("plan examples/sft.json " + split_data);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "validation samples from " + dir + "/val.jsonl")) << r.out;
  const std::string fp32 = "train examples/sft.json bf16.enabled=false train.steps=6 train.eval_every=3 ";
  ASSERT_EQ(ds(fp32 + "train.output_dir=" + dir + "/whole").code, 0);
  r = ds(fp32 + split_data + "train.output_dir=" + dir + "/split");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "; validation " + dir + "/val.jsonl: 60 samples (60 conversations)")) << r.err;
  const auto a = metrics_of(dir + "/whole"), b = metrics_of(dir + "/split");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(a[i]["loss"], b[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(a[i].contains("val_loss"), i == 2 || i == 5);
    if (a[i].contains("val_loss")) {
      EXPECT_EQ(a[i]["val_loss"], b[i]["val_loss"]) << "step " << i + 1;
    }
  }
  r = ds("plan examples/sft.json data.val_path=" + dir + "/val.jsonl");  // the example's own val_fraction 0.05 too
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "data.val_fraction: data.val_path already holds the validation samples")) << r.err;
  EXPECT_TRUE(contains(r.err, "~data.val_fraction")) << r.err;
  r = ds("train examples/sft.json ~data.val_fraction data.val_path=" + dir + "/missing.jsonl train.output_dir=" + dir + "/none");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "data.val_path")) << r.err;
  r = ds("plan examples/quickstart.json data.val_path=" + dir + "/val.jsonl");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "data.val_path")) << r.err;
  // The run's own config.json plans again as it ran (val_fraction resolved to 0 there).
  r = ds("plan " + dir + "/split/config.json");
  EXPECT_EQ(r.code, 0) << r.err;
  // A validation file that data.path also trains on is refused before a run; a validation directory may hold
  // files named as held-out splits.
  std::filesystem::create_directories(dir + "/both");
  std::filesystem::copy_file(dir + "/train.jsonl", dir + "/both/train.jsonl");
  std::filesystem::copy_file(dir + "/val.jsonl", dir + "/both/dev.jsonl");
  r = ds("train examples/sft.json ~data.val_fraction data.path=" + dir + "/both data.val_path=" + dir + "/both/dev.jsonl train.output_dir=" +
         dir + "/overlap");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(contains(r.err, "data.val_path: '" + dir + "/both/dev.jsonl' is also read as training data")) << r.err;
  std::filesystem::create_directories(dir + "/heldout");
  std::filesystem::copy_file(dir + "/val.jsonl", dir + "/heldout/val.jsonl");
  std::filesystem::copy_file(dir + "/val.jsonl", dir + "/heldout/test.jsonl");
  r = ds("plan examples/sft.json ~data.val_fraction data.path=" + dir + "/train.jsonl data.val_path=" + dir + "/heldout");
  EXPECT_EQ(r.code, 0) << r.err;
}

// metrics.jsonl's trained_tokens: over one epoch of text lines (every target trained), the steps' counts
// add up to the training split's tokens less one per sample (a sample's first token is no target).
TEST(CliSft, EachStepSaysTheTokensItTrained) {
  const std::string dir = fresh("sft_trained_tokens");
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir + "/data.jsonl");
    for (int i = 0; i < 44; ++i) f << "{\"text\": \"Sample " << i << " says " << std::string(static_cast<size_t>(i % 7), 'a') << ".\"}\n";
  }
  // 44 samples, 4 held out: 40 train, an epoch in 5 steps of 8.
  Result r = ds("train examples/sft.json data.path=" + dir + "/data.jsonl data.val_fraction=0.1 train_batch_size=8 "
                "train_micro_batch_size_per_gpu=4 train.steps=5 train.eval_every=0 train.output_dir=" + dir + "/run");
  ASSERT_EQ(r.code, 0) << r.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.err, m, std::regex("; ([0-9,]+) training / [0-9,]+ validation tokens"))) << r.err;
  std::string count = m[1];
  count.erase(std::remove(count.begin(), count.end(), ','), count.end());
  int64_t sum = 0;
  for (const auto& step : metrics_of(dir + "/run")) sum += step["trained_tokens"].get<int64_t>();
  EXPECT_EQ(sum, std::stoll(count) - 40);
  // Data without masks has no such field.
  r = ds("train examples/quickstart.json train.steps=1 train.output_dir=" + dir + "/plain");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(metrics_of(dir + "/plain")[0].contains("trained_tokens"));
}

// The TFLOP/s figures count the head only for the rows that reach it: a row whose target is masked (a prompt's
// token, padding) never does. Each step's model FLOPs per token (metrics.jsonl's tflops over its tokens_per_s)
// is the plan's full figure less the head's 6 V C (4 V C when LoRA freezes the tied head) for each row the step
// did not count.
TEST(CliSft, EachStepsFlopsCountTheHeadOnlyForTheRowsThatReachIt) {
  for (const bool lora : {false, true}) {
    SCOPED_TRACE(lora ? "LoRA" : "full");
    const std::string dir = fresh(lora ? "sft_flops_lora" : "sft_flops");
    Result r = ds("train examples/sft.json train.steps=4 train.eval_every=0 train.output_dir=" + dir +
                  (lora ? " 'model.lora={\"r\": 4, \"alpha\": 8}'" : ""));
    ASSERT_EQ(r.code, 0) << r.err;
    const nlohmann::json plan = nlohmann::json::parse(slurp(dir + "/plan.json"));
    const double tokens = plan["tokens_per_step"].get<double>(), full = plan["train_flops_per_step"].get<double>();
    const double head = (lora ? 4 : 6) * plan["model"]["vocab_size"].get<double>() * plan["model"]["hidden_size"].get<double>();
    for (const nlohmann::json& m : metrics_of(dir)) {
      const double counted = m["trained_tokens"].get<double>();
      ASSERT_LT(counted, 0.9 * tokens) << "the prompts and padding are most of a row here";
      const double per_token = m["tflops"].get<double>() * 1e12 / m["tokens_per_s"].get<double>();
      EXPECT_NEAR(per_token, (full - (tokens - counted) * head) / tokens, 1e-4 * full / tokens) << m.dump();
    }
  }
  // ds profile counts the steps it measured alike: fewer FLOPs than the plan's every row, and each step's MFU
  // is its own FLOPs over its time and the matmul rate after it.
  Result r = ds("profile examples/sft.json --steps 3 --warmup 1 --json train.output_dir=" + fresh("sft_flops_profile"));
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json report = nlohmann::json::parse(r.out);
  const nlohmann::json& summary = report["summary"];
  EXPECT_LT(summary["model_flops_per_step"].get<double>(), 0.99 * summary["plan_flops_per_step"].get<double>()) << summary.dump();
  double flops = 0;
  for (const nlohmann::json& step : report["steps"]) {
    const double own = step["model_flops"].get<double>();
    EXPECT_LT(own, 0.99 * summary["plan_flops_per_step"].get<double>()) << step.dump();
    EXPECT_NEAR(step["mfu"].get<double>() * step["step_s"].get<double>() * step["gemm_flops_per_s"].get<double>(), own, 1e-6 * own) << step.dump();
    flops += own / static_cast<double>(report["steps"].size());
  }
  EXPECT_NEAR(flops, summary["model_flops_per_step"].get<double>(), 1e-6 * flops);
}

// Packed rows run their attention sample by sample: rows of four samples of n positions each (no padding) do a
// quarter of a whole row's attention, and each step's FLOPs per token say so.
TEST(CliSft, PackedRowsCountEachSamplesAttentionInTheStepsFlops) {
  const std::string dir = fresh("sft_packed_flops");
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir + "/same.jsonl");
    for (int i = 0; i < 48; ++i) f << "{\"text\": \"The same line, again and again.\"}\n";
  }
  const std::string base = "train examples/sft.json data.path=" + dir + "/same.jsonl data.val_fraction=0 train.eval_every=0 ";
  Result r = ds(base + "train.steps=1 train.output_dir=" + dir + "/probe");
  ASSERT_EQ(r.code, 0) << r.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.err, m, std::regex("48 samples \\(48 text\\), ([0-9,]+) tokens"))) << r.err;
  std::string count = m[1];
  count.erase(std::remove(count.begin(), count.end(), ','), count.end());
  const int64_t n = std::stoll(count) / 48 - 1;  // each sample's positions
  r = ds(base + "data.packing=true data.seq_len=" + std::to_string(4 * n) + " train_micro_batch_size_per_gpu=2 train.steps=3 train.output_dir=" + dir + "/run");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "48 samples packed into 12 rows")) << r.err;
  const nlohmann::json plan = nlohmann::json::parse(slurp(dir + "/run/plan.json"));
  const nlohmann::json& model = plan["model"];
  const double T = 4.0 * static_cast<double>(n), full = plan["model"]["train_flops_per_token"].get<double>();
  const double attention = 12 * model["num_layers"].get<double>() * T * model["num_heads"].get<double>() * model["head_dim"].get<double>();
  for (const nlohmann::json& step : metrics_of(dir + "/run")) {
    EXPECT_EQ(step["trained_tokens"].get<double>(), 2 * T);  // every target of a text trains: no head row skipped
    const double per_token = step["tflops"].get<double>() * 1e12 / step["tokens_per_s"].get<double>();
    EXPECT_NEAR(per_token, full - attention + attention / 4, 1e-4 * full) << step.dump();
  }
}
