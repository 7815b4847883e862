#include "cli/plan.hpp"

#include <iostream>

#include "cli/render_plan.hpp"
#include "common/error.hpp"
#include "engine/runtime/data/chat_data.hpp"
#include "engine/runtime/data/hf_tokenizer.hpp"
#include "engine/runtime/data/token_source.hpp"
#include "schema/loader.hpp"
#include "engine/plan/plan_record.hpp"

namespace ds::cli {

Subcommand setup_plan(CLI::App& app) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* sub = app.add_subcommand("plan", "validate a config and print the execution plan (memory, layout, comm)");
  add_config_args(sub, args->config);
  sub->add_flag("--json", args->json, "print the plan as JSON (stable; see schema_version)");
  sub->add_flag("--resolved-config", args->show_config,
                "print the fully resolved config (defaults filled, legacy keys rewritten) instead of the plan");
  sub->add_flag("--layout", args->layout, "list every parameter's offset and shard in the text output");
  sub->add_option("--show-sample", args->show_sample,
                  "jsonl data: read the data and print sample N (0 = the first line) as the model sees it, rendered and "
                  "tokenized, the tokens the loss counts between [[ and ]]")
      ->check(CLI::NonNegativeNumber);
  sub->footer(R"(Examples:
  ds plan templates/zero2.json
      the plan for ZeRO-2 on one process: batch, precision, memory per rank, communication
  ds plan templates/zero3.json --world-size 8 --device-memory 80GiB
      the same config planned for 8 ranks, with a fit check against 80 GiB devices
  ds plan templates/zero2.json zero_optimization.stage=3 model.preset=llama-2-7b
      overrides: any key.sub=value the schema knows (the value is JSON, else a string)
  ds plan my.json ~scheduler train_micro_batch_size_per_gpu=auto --device-memory 24GiB
      ~key removes a key; "auto" is resolved and shown with its source
  ds plan templates/bf16.json --json | jq .memory.device_per_rank.total
      machine-readable plan; human output may change, --json fields only get added
  ds plan examples/sft.json --show-sample 0
      the first conversation of the data as the chat template renders it, the trained tokens marked

Exit status: 0 valid and planned, 2 config or usage error (every problem is listed), 1 other failure.)");
  return {sub, [args] { return run_plan(*args); }};
}

namespace {

// Sample `index` of the plan's jsonl data: the text the model reads, the spans the loss counts marked.
std::string render_sample(const Plan& plan, int64_t index) {
  const DataConfig& d = plan.data;
  if (d.type != DataType::jsonl)
    throw UserError("--show-sample shows fine-tuning samples: this config's data.type is " + std::string(data_type_name(d.type)),
                    "use it with data.type jsonl");
  const std::unique_ptr<SampleSet> samples = open_samples(d, plan.model.hp.vocab_size, plan.seq_len, plan.topology.ranks_per_node);
  if (index >= samples->size())
    throw UserError("--show-sample " + std::to_string(index) + ": the data holds " + std::to_string(samples->size()) + " samples",
                    "samples are numbered from 0, in file then line order");
  const HfTokenizer tok(d.tokenizer_path);
  std::string out = samples->description + "\nsample " + std::to_string(index) + ": " + std::to_string(samples->length(index)) +
                    " tokens";
  if (samples->length(index) > plan.seq_len + 1)
    out += " (cut at seq_len + 1 = " + std::to_string(plan.seq_len + 1) + " in training)";
  out += "; the loss counts the tokens between [[ and ]]\n";
  std::vector<int32_t> run;
  bool trained = false;
  auto flush = [&] {
    if (!run.empty()) out += trained ? "[[" + tok.decode(run) + "]]" : tok.decode(run);
    run.clear();
  };
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  samples->sample(index, samples->length(index), ids, mask);
  for (size_t k = 0; k < ids.size(); ++k) {
    if (static_cast<bool>(mask[k]) != trained) flush(), trained = mask[k];
    run.push_back(ids[k]);
  }
  flush();
  return out + "\n";
}

}  // namespace

int run_plan(const PlanArgs& a) {
  return run_guarded("plan", [&] {
    ConfigArgs args = with_config_path(a.config);
    if (a.show_config) {
      std::cout << resolved_config(args) << "\n";
      return 0;
    }
    args.model_optional = true;  // a bare DeepSpeed config plans what it can
    default_ranks_to_visible_gpus("plan", args, "");  // the ranks ds train would start here
    Plan plan = build_plan("plan", args);
    if (a.show_sample >= 0) {
      std::cout << render_sample(plan, a.show_sample);
      return 0;
    }
    if (a.json)
      std::cout << plan_to_json(plan) << "\n";
    else
      std::cout << render_plan_text(plan, color_enabled(stdout), a.layout);
    return 0;
  }, a.json);
}

}  // namespace ds::cli
