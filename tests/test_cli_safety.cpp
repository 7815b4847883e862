// Nothing lost, nothing mixed: each way found from outside to destroy, mix or misread a run, replayed
// against the real binary (the issue "Nothing lost, nothing mixed"). Each test failed before its fix.
#include <gtest/gtest.h>

#include <hdf5.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_helpers.hpp"

using namespace cli_test;
namespace fs = std::filesystem;

namespace {

size_t count_files(const std::string& dir) {
  size_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) n += e.is_regular_file();
  return n;
}

// Rewrites an int64 attribute of an HDF5 file in place, as a flipped bit on disk would.
void set_attr(const std::string& file, const char* name, int64_t value) {
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0) << file;
  hid_t a = H5Aopen(f, name, H5P_DEFAULT);
  ASSERT_GE(a, 0) << name;
  ASSERT_GE(H5Awrite(a, H5T_NATIVE_INT64, &value), 0);
  H5Aclose(a);
  H5Fclose(f);
}

// Swaps rows i and j of a checkpoint file's /segments table in place.
void swap_segment_rows(const std::string& file, size_t i, size_t j) {
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  hid_t d = H5Dopen2(f, "segments", H5P_DEFAULT);
  hid_t space = H5Dget_space(d);
  hsize_t dims[2] = {0, 0};
  H5Sget_simple_extent_dims(space, dims, nullptr);
  H5Sclose(space);
  std::vector<int64_t> rows(dims[0] * 3);
  ASSERT_GT(dims[0], std::max(i, j));
  H5Dread(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows.data());
  for (int k = 0; k < 3; ++k) std::swap(rows[3 * i + k], rows[3 * j + k]);
  H5Dwrite(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows.data());
  H5Dclose(d);
  H5Fclose(f);
}

}  // namespace

// 1. --overwrite never clears a directory a source lies in.
TEST(CliSafety, OverwriteRefusesWhenWhatItWouldClearHoldsTheSource) {
  const std::string a = fresh("src_inside");
  ASSERT_EQ(train_into(a, 10).code, 0);
  const size_t files = count_files(a);
  Result r = ds("convert-ckpt " + a + " " + a + " --world-size 2 --overwrite");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "is or holds what this conversion reads")) << r.err;
  EXPECT_EQ(count_files(a), files) << "the source run was touched";
  r = ds(kQuickstartFp32 + "train.steps=5 train.output_dir=" + a + " model.init_from=" + a + " --overwrite");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "--overwrite would delete the run in")) << r.err;
  EXPECT_EQ(count_files(a), files);
  EXPECT_EQ(metrics_of(a).size(), 10u);
}

// 2. Resuming a checkpoint from another directory into one that holds a run is refused.
TEST(CliSafety, ResumingAnotherRunIntoADirectoryHoldingARunIsRefused) {
  const std::string a = fresh("resume_a"), b = fresh("resume_b"), c = fresh("resume_c");
  ASSERT_EQ(train_into(a, 10).code, 0);
  ASSERT_EQ(train_into(b, 20).code, 0);
  Result r = ds(kQuickstartFp32 + "train.steps=30 train.output_dir=" + b + " train.resume=" + a);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "holds a run")) << r.err;
  EXPECT_EQ(metrics_of(b).size(), 20u) << "b's metrics were appended to";
  EXPECT_TRUE(fs::exists(b + "/checkpoints/step_00000020"));
  // Into a new directory it continues a's run.
  r = ds(kQuickstartFp32 + "train.steps=12 train.output_dir=" + c + " train.resume=" + a);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "resuming from")) << r.err;
}

