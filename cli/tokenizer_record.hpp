// ds — the tokenizer files a run's exports ship, recorded in its plan.json (and so in every checkpoint) by
// absolute path and checksum when it starts: what its data was tokenised with, and what its model.init_from
// source had beside its weights.
#pragma once

#include <string>
#include <vector>

#include "engine/plan/plan_record.hpp"
#include "schema/config.hpp"

namespace ds::cli {

// Hugging Face's tokenizer files, as a model directory ships them beside its weights.
inline constexpr const char* kHfTokenizerFiles[] = {"tokenizer.json",    "tokenizer_config.json", "special_tokens_map.json",
                                                    "vocab.json",        "merges.txt",            "tokenizer.model",
                                                    "added_tokens.json", "chat_template.jinja",   "chat_template.json"};

// The record (plan_to_json writes it): a GPT-2 BPE run's vocab.json and merges.txt (roles vocab_file,
// merges_file), or an hf tokenizer's files (role tokenizer_path: tokenizer.json and what is beside it),
// then what `init_from` had (role init_from): a Hugging Face directory's tokenizer files, a
// PEFT adapter's base's, a ds run's own record. Reads each file (UserError when one cannot be).
std::vector<TokenizerFileRecord> tokenizer_record(const DataConfig& data, const std::string& init_from);

// A resumed run reads the vocabulary its checkpoint recorded: UserError when data.vocab_file or
// data.merges_file now holds other bytes (a relative path read from another working directory, a file
// changed since). A file that moved with the same bytes is the same vocabulary.
void check_tokenizer_unchanged(const PlanRecord& checkpoint_plan, const std::vector<TokenizerFileRecord>& record);

}  // namespace ds::cli
