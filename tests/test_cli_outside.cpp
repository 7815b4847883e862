// What a DeepSpeed / Hugging Face user and an attacker hit from outside (the issue "Found from outside"),
// replayed against the real binary: signals while starting, locks that outlive a killed launcher, user files
// inside checkpoints, links, conversions that would write over their own source, what an export carries.
// Each test failed before its fix.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_helpers.hpp"

using namespace cli_test;
namespace fs = std::filesystem;

namespace {

// Every step number metrics.jsonl records, in order.
std::vector<int64_t> steps_of(const std::string& dir) {
  std::vector<int64_t> out;
  for (const auto& j : metrics_of(dir)) out.push_back(j["step"].get<int64_t>());
  return out;
}

bool strictly_increasing(const std::vector<int64_t>& v) {
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] <= v[i - 1]) return false;
  return true;
}

// The pids of `parent`'s children (from /proc).
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  std::ifstream in("/proc/" + std::to_string(parent) + "/task/" + std::to_string(parent) + "/children");
  for (pid_t p; in >> p;) out.push_back(p);
  return out;
}

// Running, not a zombie no one has reaped yet (a killed launcher's ranks are reparented).
bool alive(pid_t pid) {
  // Any of its threads: a process whose main thread has exited shows as a zombie while its other threads (OpenMP's,
  // Gloo's) are still tearing down, and they still hold its files (a run directory's lock among them).
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream in(task.path() / "stat");
    std::string line;
    if (!std::getline(in, line)) continue;
    const size_t paren = line.rfind(')');
    if (paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] != 'Z' && line[paren + 2] != 'X') return true;
  }
  return false;
}

// Starts `ds ARGS` in the background (its output in OUT.out/OUT.err), returning its pid.
pid_t ds_background(const std::string& args, const std::string& out) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c",
            ("cd " + work_dir() + " && exec env -u RANK -u WORLD_SIZE -u DS_RUN_LOCK " DS_BINARY " " + args + " >" + out + ".out 2>" + out +
             ".err </dev/null")
                .c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

void wait_for_lines(const std::string& file, int64_t lines) {
  for (int i = 0; i < 15000 && line_count(file) < lines; ++i) ::usleep(20000);
}

}  // namespace

// 1. A run stopped by SIGTERM while it starts exits 143 saying so, and leaves a directory the next run
// (fresh, --resume or --overwrite) takes; an empty metrics.jsonl and a lock a dead run left are ds's own.
TEST(CliOutside, ASigtermWhileStartingSaysSoAndLeavesADirectoryTheNextRunTakes) {
  const std::string a = fresh("sigterm_start");
  // GPT-2 124M: drawing its weights takes long enough that the signal lands while it starts.
  // The start line is the first (a warning before it would take the signal meant for the start).
  const std::string big = kQuickstartFp32 + "model.preset=gpt2 data.seq_len=32 train_micro_batch_size_per_gpu=1 train.steps=3 "
                                 "scheduler.params.warmup_num_steps=1 train.output_dir=" + a;
  Result r = ds_signalled(big, SIGTERM, scratch_dir() + "/err", 1, 0.0);
  ASSERT_EQ(r.code, 143) << r.err;
  EXPECT_TRUE(contains(r.err, "ds train: starting on the CPU: drawing the initial weights of 124,439,808 parameters")) << r.err;
  EXPECT_TRUE(contains(r.err, "stopped by SIGTERM while")) << r.err;
  EXPECT_TRUE(contains(r.err, "before the first step: nothing was trained or saved")) << r.err;
  EXPECT_FALSE(fs::exists(a + "/checkpoints"));
  // What the issue found left behind by such a stop: an empty metrics.jsonl and a lock naming a dead run.
  std::ofstream(a + "/metrics.jsonl").flush();
  std::ofstream(a + "/.ds.lock") << "host elsewhere, pid 999999, started 2026-11-01T00:00:00\n";
  for (const char* how : {"", " --resume", " --overwrite"}) {
    r = ds(kQuickstartFp32 + "train.steps=2 train.output_dir=" + a + how);
    EXPECT_EQ(r.code, 0) << how << ": " << r.err;
    r = ds(kQuickstartFp32 + "train.steps=2 train.output_dir=" + a + " --overwrite");  // back to a run that can start again
    ASSERT_EQ(r.code, 0) << r.err;
    std::ofstream(a + "/metrics.jsonl", std::ios::trunc).flush();
    fs::remove_all(a + "/checkpoints");
  }
}