// 3. --overwrite removes what ds wrote, names it, and keeps the rest.
TEST(CliSafety, OverwriteDeletesOnlyWhatDsWroteAndNamesIt) {
  const std::string a = fresh("overwrite_own");
  ASSERT_EQ(train_into(a, 20).code, 0);
  std::ofstream(a + "/checkpoints/my_model.pt") << "user's";
  fs::create_directories(a + "/checkpoints/exported");
  std::ofstream(a + "/checkpoints/exported/w.bin") << "user's";
  std::ofstream(a + "/notes.txt") << "user's";
  const Result r = ds(kQuickstartFp32 + "train.steps=3 train.output_dir=" + a + " --overwrite");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* kept : {"/checkpoints/my_model.pt", "/checkpoints/exported/w.bin", "/notes.txt"})
    EXPECT_TRUE(fs::exists(a + kept)) << kept << " was deleted";
  EXPECT_TRUE(contains(r.err, "checkpoints/step_00000010")) << r.err;
  EXPECT_TRUE(contains(r.err, "checkpoints/step_00000020")) << r.err;
  EXPECT_TRUE(contains(r.err, "metrics.jsonl")) << r.err;
  EXPECT_TRUE(contains(r.err, "kept what ds did not write: checkpoints/exported, checkpoints/my_model.pt, notes.txt")) << r.err;
  EXPECT_FALSE(fs::exists(a + "/checkpoints/step_00000020"));
  EXPECT_EQ(metrics_of(a).size(), 3u);
  // A metrics.jsonl ds did not write does not make a folder a run, and is never replaced.
  const std::string u = fresh("not_ours");
  fs::create_directories(u);
  std::ofstream(u + "/metrics.jsonl") << "{\"accuracy\": 0.9}\n";
  const Result r2 = ds(kQuickstartFp32 + "train.steps=2 train.output_dir=" + u + " --overwrite");
  EXPECT_EQ(r2.code, 2) << r2.err;
  EXPECT_TRUE(contains(r2.err, "metrics.jsonl' was not written by ds")) << r2.err;
  EXPECT_EQ(slurp(u + "/metrics.jsonl"), "{\"accuracy\": 0.9}\n");
}

// 4. A re-export replaces the previous one whole; a directory holding two exports is not read.
TEST(CliSafety, ReExportingReplacesThePreviousExportWhole) {
  const std::string a = fresh("reexport"), hf = a + "_hf";
  fs::remove_all(hf);
  ASSERT_EQ(train_into(a, 10).code, 0);
  Result r = ds("convert-ckpt " + a + " " + hf + " --max-shard-size 100KB");
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_TRUE(fs::exists(hf + "/model.safetensors.index.json"));
  r = ds("convert-ckpt " + a + " " + hf + " --overwrite");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "model.safetensors.index.json (the previous export's)")) << r.err;
  for (const auto& e : fs::directory_iterator(hf)) {
    const std::string n = e.path().filename().string();
    EXPECT_TRUE(n.rfind("model-", 0) != 0 && n != "model.safetensors.index.json") << n << " left from the previous export";
  }
  // Two exports mixed by hand: refused, not silently read through the index.
  std::ofstream(hf + "/model.safetensors.index.json") << R"({"weight_map": {"transformer.wte.weight": "model.safetensors"}})";
  r = ds("convert-ckpt --info " + hf);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "holds both model.safetensors and model.safetensors.index.json")) << r.err;
}

// 5. A shard from another save is refused.
TEST(CliSafety, AShardFromAnotherStepIsRefused) {
  const std::string a = fresh("shards"), w10 = a + "_w10", w20 = a + "_w20";
  ASSERT_EQ(train_into(a, 20).code, 0);
  for (const auto& [dst, tag] : {std::pair{w10, "step_00000010"}, {w20, "step_00000020"}}) {
    fs::remove_all(dst);
    const Result r = ds("convert-ckpt " + a + " " + dst + " -t " + tag + " --world-size 2 --stage 2");
    ASSERT_EQ(r.code, 0) << r.err;
  }
  Result r = ds("convert-ckpt " + w20 + " " + a + "_ok.safetensors");
  ASSERT_EQ(r.code, 0) << r.err;
  fs::copy_file(w10 + "/checkpoints/step_00000010/shard_00001.h5", w20 + "/checkpoints/step_00000020/shard_00001.h5",
                fs::copy_options::overwrite_existing);
  r = ds("convert-ckpt " + w20 + " " + a + "_mixed.safetensors");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "shard_00001.h5' belongs to another checkpoint (step 10)")) << r.err;
  EXPECT_FALSE(fs::exists(a + "_mixed.safetensors"));
}

