// ds — the plan as text for people: one line per decision, a memory table in GiB, the flat layout's
// shards, the collectives per step, and every value ds decided with its source.
#pragma once

#include <string>

#include "engine/plan/plan.hpp"

namespace ds::cli {

std::string render_plan_text(const Plan& plan, bool color, bool full_layout);

// "text corpus.txt, tokenizer gpt2 (...); 1024 tokens per sample, 5% held out for validation".
std::string data_text(const DataConfig& data, int64_t seq_len);

}  // namespace ds::cli