// 1b. A restart of a run that never saved, and a resume after a kill, leave one line per step in metrics.jsonl,
// each loss written so that it reads back as the same double.
TEST(CliOutside, MetricsHoldEachStepOnceAndLossesRoundTrip) {
  const std::string a = fresh("metrics_once");
  ASSERT_EQ(train_into(a, 15).code, 0);  // checkpoints at 10 and 15
  fs::remove_all(a + "/checkpoints/step_00000015");  // as if killed at step 15 before that save
  std::ofstream(a + "/checkpoints/latest", std::ios::trunc) << "step_00000010";
  Result r = ds(kQuickstartFp32 + "train.steps=15 train.output_dir=" + a + " --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "dropped steps 11-15, recorded after the checkpoint of step 10")) << r.err;
  std::vector<int64_t> steps = steps_of(a);
  ASSERT_EQ(steps.size(), 15u);
  EXPECT_TRUE(strictly_increasing(steps));
  // A run that never saved, started again with --resume: its old lines go, named.
  const std::string b = fresh("metrics_unsaved");
  ASSERT_EQ(train_into(b, 6, "train.save_every=100 train.steps=6").code, 0);
  fs::remove_all(b + "/checkpoints");
  r = ds(kQuickstartFp32 + "train.save_every=100 train.steps=3 train.output_dir=" + b + " --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "dropped steps 1-6, recorded by an earlier start that saved no checkpoint")) << r.err;
  EXPECT_EQ(steps_of(b), (std::vector<int64_t>{1, 2, 3}));
  // Round-trippable: the text of each loss is the shortest that reads back the same, never cut to 7 digits.
  std::ifstream in(a + "/metrics.jsonl");
  std::string line;
  std::getline(in, line);
  const std::string loss = line.substr(line.find("\"loss\": ") + 8, line.find(',', line.find("\"loss\": ")) - line.find("\"loss\": ") - 8);
  EXPECT_GT(loss.size(), 9u) << line;  // an fp32 run's loss in double needs more than 7 significant digits
}

// 2b. Resuming a checkpoint of a run that lies further inside the output directory checks the directory.
TEST(CliOutside, ACheckpointOfAnotherRunInsideTheOutputDirectoryDoesNotSkipItsChecks) {
  const std::string par = fresh("parent");
  ASSERT_EQ(train_into(par + "/runA", 10).code, 0);
  std::ofstream(par + "/config.json") << "{\"mine\": true}\n";
  const Result r = ds(kQuickstartFp32 + "train.steps=12 train.output_dir=" + par + " train.resume=" + par + "/runA/checkpoints/step_00000010");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "config.json' was not written by ds")) << r.err;
  EXPECT_EQ(slurp(par + "/config.json"), "{\"mine\": true}\n");
}

// 2b. The launcher never writes a rank's log through a link.
TEST(CliOutside, RankLogsAreNeverWrittenThroughALink) {
  const std::string a = fresh("log_link"), outside = scratch_dir() + "/outside_precious.txt";
  fs::create_directories(a + "/logs");
  std::ofstream(outside) << "precious\n";
  fs::create_symlink(outside, a + "/logs/rank_1.log");
  const Result r = ds(kQuickstartFp32 + "train.steps=2 train.output_dir=" + a + " --nproc-per-node 2");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "logs/rank_1.log' is a symbolic link")) << r.err;
  EXPECT_EQ(slurp(outside), "precious\n");
}

// 2b. A user's files inside a checkpoint directory survive pruning and --overwrite, and are named.
TEST(CliOutside, UserFilesInsideCheckpointsSurvivePruningAndOverwrite) {
  const std::string a = fresh("user_files");
  ASSERT_EQ(train_into(a, 10).code, 0);
  std::ofstream(a + "/checkpoints/step_00000010/notes.txt") << "lr sweep 3\n";
  Result r = ds(kQuickstartFp32 + "train.steps=30 train.keep_last=1 train.output_dir=" + a + " --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "kept what ds did not write there: " + a + "/checkpoints/step_00000010/notes.txt")) << r.err;
  EXPECT_EQ(slurp(a + "/checkpoints/step_00000010/notes.txt"), "lr sweep 3\n");
  EXPECT_FALSE(fs::exists(a + "/checkpoints/step_00000010/state.h5"));
  std::ofstream(a + "/checkpoints/step_00000030/eval_results.json") << "{}\n";
  // A user's own link to a checkpoint, and an empty marker file, are theirs: a resume goes on beside them.
  fs::create_directory_symlink("step_00000030", a + "/checkpoints/best");
  std::ofstream(a + "/STARTED").flush();
  r = ds(kQuickstartFp32 + "train.steps=31 train.output_dir=" + a + " --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  r = ds(kQuickstartFp32 + "train.steps=2 train.output_dir=" + a + " --overwrite");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "kept what ds did not write: STARTED, checkpoints/best, checkpoints/step_00000010/notes.txt, "
                              "checkpoints/step_00000030/eval_results.json"))
      << r.err;
  EXPECT_EQ(slurp(a + "/checkpoints/step_00000030/eval_results.json"), "{}\n");
  EXPECT_FALSE(fs::exists(a + "/checkpoints/step_00000030/state.h5"));
  EXPECT_TRUE(fs::exists(a + "/STARTED"));
  EXPECT_TRUE(fs::is_symlink(a + "/checkpoints/best"));
}

// 2b. The lock lives as long as any process of the run: a launcher killed with -9 leaves its ranks holding
// it (a resume started at once is refused until they have saved and gone); a .ds.lock removed by hand or a
// DS_RUN_LOCK set by hand lets no second run in.
TEST(CliOutside, TheLockOutlivesAKilledLauncherAndIsNotEasilyLost) {
  std::string a = fresh("lock_life");
  const std::string out = scratch_dir() + "/outside_launcher";
  const pid_t launcher = ds_background(kQuickstartFp32 + "train.steps=100000 train.save_every=1000 train.output_dir=" + a + " --nproc-per-node 2", out);
  wait_for_lines(a + "/metrics.jsonl", 2);
  std::vector<pid_t> ranks = children_of(launcher);
  ASSERT_EQ(ranks.size(), 2u);
  for (pid_t p : ranks) ::kill(p, SIGSTOP);  // the ranks hold still while the launcher dies
  ::kill(launcher, SIGKILL);
  int status = 0;
  ::waitpid(launcher, &status, 0);
  Result r = ds(kQuickstartFp32 + "train.steps=100000 train.output_dir=" + a + " --resume");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "is in use by another ds run")) << r.err;
  EXPECT_TRUE(contains(r.err, "its ranks are finishing")) << r.err;
  for (pid_t p : ranks) ::kill(p, SIGCONT);  // their launcher's death (SIGTERM) now stops them after a save
  for (int i = 0; i < 3000 && (alive(ranks[0]) || alive(ranks[1])); ++i) ::usleep(20000);
  ASSERT_FALSE(alive(ranks[0]) || alive(ranks[1])) << "ranks of a dead launcher still run";
  const std::vector<int64_t> before = steps_of(a);
  r = ds(kQuickstartFp32 + "train.steps=" + std::to_string(before.back() + 2) + " train.output_dir=" + a + " --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(strictly_increasing(steps_of(a)));
  EXPECT_EQ(steps_of(a).back(), before.back() + 2);

  // A live single run: its .ds.lock removed by hand, then a DS_RUN_LOCK set by hand.
  const std::string b = fresh("lock_life_2");
  const pid_t run = ds_background(kQuickstartFp32 + "train.steps=100000 train.save_every=1000 train.output_dir=" + b, out);
  wait_for_lines(b + "/metrics.jsonl", 2);
  a = b;
  fs::remove(a + "/.ds.lock");
  r = ds(kQuickstartFp32 + "train.steps=2 train.output_dir=" + a + " --overwrite");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "is in use by another ds run")) << r.err;
  for (const std::string& fake : {a + "/.ds.lock", "0123456789abcdef01234567:" + a + "/.ds.lock"}) {  // no token, a wrong one
    r = ds(kQuickstartFp32 + "train.steps=2 train.output_dir=" + a + " --overwrite", "DS_RUN_LOCK=" + fake);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_TRUE(contains(r.err, "is in use by another ds run")) << r.err;
  }
  EXPECT_GE(line_count(a + "/metrics.jsonl"), 2);
  ::kill(run, SIGTERM);
  ::waitpid(run, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 143) << slurp(out + ".err");
}