// 6. The metadata is checksummed and its counters checked: flipped attributes, swapped segment rows, a
// lost checksum attribute, a directory renamed to another step.
TEST(CliSafety, CorruptMetadataIsRefusedNotResumed) {
  const std::string a = fresh("meta");
  ASSERT_EQ(train_into(a, 20).code, 0);
  const std::string ckpt = a + "/checkpoints/step_00000020", state = ckpt + "/state.h5", keep = a + "_state.h5";
  fs::copy_file(state, keep);
  auto resume_refused = [&](const std::string& what, const std::string& expected) {
    const Result r = ds(kQuickstartFp32 + "train.steps=25 train.output_dir=" + a + " --resume");
    EXPECT_EQ(r.code, 2) << what << ":\n" << r.err;
    EXPECT_TRUE(contains(r.err, expected)) << what << ":\n" << r.err;
    fs::copy_file(keep, state, fs::copy_options::overwrite_existing);
  };
  set_attr(state, "step", -9223372036854771855LL);
  resume_refused("a negative step", "do not match their checksum");
  set_attr(state, "applied_steps", 25);
  resume_refused("applied > step", "do not match their checksum");
  // Two segment rows swapped (a stage-0 checkpoint has one row; a 2-rank stage-2 shard has one per tensor).
  const std::string w = a + "_w2";
  fs::remove_all(w);
  ASSERT_EQ(ds("convert-ckpt " + a + " " + w + " --world-size 2 --stage 2").code, 0);
  const std::string shard = w + "/checkpoints/step_00000020/shard_00001.h5";
  swap_segment_rows(shard, 0, 1);
  Result r = ds("convert-ckpt " + w + " " + w + ".safetensors");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "do not match their checksum")) << r.err;
  // The checksum attribute of a data set lost (its name's bytes flipped): refused, not "written before checksums".
  {
    hid_t f = H5Fopen(state.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t d = H5Dopen2(f, "master", H5P_DEFAULT);
    H5Adelete(d, "checksum");
    H5Dclose(d);
    H5Fclose(f);
  }
  resume_refused("a lost checksum", "has lost its checksum");
  // A checkpoint directory renamed to another step.
  fs::rename(ckpt, a + "/checkpoints/step_00000030");
  std::ofstream(a + "/checkpoints/latest") << "step_00000030";
  r = ds(kQuickstartFp32 + "train.steps=35 train.output_dir=" + a + " --resume");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "holds step 20 but its directory is named for step 30")) << r.err;
}

// 7. One run per directory: a second is refused naming the first; a dead holder's lock is taken over.
TEST(CliSafety, ASecondRunIntoTheSameDirectoryIsRefusedNamingTheFirst) {
  const std::string a = fresh("locked");
  const pid_t first = ::fork();
  if (first == 0) {
    ::execl("/bin/sh", "sh", "-c", ("cd " + work_dir() + " && exec " DS_BINARY " " + kQuickstartFp32 + "train.steps=100000 train.output_dir=" + a +
                                    " >/dev/null 2>&1 </dev/null").c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  for (int i = 0; i < 15000 && line_count(a + "/metrics.jsonl") < 1; ++i) ::usleep(20000);
  Result r = ds(kQuickstartFp32 + "train.steps=5 train.output_dir=" + a + " --resume");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "is in use by another ds run (host ")) << r.err;
  EXPECT_TRUE(contains(r.err, "pid " + std::to_string(first))) << r.err;
  r = ds(kQuickstartFp32 + "train.steps=5 train.output_dir=" + a + " --overwrite");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(fs::exists(a + "/metrics.jsonl"));
  ::kill(first, SIGKILL);
  int status = 0;
  ::waitpid(first, &status, 0);
  const int64_t lines = line_count(a + "/metrics.jsonl");
  r = ds(kQuickstartFp32 + "train.steps=" + std::to_string(lines + 2) + " train.output_dir=" + a + " --resume");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "took over the lock")) << r.err;
  EXPECT_TRUE(contains(r.err, "pid " + std::to_string(first))) << r.err;
}

