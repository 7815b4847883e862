#include "cli/tokenizer_record.hpp"

#include <filesystem>
#include <set>

#include "common/error.hpp"
#include "common/files.hpp"
#include "common/hash.hpp"
#include "engine/runtime/io/checkpoint.hpp"
#include "engine/runtime/io/weights.hpp"

namespace ds::cli {

// The tokenizer files that go out with this run's exports, recorded in its plan.json (and so in every
// checkpoint) by absolute path and checksum, so an export ships exactly these wherever it is run from, or
// refuses: a GPT-2 BPE run's vocab.json and merges.txt, and what model.init_from's source had (a Hugging
// Face directory's tokenizer files, a PEFT adapter's base's, a ds run's record).
std::vector<TokenizerFileRecord> tokenizer_record(const DataConfig& d, const std::string& init_from) {
  std::vector<TokenizerFileRecord> files;
  std::set<std::string> names;
  const auto add = [&](const std::string& role, const std::string& name, const std::string& path) {
    if (!names.insert(name).second) return;  // the data's own vocabulary first
    const std::string text = read_file_bytes(path);
    files.push_back({role, name, std::filesystem::absolute(path).lexically_normal().string(), checksum64_hex(text),
                     static_cast<int64_t>(text.size())});
  };
  if (d.type == DataType::text && d.tokenizer == "gpt2") {
    add("vocab_file", "vocab.json", d.vocab_file);
    add("merges_file", "merges.txt", d.merges_file);
  }
  if (d.tokenizer == "hf" && !d.tokenizer_path.empty()) {  // the model's own files, which the data was read with
    const std::filesystem::path given(d.tokenizer_path);
    std::error_code ec;
    const std::filesystem::path dir = std::filesystem::is_directory(given, ec) ? given : given.parent_path();
    for (const char* name : kHfTokenizerFiles) {
      const std::filesystem::path f = dir / name;
      if (std::filesystem::is_regular_file(f, ec)) add("tokenizer_path", name, f.string());
    }
  }
  if (init_from.empty()) return files;
  std::unique_ptr<WeightSource> source = open_weights(init_from);
  if (source->kind() == WeightsKind::peft_adapter && !source->base_path.empty()) source = open_weights(source->base_path);
  if (source->kind() == WeightsKind::hf_directory) {
    constexpr uintmax_t kMostBytes = uintmax_t{64} << 20;  // Llama 3's tokenizer.json is 9 MB
    for (const char* name : kHfTokenizerFiles) {
      const std::filesystem::path f = std::filesystem::path(source->path()) / name;
      std::error_code ec;
      if (std::filesystem::is_regular_file(f, ec) && std::filesystem::file_size(f, ec) <= kMostBytes) add("init_from", name, f.string());
    }
  } else if (source->kind() == WeightsKind::ds_checkpoint) {  // a run fine-tuned again: what it recorded
    const PlanRecord plan = read_checkpoint_plan(source->path());
    for (const TokenizerFileRecord& f : plan.tokenizer_files.value_or(std::vector<TokenizerFileRecord>{})) {
      std::error_code ec;
      if (!f.path.empty() && std::filesystem::is_regular_file(f.path, ec)) add("init_from", f.name, f.path);
    }
  }
  return files;
}

// A resumed run reads the tokenizer files its checkpoint recorded: a relative path resolved from another
// working directory, or a file changed since, would train on another vocabulary.
void check_tokenizer_unchanged(const PlanRecord& old, const std::vector<TokenizerFileRecord>& now) {
  for (const TokenizerFileRecord& was : old.tokenizer_files.value_or(std::vector<TokenizerFileRecord>{})) {
    if (was.role != "vocab_file" && was.role != "merges_file" && was.role != "tokenizer_path") continue;  // what the data is read with
    for (const TokenizerFileRecord& is : now)
      if (is.role == was.role && is.name == was.name && is.checksum64 != was.checksum64)  // moved is fine; changed is not
        throw UserError("data." + was.role + " is '" + is.path + "' (checksum " + is.checksum64 + "), but the checkpoint's run read '" +
                            was.path + "' (checksum " + was.checksum64 + "): resuming would continue on another vocabulary",
                        "give data." + was.role + "=" + was.path + " (relative paths are read from the working directory)");
  }
}

}  // namespace ds::cli