// 2b. A resume reads the vocabulary its run read: a relative data.vocab_file resolved from another working
// directory to another file is refused, naming both.
TEST(CliOutside, AResumeFromAnotherDirectoryDoesNotSwitchTheVocabulary) {
  const std::string dir = fresh("vocab_where");
  const std::string shared = DS_SHARED_DIR "/data/gpt2";
  for (const char* where : {"/a/tok", "/b/tok"}) {
    fs::create_directories(dir + where);
    fs::copy_file(shared + "/vocab.json", dir + where + "/vocab.json");
    fs::copy_file(shared + "/merges.txt", dir + where + "/merges.txt");
  }
  std::ofstream(dir + "/b/tok/merges.txt", std::ios::app) << "Ġqu estion\n";  // another vocabulary
  {
    std::ofstream text(dir + "/corpus.txt");
    for (int i = 0; i < 200; ++i) text << "Now is the winter of our discontent " << i << ".\n";
  }
  const std::string args = std::string(DS_BINARY) + " train " + work_dir() + "/examples/quickstart.json bf16.enabled=false model.vocab_size=50257 "
                           "data.type=text data.tokenizer=gpt2 data.path=" + dir + "/corpus.txt data.vocab_file=tok/vocab.json "
                           "data.merges_file=tok/merges.txt data.seq_len=32 train.eval_every=0 train.save_every=2 train.output_dir=" + dir + "/run ";
  auto in = [&](const std::string& where, const std::string& more) {
    return std::system(("cd " + dir + where + " && env -u RANK -u WORLD_SIZE -u DS_RUN_LOCK " + args + more + " >" + dir + "/out 2>" + dir +
                        "/err </dev/null").c_str());
  };
  ASSERT_EQ(in("/a", "train.steps=2"), 0) << slurp(dir + "/err");
  EXPECT_NE(in("/b", "train.steps=4 --resume"), 0);
  EXPECT_TRUE(contains(slurp(dir + "/err"), "but the checkpoint's run read '" + dir + "/a/tok/merges.txt'")) << slurp(dir + "/err");
  EXPECT_EQ(line_count(dir + "/run/metrics.jsonl"), 2);
  ASSERT_EQ(in("/a", "train.steps=4 --resume"), 0) << slurp(dir + "/err");
}