// 8. A folder that is not a run is not written into; nothing is written through a symbolic link.
TEST(CliSafety, AFolderThatIsNotARunAndLinksAreRefused) {
  const std::string a = fresh("hf_target"), hf = a + "_hf";
  fs::remove_all(hf);
  ASSERT_EQ(train_into(a, 10).code, 0);
  ASSERT_EQ(ds("convert-ckpt " + a + " " + hf).code, 0);
  const std::string config = slurp(hf + "/config.json");
  Result r = ds(kQuickstartFp32 + "train.steps=2 train.output_dir=" + hf);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "config.json' was not written by ds")) << r.err;
  EXPECT_EQ(slurp(hf + "/config.json"), config);
  r = ds(kQuickstartFp32 + "train.steps=2 train.output_dir=" + hf + " --resume");  // nothing to resume: a fresh run, refused alike
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(slurp(hf + "/config.json"), config);
  const std::string l = fresh("links"), outside = scratch_dir() + "/outside.txt";
  fs::create_directories(l);
  std::ofstream(outside) << "precious\n";
  fs::create_symlink(outside, l + "/train.log");
  r = ds(kQuickstartFp32 + "train.steps=2 train.output_dir=" + l);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "train.log' is a symbolic link")) << r.err;
  EXPECT_EQ(slurp(outside), "precious\n");
}

// 10. A metrics.jsonl cut mid-line (disk full, a kill) is repaired on resume: every line stays JSON.
TEST(CliSafety, APartialLastMetricsLineIsDroppedOnResume) {
  const std::string a = fresh("partial_line");
  ASSERT_EQ(train_into(a, 10).code, 0);
  std::ofstream(a + "/metrics.jsonl", std::ios::app) << "{\"step\": 11, \"loss\": 2.3";
  const Result r = ds(kQuickstartFp32 + "train.steps=13 train.output_dir=" + a + " --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "ended in a partial line")) << r.err;
  const auto lines = metrics_of(a);  // throws on a line that is not JSON
  ASSERT_EQ(lines.size(), 13u);
  EXPECT_EQ(lines.back()["step"], 13);
}

// 11-12. Deep JSON, a FIFO and a file that shrinks are errors naming the file, never a crash or a hang.
TEST(CliSafety, DeepJsonAndAFifoAreRefusedNotCrashedOnOrWaitedFor) {
  const std::string a = fresh("deep"), hf = a + "_hf";
  fs::remove_all(hf);
  ASSERT_EQ(train_into(a, 10).code, 0);
  ASSERT_EQ(ds("convert-ckpt " + a + " " + hf + " --max-shard-size 100KB").code, 0);
  std::ofstream(hf + "/model.safetensors.index.json") << "{\"weight_map\": " << std::string(200000, '[') << std::string(200000, ']') << "}";
  Result r = ds("convert-ckpt --info " + hf);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "nests JSON deeper than 64 levels")) << r.err;
  r = ds(kQuickstartFp32 + "train.steps=2 train.output_dir=" + a + "_t model.init_from=" + hf);
  EXPECT_EQ(r.code, 2) << r.err;
  const std::string deep_cfg = fresh("deep_cfg");
  fs::create_directories(deep_cfg);
  std::ofstream(deep_cfg + "/config.json") << "{\"model_type\": \"gpt2\", \"x\": " << std::string(200000, '[') << std::string(200000, ']') << "}";
  r = ds("plan examples/quickstart.json ~model.preset model.hf_config=" + deep_cfg + "/config.json");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "nests JSON deeper than")) << r.err;
  // A FIFO under the weights' name: refused at once (the open never waits for a writer).
  const std::string fifo = fresh("fifo");
  fs::create_directories(fifo);
  ASSERT_EQ(::mkfifo((fifo + "/model.safetensors").c_str(), 0644), 0);
  std::ofstream(fifo + "/config.json") << slurp(hf + "/config.json");
  r = ds("convert-ckpt --info " + fifo, "timeout -s KILL 60");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "is not a regular file")) << r.err;
}