// 2b, 10, 3. PEFT adapters: options ds does not train are refused by name, nonsense values too; PEFT's own
// spellings are ds's; ds's export records its base's checksum and a base that is not it is refused; the base
// path is absolute, so the adapter works from any directory.
TEST(CliOutside, PeftAdaptersAreReadStrictlyAndRecordTheirBase) {
  const std::string dir = fresh("peft");
  fs::create_directories(dir);
  ASSERT_EQ(ds(kQuickstartFp32 + "train.steps=5 train.output_dir=" + dir + "/base").code, 0);
  ASSERT_EQ(ds("convert-ckpt " + dir + "/base " + dir + "/base-hf").code, 0);
  ASSERT_EQ(ds(kQuickstartFp32 + "train.steps=6 train.seed=7 train.output_dir=" + dir + "/other").code, 0);
  ASSERT_EQ(ds("convert-ckpt " + dir + "/other " + dir + "/other-hf").code, 0);
  // PEFT's names for model.lora's keys.
  const std::string lora = "train examples/lora.json bf16.enabled=false train.eval_every=0 ~model.lora.alpha ~model.lora.dropout "
                           "model.lora.lora_alpha=16 model.lora.lora_dropout=0 ";
  Result r = ds(lora + "model.init_from=" + dir + "/base-hf train.steps=4 train.output_dir=" + dir + "/run");
  ASSERT_EQ(r.code, 0) << r.err;
  r = ds("convert-ckpt " + dir + "/run " + dir + "/adapter --adapter");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json base = nlohmann::json::parse(slurp(dir + "/adapter/ds_base.json"));
  EXPECT_EQ(base["path"], dir + "/base-hf");
  EXPECT_EQ(base["checksum"].get<std::string>().size(), 16u);
  const nlohmann::json cfg = nlohmann::json::parse(slurp(dir + "/adapter/adapter_config.json"));
  EXPECT_EQ(cfg["base_model_name_or_path"], dir + "/base-hf");
  // Continued from the adapter: fine on its base; another base is refused.
  const std::string cont = "train examples/lora.json bf16.enabled=false train.eval_every=0 model.lora.dropout=0 train.steps=2 ";
  r = ds(cont + "model.init_from=" + dir + "/adapter train.output_dir=" + dir + "/cont");
  EXPECT_EQ(r.code, 0) << r.err;
  nlohmann::json moved = cfg;
  moved["base_model_name_or_path"] = dir + "/other-hf";
  fs::copy(dir + "/adapter", dir + "/adapter-moved");
  std::ofstream(dir + "/adapter-moved/adapter_config.json", std::ios::trunc) << moved.dump(2);
  r = ds(cont + "model.init_from=" + dir + "/adapter-moved train.output_dir=" + dir + "/wrong");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "was trained on another base")) << r.err;
  EXPECT_FALSE(fs::exists(dir + "/wrong/checkpoints"));
  // Options that change what the adapter computes, and values that are not a LoRA's.
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"use_dora", "true"},         {"alpha_pattern", "{\"c_attn\": 32}"}, {"rank_pattern", "{\"c_fc\": 4}"},
      {"modules_to_save", "[\"lm_head\"]"}, {"layers_to_transform", "[0]"},    {"r", "8.5"},
      {"lora_dropout", "1.5"},      {"lora_dropout", "-1"},                  {"lora_alpha", "0"}};
  for (const auto& [key, value] : bad) {
    nlohmann::json c = cfg;
    c[key] = nlohmann::json::parse(value);
    fs::remove_all(dir + "/bad");
    fs::copy(dir + "/adapter", dir + "/bad");
    std::ofstream(dir + "/bad/adapter_config.json", std::ios::trunc) << c.dump(2);
    r = ds(cont + "model.init_from=" + dir + "/bad train.output_dir=" + dir + "/bad-run");
    EXPECT_EQ(r.code, 2) << key << "=" << value << ": " << r.err;
    EXPECT_TRUE(contains(r.err, key)) << key << "=" << value << ": " << r.err;
  }
  // 100,000 target modules: refused in a message of a few lines, not 800 KB.
  nlohmann::json many = cfg;
  many["target_modules"] = nlohmann::json::array();
  for (int i = 0; i < 100000; ++i) many["target_modules"].push_back("m" + std::to_string(i));
  std::ofstream(dir + "/bad/adapter_config.json", std::ios::trunc) << many.dump();
  r = ds(cont + "model.init_from=" + dir + "/bad train.output_dir=" + dir + "/bad-run");
  EXPECT_EQ(r.code, 2) << r.err.substr(0, 2000);
  EXPECT_LT(r.err.size(), 4096u);
  // An adapter holding NaN (saved from a run that diverged) is named as such, not "lower the learning rate".
  fs::remove_all(dir + "/nan");
  fs::copy(dir + "/adapter", dir + "/nan");
  {
    std::fstream st(dir + "/nan/adapter_model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    uint64_t header = 0;
    st.read(reinterpret_cast<char*>(&header), 8);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    st.seekp(static_cast<std::streamoff>(8 + header));
    st.write(reinterpret_cast<const char*>(&nan), 4);
  }
  r = ds(cont + "model.init_from=" + dir + "/nan train.output_dir=" + dir + "/nan-run");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "holds inf or NaN in")) << r.err;
}

// 2, 12, 2b. convert-ckpt: a merge into the run's own base, or an export over the run it reads, is refused
// (--overwrite or not); so is a pickle destination; a moved base names --base; a fine-tune of a Hugging Face
// directory exports the source's special tokens and tokenizer files again.
TEST(CliOutside, ConversionsNeverWriteOverWhatTheyReadAndCarryWhatTheSourceHad) {
  const std::string dir = fresh("convert");
  fs::create_directories(dir);
  ASSERT_EQ(ds(kQuickstartFp32 + "train.steps=5 train.output_dir=" + dir + "/base").code, 0);
  ASSERT_EQ(ds("convert-ckpt " + dir + "/base " + dir + "/base-hf").code, 0);
  // The source as released carries special tokens and a tokenizer.
  nlohmann::json hf = nlohmann::json::parse(slurp(dir + "/base-hf/config.json"));
  hf["bos_token_id"] = 1;
  hf["eos_token_id"] = 2;
  std::ofstream(dir + "/base-hf/config.json", std::ios::trunc) << hf.dump(2);
  std::ofstream(dir + "/base-hf/tokenizer.json") << "{\"model\": {\"type\": \"BPE\"}}\n";
  std::ofstream(dir + "/base-hf/tokenizer_config.json") << "{\"bos_token\": \"<s>\"}\n";
  const std::string base_files = slurp(dir + "/base-hf/model.safetensors");
  const std::string lora = "train examples/lora.json bf16.enabled=false train.eval_every=0 model.lora.dropout=0 train.steps=3 ";
  Result r = ds(lora + "model.init_from=" + dir + "/base-hf train.output_dir=" + dir + "/lora");
  ASSERT_EQ(r.code, 0) << r.err;
  r = ds("convert-ckpt " + dir + "/lora " + dir + "/base-hf --merge --overwrite");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "what this conversion reads")) << r.err;
  EXPECT_EQ(slurp(dir + "/base-hf/model.safetensors"), base_files);
  r = ds("convert-ckpt " + dir + "/lora " + dir + "/lora --merge --overwrite");
  EXPECT_EQ(r.code, 2) << r.err;
  r = ds("convert-ckpt " + dir + "/base " + dir + "/base --overwrite");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(fs::exists(dir + "/base/checkpoints/step_00000005/state.h5"));
  r = ds("convert-ckpt " + dir + "/base " + dir + "/pytorch_model.bin");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "ds writes safetensors, never pickles")) << r.err;
  EXPECT_FALSE(fs::exists(dir + "/pytorch_model.bin"));
  // Merged: the source's special tokens and tokenizer files go out again.
  r = ds("convert-ckpt " + dir + "/lora " + dir + "/merged --merge");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* file : {"config.json", "generation_config.json"}) {
    const nlohmann::json c = nlohmann::json::parse(slurp(dir + "/merged/" + file));
    EXPECT_EQ(c["bos_token_id"], 1) << file;
    EXPECT_EQ(c["eos_token_id"], 2) << file;
  }
  EXPECT_EQ(slurp(dir + "/merged/tokenizer.json"), slurp(dir + "/base-hf/tokenizer.json"));
  EXPECT_EQ(slurp(dir + "/merged/tokenizer_config.json"), slurp(dir + "/base-hf/tokenizer_config.json"));
  // A full fine-tune of the directory, exported: the same.
  r = ds(kQuickstartFp32 + "train.steps=2 model.init_from=" + dir + "/base-hf train.output_dir=" + dir + "/full");
  ASSERT_EQ(r.code, 0) << r.err;
  r = ds("convert-ckpt " + dir + "/full " + dir + "/full-hf");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(slurp(dir + "/full-hf/config.json"))["bos_token_id"], 1);
  EXPECT_EQ(slurp(dir + "/full-hf/tokenizer.json"), slurp(dir + "/base-hf/tokenizer.json"));
  // The base moved: --merge names --base.
  fs::rename(dir + "/base-hf", dir + "/base-moved");
  r = ds("convert-ckpt " + dir + "/lora " + dir + "/merged2 --merge");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "--base")) << r.err;
  r = ds("convert-ckpt " + dir + "/lora " + dir + "/merged2 --merge --base " + dir + "/base-moved");
  EXPECT_EQ(r.code, 0) << r.err;
}