// 13. uint32 token ids past 2^31 are found before work, not taken for negative ids.
TEST(CliSafety, TokenIdsBeyondTwoToThe31AreRefusedBeforeWork) {
  const std::string file = scratch_dir() + "/big_ids.bin";
  std::vector<uint32_t> ids(4096, 7);
  ids[1000] = 3000000000u;
  std::ofstream(file, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 4));
  const Result r = ds(kQuickstartFp32 + "train.steps=2 train.output_dir=" + fresh("big_ids") + " data.type=tokens data.token_format=uint32 data.path=" + file);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "token id 3000000000")) << r.err;
}

// 14. fp16 exports refuse values beyond fp16's range (naming the tensor), or count them when allowed.
TEST(CliSafety, Fp16ExportRefusesValuesBeyondItsRange) {
  const std::string a = fresh("fp16range"), hf = a + "_hf", imported = a + "_imp";
  fs::remove_all(hf);
  fs::remove_all(imported);
  ASSERT_EQ(train_into(a, 10).code, 0);
  ASSERT_EQ(ds("convert-ckpt " + a + " " + hf).code, 0);
  // One weight set to 1e6 in the exported file's first tensor.
  {
    std::fstream f(hf + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    uint64_t header = 0;
    f.read(reinterpret_cast<char*>(&header), 8);
    std::string text(header, '\0');
    f.read(text.data(), static_cast<std::streamsize>(header));
    const nlohmann::json h = nlohmann::json::parse(text);
    std::string first;
    uint64_t at = UINT64_MAX;
    for (const auto& [name, t] : h.items())
      if (name != "__metadata__" && t["data_offsets"][0].get<uint64_t>() < at) at = t["data_offsets"][0].get<uint64_t>(), first = name;
    const float big = 1e6f;
    f.seekp(static_cast<std::streamoff>(8 + header + at));
    f.write(reinterpret_cast<const char*>(&big), 4);
  }
  ASSERT_EQ(ds("convert-ckpt " + hf + " " + imported).code, 0);
  Result r = ds("convert-ckpt " + imported + " " + a + "_16.safetensors --dtype fp16");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "holds 1e+06 (element 0), beyond fp16's range")) << r.err;
  EXPECT_FALSE(fs::exists(a + "_16.safetensors"));
  r = ds("convert-ckpt " + imported + " " + a + "_16.safetensors --dtype fp16 --allow-fp16-overflow");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "1 values beyond fp16's range were written as +-inf")) << r.err;
}

// 16. Resuming with the same parameter count in other shapes is an error naming the tensor.
TEST(CliSafety, ResumingWithOtherShapesOfTheSameSizeIsRefused) {
  const std::string a = fresh("shapes");
  ASSERT_EQ(train_into(a, 10).code, 0);
  const Result r = ds(kQuickstartFp32 + "train.steps=12 train.output_dir=" + a + " --resume model.vocab_size=255 model.max_position_embeddings=129");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "holds transformer.wte.weight [256, 64] where this model has transformer.wte.weight [255, 64]")) << r.err;
  EXPECT_EQ(metrics_of(a).size(), 10u);
}