// 2b. Resharding keeps the global batch a resume keeps; sizes beyond sense and mixed flags are refused at once.
TEST(CliOutside, ReshardingKeepsTheGlobalBatchAndRefusesWhatMakesNoSense) {
  const std::string a = fresh("reshard");
  ASSERT_EQ(train_into(a, 10, "--nproc-per-node 2 zero_optimization.stage=2").code, 0);  // global batch 32 (16 x 1 x 2)
  Result r = ds("convert-ckpt " + a + " " + a + "-w4 --world-size 4 --stage 3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "kept on 4 ranks with micro batch 8")) << r.err;
  r = ds("convert-ckpt --info " + a + "-w4 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json info = nlohmann::json::parse(r.out);
  EXPECT_EQ(info["world_size"], 4);
  EXPECT_EQ(info["zero_stage"], 3);
  r = ds("convert-ckpt " + a + " " + a + "-w3 --world-size 3 --stage 3");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "cannot keep the run's global batch of 32")) << r.err;
  r = ds("convert-ckpt " + a + " " + a + "-huge --world-size 200000 --stage 3");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_FALSE(fs::exists(a + "-huge/checkpoints"));
  r = ds("convert-ckpt " + a + " " + a + "-hf --world-size 4 --to hf");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "--to hf exports")) << r.err;
  // Importing a Hugging Face directory writes a run: a .safetensors name or a --dtype is refused, not ignored.
  ASSERT_EQ(ds("convert-ckpt " + a + " " + a + "-export").code, 0);
  r = ds("convert-ckpt " + a + "-export " + a + "-x.safetensors --dtype fp16");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_FALSE(fs::exists(a + "-x.safetensors"));
  // The resumed 4-rank run keeps the batch of 32.
  r = ds(kQuickstartFp32 + "train.steps=11 train.output_dir=" + a + "-w4 zero_optimization.stage=3 train_micro_batch_size_per_gpu=8 --nproc-per-node 4 --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(contains(r.err, "global batch would change")) << r.err;
  EXPECT_EQ(nlohmann::json::parse(slurp(a + "-w4/plan.json"))["batch"]["train_batch_size"], 32);
}

// A pipeline's mistakes, each said once and before any rank starts (found by a new user's trial).
TEST(CliOutside, APipelinesMistakesAreSaidOnceAndBeforeAnyRankStarts) {
  // A world the mesh does not divide: one problem (the batch is not judged on a mesh that cannot be), with the
  // sizes that would work.
  // sizes that would work (3 ranks take 3 stages, but the example's model has 2 blocks; 6 ranks with pipeline 2 take
  // tensor 1 or 3, and 3 does not split its 4 heads).
  for (const auto& [ranks, sizes] : {std::pair<std::string, std::string>{"1", "set pipeline.stages to one of: 1\n"},
                                     {"3", "set pipeline.stages to one of: 1\n"},
                                     {"6 tensor_parallel.autotp_size=4", "set tensor_parallel.autotp_size (with pipeline 2) to one of: 1\n"}}) {
    Result r = ds("plan examples/pipeline-parallel.json --nproc-per-node " + ranks);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_TRUE(contains(r.err, ": 1 problem") && contains(r.err, sizes)) << r.err;
    EXPECT_FALSE(contains(r.err, "train_batch_size")) << r.err;
  }
  // Timing blocks recomputed in groups is not done yet: ds plan says so, ds train and ds profile refuse it before
  // starting any rank.
  const std::string dir = fresh("pipeline_profiled");
  const std::string grouped = " pipeline.activation_checkpoint_interval=2 model.num_layers=4";
  Result r = ds("plan examples/pipeline-parallel.json --nproc-per-node 4 flops_profiler.enabled=true" + grouped);
  EXPECT_TRUE(contains(r.out, "NOT YET") && contains(r.out, "flops_profiler with pipeline.activation_checkpoint_interval 2")) << r.out << r.err;
  r = ds("train examples/pipeline-parallel.json --nproc-per-node 4 flops_profiler.enabled=true train.output_dir=" + dir + grouped);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "flops_profiler with pipeline.activation_checkpoint_interval 2")) << r.err;
  EXPECT_FALSE(contains(r.err, "starting 4")) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir)) << dir;
  r = ds("profile examples/pipeline-parallel.json --nproc-per-node 4 --steps 1" + grouped);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "ds profile and the flops_profiler with pipeline.activation_checkpoint_interval 2")) << r.err;
  EXPECT_FALSE(contains(r.err, "starting 4")) << r.err;
  // ds train's flops_profiler reports rank 0 alone, one stage of a pipeline: refused, naming ds profile (which runs it).
  r = ds("train examples/pipeline-parallel.json --nproc-per-node 4 flops_profiler.enabled=true train.output_dir=" + dir);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "the flops_profiler block with pipeline stages") && contains(r.err, "run ds profile, which gathers every stage's"))
      << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir)) << dir;
  // DeepSpeed's pipe_partitioned defaults to true; ds sends activations whole: setting true is what has no effect.
  r = ds("plan examples/pipeline-parallel.json --nproc-per-node 4 pipeline.pipe_partitioned=true");
  EXPECT_TRUE(contains(r.err, "pipeline.pipe_partitioned: ignored")) << r.err;
  r = ds("plan examples/pipeline-parallel.json --nproc-per-node 4 pipeline.pipe_partitioned=false");
  EXPECT_FALSE(contains(r.err, "pipe_partitioned")) << r.err;
}

// 2b. A flipped bit in a checkpoint's plan is named as corruption, not reported as a JSON error.
TEST(CliOutside, AFlippedBitInTheStoredPlanIsCorruptionNotAJsonError) {
  const std::string a = fresh("bitflip");
  ASSERT_EQ(train_into(a, 10).code, 0);
  const std::string state = a + "/checkpoints/step_00000010/state.h5";
  std::string bytes = slurp(state);
  const size_t at = bytes.find("\"schema_version\"");
  ASSERT_NE(at, std::string::npos);
  bytes[at] = '{';  // the plan's JSON broken by one byte
  std::ofstream(state, std::ios::binary | std::ios::trunc) << bytes;
  const Result r = ds("convert-ckpt " + a + " " + a + "-hf");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "do not match their checksum: the file is corrupt")) << r.err;
}

// 14. ds profile stopped by SIGTERM exits 143, as the README says.
TEST(CliOutside, ProfileStoppedBySigtermExits143) {
  const Result r = ds_signalled("profile examples/quickstart.json --steps 100000", SIGTERM, scratch_dir() + "/err", 2, 0.5);
  EXPECT_EQ(r.code, 143) << r.err;
}

// 2b. A token file truncated under a running run: the run saves the steps it completed and stops naming the
// file (exit 1), never SIGBUS; the resume from that checkpoint continues once the file is back.
TEST(CliOutside, ATokenFileTruncatedMidRunStopsTheRunWithItsStepsSaved) {
  const std::string dir = fresh("truncated");
  fs::create_directories(dir);
  {
    std::ofstream tokens(dir + "/tokens.bin", std::ios::binary);
    for (uint32_t i = 0; i < 400000; ++i) {
      const uint16_t t = static_cast<uint16_t>((i * 7919u) % 256u);
      tokens.write(reinterpret_cast<const char*>(&t), 2);
    }
  }
  fs::copy_file(dir + "/tokens.bin", dir + "/tokens.keep");
  const std::string args = kQuickstartFp32 + "data.type=tokens data.path=" + dir + "/tokens.bin train.save_every=100000 train.steps=100000 "
                                  "train.output_dir=" + dir + "/run";
  const pid_t pid = ds_background(args, dir + "/log");
  wait_for_lines(dir + "/run/metrics.jsonl", 3);
  fs::resize_file(dir + "/tokens.bin", 64);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const std::string err = slurp(dir + "/log.err");
  ASSERT_TRUE(WIFEXITED(status)) << "died of a signal: " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0) << "\n" << err;
  EXPECT_EQ(WEXITSTATUS(status), 1) << err;
  EXPECT_TRUE(contains(err, "tokens.bin' could not be read at byte")) << err;
  EXPECT_TRUE(contains(err, "it shrank from 800000 to 64 bytes")) << err;
  const std::vector<int64_t> steps = steps_of(dir + "/run");
  ASSERT_FALSE(steps.empty());
  EXPECT_TRUE(fs::exists(dir + "/run/checkpoints/step_" + std::string(8 - std::to_string(steps.back()).size(), '0') +
                         std::to_string(steps.back()) + "/DONE"))
      << err;
  fs::copy_file(dir + "/tokens.keep", dir + "/tokens.bin", fs::copy_options::overwrite_existing);
  const Result r = ds(kQuickstartFp32 + "data.type=tokens data.path=" + dir + "/tokens.bin train.steps=" + std::to_string(steps.back() + 1) +
                      " train.output_dir=" + dir + "/run --resume");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(steps_of(dir + "/run").back(), steps.back() + 1);
}