// 17. Values that used to end in raw exception text with exit 1.
TEST(CliSafety, BadValuesInFilesAndOverridesExitTwoNamingTheKey) {
  Result r = ds("plan examples/quickstart.json optimizer.params.lr=1e999");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "lr")) << r.err;
  {
    nlohmann::json c = nlohmann::json::parse(slurp(std::string(DS_SOURCE_DIR) + "/examples/quickstart.json"), nullptr, true, true);
    std::string text = c.dump();
    text.replace(text.find("\"lr\":") + 5, text.find(',', text.find("\"lr\":")) - text.find("\"lr\":") - 5, "1e999");
    std::ofstream(scratch_dir() + "/huge_lr.json") << text;
  }
  r = ds("plan " + scratch_dir() + "/huge_lr.json");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "1e999")) << r.err;
  const std::string d = fresh("bad_hf");
  fs::create_directories(d);
  std::ofstream(d + "/config.json") << R"({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "tie_word_embeddings": "yes"})";
  r = ds("plan examples/quickstart.json ~model.preset model.hf_config=" + d + "/config.json");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "tie_word_embeddings is \"yes\", not true or false")) << r.err;
  std::ofstream(d + "/config.json") << "[1, 2]";
  r = ds("plan examples/quickstart.json ~model.preset model.hf_config=" + d + "/config.json");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "is a JSON array, not an object")) << r.err;
  std::ofstream(d + "/config.json") << R"({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                          "intermediate_size": 128, "vocab_size": 256, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})";
  r = ds("plan examples/quickstart.json ~model.preset model.hf_config=" + d + "/config.json");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "rope_scaling")) << r.err;
  const std::string a = fresh("shard_size");
  ASSERT_EQ(train_into(a, 10).code, 0);
  r = ds("convert-ckpt " + a + " " + a + "_hf --max-shard-size 99999999999999999999GB");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "more than 1 EiB")) << r.err;
}

// 15. A diverging run ends with exit 1 and keeps its best checkpoint; a run that skips every step fails.
TEST(CliSafety, ADivergingRunFailsAndPruningKeepsTheBestCheckpoint) {
  const std::string a = fresh("diverge");
  // bf16 at lr 10: the loss runs away within a few steps of the warmup.
  Result r = ds("train examples/quickstart.json optimizer.params.lr=10 train.steps=60 train.save_every=5 train.keep_last=2 train.eval_every=0 "
                "train.output_dir=" + a);
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "the run diverged: the loss has been above 4x its best")) << r.err;
  EXPECT_TRUE(contains(r.err, "The checkpoint saved at the lowest loss is kept: " + a + "/checkpoints/step_00000005")) << r.err;
  EXPECT_TRUE(fs::exists(a + "/checkpoints/step_00000005/DONE"));
  // Told to train on regardless: keep_last=2 prunes the old ones but never the best (step 5).
  const std::string b = fresh("diverge_on");
  r = ds("train examples/quickstart.json optimizer.params.lr=10 train.steps=30 train.save_every=5 train.keep_last=2 train.eval_every=0 "
         "train.divergence_factor=0 train.output_dir=" + b);
  ASSERT_EQ(r.code, 0) << r.err;
  std::vector<std::string> kept;
  for (const auto& e : fs::directory_iterator(b + "/checkpoints"))
    if (e.is_directory()) kept.push_back(e.path().filename().string());
  std::sort(kept.begin(), kept.end());
  EXPECT_EQ(kept, (std::vector<std::string>{"step_00000005", "step_00000025", "step_00000030"}));
  // fp16 with a static scale that overflows every step: exit 1 after a short streak, naming the scale.
  r = ds("train examples/quickstart.json bf16.enabled=false fp16.enabled=true fp16.loss_scale=1e30 train.steps=60 train.eval_every=0 "
         "train.output_dir=" + fresh("static_scale"));
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "the static fp16.loss_scale 1e+30 overflows")) << r.err;
}