// 3, 4, 14. Errors name what the user gave: a model.init_from that does not exist, a source whose config.json
// ds cannot train (not model.hf_config), a PEFT adapter whose base is a Hub id, a LoRA run given as weights.
TEST(CliOutside, InitFromErrorsNameWhatTheUserGave) {
  const std::string dir = fresh("init_from");
  fs::create_directories(dir);
  Result r = ds("plan examples/quickstart.json ~model.preset model.init_from=" + dir + "/does-not-exist");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "model.init_from: '" + dir + "/does-not-exist' does not exist")) << r.err;
  EXPECT_FALSE(contains(r.err, "no architecture given")) << r.err;
  ASSERT_EQ(ds(kQuickstartFp32 + "train.steps=2 train.output_dir=" + dir + "/run").code, 0);
  ASSERT_EQ(ds("convert-ckpt " + dir + "/run " + dir + "/hf").code, 0);
  nlohmann::json c = nlohmann::json::parse(slurp(dir + "/hf/config.json"));
  c["scale_attn_weights"] = false;  // a GPT-2 option that changes the function, which ds does not train
  std::ofstream(dir + "/hf/config.json", std::ios::trunc) << c.dump(2);
  r = ds("plan examples/quickstart.json ~model.preset model.init_from=" + dir + "/hf");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "model.init_from: ")) << r.err;
  EXPECT_FALSE(contains(r.err, "model.hf_config")) << r.err;
  r = ds("convert-ckpt " + dir + "/hf " + dir + "/imported");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_FALSE(contains(r.err, "model.hf_config")) << r.err;
  // A PEFT adapter naming its base by a Hub id.
  ASSERT_EQ(ds("train examples/lora.json bf16.enabled=false train.eval_every=0 train.steps=2 ~model.init_from train.output_dir=" + dir + "/lora").code, 0);
  ASSERT_EQ(ds("convert-ckpt " + dir + "/lora " + dir + "/adapter --adapter").code, 0);
  nlohmann::json a = nlohmann::json::parse(slurp(dir + "/adapter/adapter_config.json"));
  a["base_model_name_or_path"] = "openai-community/gpt2";
  std::ofstream(dir + "/adapter/adapter_config.json", std::ios::trunc) << a.dump(2);
  r = ds("plan examples/lora.json ~model.preset model.init_from=" + dir + "/adapter");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "huggingface-cli download openai-community/gpt2 --local-dir DIR")) << r.err;
  // A LoRA run given as the weights to start from.
  r = ds(kQuickstartFp32 + "train.steps=2 model.init_from=" + dir + "/lora train.output_dir=" + dir + "/from-lora");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "is a run that trained a LoRA adapter")) << r.err;
  EXPECT_TRUE(contains(r.err, "--merge")) << r.err;
}

// 7. "auto" as Hugging Face's Trainer writes it: what only a Python trainer can fill is refused naming the key
// and what to write (ds plan warns); every other "auto" ds train resolves is said at the start.
TEST(CliOutside, TrainerOnlyAutosAreRefusedAndTheRestAreSaid) {
  const std::string dir = fresh("autos");
  Result r = ds(kQuickstartFp32 + "optimizer.params.lr=auto optimizer.params.weight_decay=auto scheduler.params.warmup_num_steps=auto "
                       "bf16.enabled=auto train.output_dir=" + dir);
  EXPECT_EQ(r.code, 2) << r.err;
  for (const char* key : {"optimizer.params.lr: is \"auto\"", "optimizer.params.weight_decay: is \"auto\"",
                          "scheduler.params.warmup_num_steps: is \"auto\"", "bf16.enabled: is \"auto\""})
    EXPECT_TRUE(contains(r.err, key)) << key << "\n" << r.err;
  EXPECT_TRUE(contains(r.err, "the Trainer's default is 5e-5")) << r.err;
  EXPECT_FALSE(fs::exists(dir + "/metrics.jsonl"));
  r = ds("plan examples/quickstart.json optimizer.params.lr=auto");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "warning: optimizer.params.lr: is \"auto\"")) << r.err;
  r = ds(kQuickstartFp32 + "train.steps=1 zero_optimization.reduce_bucket_size=auto train.output_dir=" + dir);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "ds train: \"auto\" chose zero_optimization.reduce_bucket_size=4096 (auto: hidden_size^2")) << r.err;
}

// 2b, 13, 14. Small things users hit: a FIFO as the config or the data, sizes past sense, flags after the
// command, the DeepSpeed activation_checkpointing block, an unknown key with nothing near, profile's own steps.
TEST(CliOutside, SmallThingsUsersHit) {
  const std::string dir = fresh("small");
  fs::create_directories(dir);
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0600), 0);
  Result r = ds("plan " + dir + "/fifo");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "is a FIFO that nothing wrote to within 10 s")) << r.err;
  r = ds(kQuickstartFp32 + "train.steps=1 data.type=tokens data.path=" + dir + "/fifo train.output_dir=" + dir + "/run");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "is not a regular file")) << r.err;
  r = ds("plan examples/quickstart.json --nproc-per-node 65536 --nnodes 65536");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "is 4294967296 ranks; ds plans for at most 1048576")) << r.err;
  r = ds("estimate-memory --model 7b --gpus 8 --headroom nan");
  EXPECT_EQ(r.code, 2) << r.err;
  r = ds("plan examples/quickstart.json --color=never");
  EXPECT_EQ(r.code, 0) << r.err;
  r = ds("plan examples/quickstart.json activation_checkpointing.partition_activations=true");
  EXPECT_TRUE(contains(r.err, "ds recomputes whole blocks when model.activation_checkpointing is true")) << r.err;
  r = ds("plan examples/quickstart.json activation_checkpointing.partition_grad=true");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "activation_checkpointing takes contiguous_memory_optimization, cpu_checkpointing")) << r.err;
  r = ds("plan examples/quickstart.json 'model.freeze=[\"transformer.h.0.*\"]'");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "model.freeze: freezes weights drawn from the seed")) << r.err;
  r = ds("profile examples/quickstart.json --steps 1");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(contains(r.err, "shorter than warmup_num_steps")) << r.err;
}

// 5, 6, 9. One fit rule for ds plan, estimate-memory and ds train; what ds cannot run yet on a GPU is said
// where the choice is made; planning for another machine's GPUs does not judge by this machine's RAM.
TEST(CliOutside, PlanAndEstimateJudgeFitAlikeAndSayWhatCannotRunYet) {
  Result r = ds("plan templates/zero3.json model.preset=llama-2-7b --device-memory 80GiB zero_optimization.offload_optimizer.device=cpu");
  ASSERT_EQ(r.code, 0) << r.err;
  // One GPU offloads (its checks have run on a GPU: not warned as new); a build whose LibTorch has no CUDA refuses the
  // GPU itself.
  EXPECT_FALSE(contains(r.err, "offload from")) << r.err;
  EXPECT_FALSE(contains(r.out, "refuses offload")) << r.out;
  EXPECT_TRUE(contains(r.out, "-> fits (72.00 GiB of 80.00 GiB usable at headroom 0.1)")) << r.out;
  EXPECT_TRUE(contains(r.out, "host memory unknown: pass --host-memory")) << r.out;
  r = ds("plan templates/zero3.json model.preset=llama-2-7b --device-memory 80GiB zero_optimization.offload_optimizer.device=cpu "
         "--host-memory 80GiB --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["fit"]["device"], "fits");
  EXPECT_EQ(j["fit"]["host"], "does_not_fit");  // 87.92 GiB of states and gradients on the host
  // Page-locked: the buffers the gradients leaving the GPU arrive in (a piece's; whole blocks', gradient_lag + 1 of
  // them) and the two staging tiles of bf16 weights (bf16).
  double pinned = 0, expected = 0;
  for (const auto& b : j["zero_execution"]["buffers"]) {
    if (b["pinned"].get<bool>()) pinned += b["bytes"].get<double>();
    if (b["role"] == "grads_arrival") expected += 2.0 * b["elements"].get<double>();
    if (b["role"] == "block_arrivals") expected += 2.0 * b["elements"].get<double>() * b["copies"].get<double>();  // (overlap_comm)
    if (b["role"] == "weights_staging") expected += 2.0 * 2.0 * b["elements"].get<double>();
  }
  EXPECT_DOUBLE_EQ(pinned, expected);
  EXPECT_EQ(j["zero_execution"]["gradient_lag"], 1);  // (two block_arrivals buffers: no speculation to choose it with)
  r = ds("plan templates/zero3.json model.preset=llama-2-7b --device-memory 80GiB zero_optimization.offload_optimizer.device=cpu");
  const size_t at = r.out.find("page-locked per rank: ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string shown = r.out.substr(at + 22, r.out.find('\n', at) - at - 22);  // "314.00 MiB of the host's ..."
  const bool gib = shown.find(" GiB") != std::string::npos;
  ASSERT_TRUE(gib || shown.find(" MiB") != std::string::npos) << shown;
  EXPECT_NEAR(std::stod(shown), pinned / (gib ? 1 << 30 : 1 << 20), 0.005) << shown;
  const bool cuda_build = j["device"]["build"]["torch_cuda"] == true;
  EXPECT_EQ(j["not_yet_runnable"].size(), cuda_build ? 0u : 1u) << j["not_yet_runnable"].dump();
  EXPECT_EQ(j["device"]["refuses"], j["not_yet_runnable"]);
  // estimate-memory: the same plan's row, judged the same; the recommendation says it cannot run yet.
  r = ds("estimate-memory --model 8b --gpus 1 --gpu-memory 80GiB --json");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const auto& row : nlohmann::json::parse(r.out)["rows"]) EXPECT_TRUE(row["runs_today"].get<bool>()) << row.dump();
  r = ds("estimate-memory --model 8b --gpus 8 --gpu-memory 80GiB --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json e = nlohmann::json::parse(r.out);
  // Offloaded rows are judged as the others (several GPU ranks offload, warned as new): the same reasons, if any.
  for (const auto& row : e["rows"]) EXPECT_EQ(row["not_yet"], e["rows"][0]["not_yet"]) << row.dump();
  // 9. Optimizer offload on a GPU at stage 3: the gradient partition lives on the host, as in DeepSpeed.
  for (const auto& row : e["rows"]) {
    if (row["zero_stage"] == 3 && row["offload_optimizer"] != "none") {
      EXPECT_EQ(row["per_gpu"]["grads"], 0) << row.dump();
    }
  }
}

// 11. train.epochs counts the steps from the training split's size (read when the plan is made); data.path
// may be a directory of shards, read in name order as one stream.
TEST(CliOutside, EpochsCountStepsFromTheDataAndADirectoryHoldsShards) {
  const std::string dir = fresh("epochs");
  fs::create_directories(dir + "/shards");
  for (const char* name : {"b.bin", "a.bin"}) {
    std::ofstream tokens(dir + "/shards/" + name, std::ios::binary);
    for (uint32_t i = 0; i < 50000; ++i) {
      const uint16_t t = static_cast<uint16_t>((i * 31u + name[0]) % 256u);
      tokens.write(reinterpret_cast<const char*>(&t), 2);
    }
  }
  std::ofstream(dir + "/shards/.hidden") << "not data";
  const std::string data = "data.type=tokens data.path=" + dir + "/shards ";
  Result r = ds("plan examples/quickstart.json " + data + "~train.steps train.epochs=2 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json p = nlohmann::json::parse(r.out);
  const int64_t tokens = 100000, train_tokens = tokens - static_cast<int64_t>(tokens * 0.05);
  const int64_t per_step = p["tokens_per_step"].get<int64_t>();
  EXPECT_EQ(p["steps"].get<int64_t>(), (2 * train_tokens + per_step - 1) / per_step);
  bool said = false;
  for (const auto& v : p["resolved"])
    if (v["path"] == "train.steps") said = v["source"].get<std::string>().find("train.epochs 2 x 95,000 training tokens") == 0;
  EXPECT_TRUE(said) << p["resolved"].dump();
  EXPECT_EQ(p["scheduler"]["total_num_steps"], p["steps"]);  // the schedule follows the steps the epochs gave
  r = ds("plan examples/quickstart.json " + data + "train.epochs=2");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "both train.steps and train.epochs are given")) << r.err;
  r = ds(kQuickstartFp32 + data + "train.steps=2 train.output_dir=" + dir + "/run");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, dir + "/shards (2 files): 100,000 uint16 tokens")) << r.err;
  fs::create_directories(dir + "/empty");
  r = ds(kQuickstartFp32 + "data.type=tokens data.path=" + dir + "/empty train.steps=2 train.output_dir=" + dir + "/run2");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "is a directory with no data files in it")) << r.err;
}
