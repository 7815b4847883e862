#include "cli/train.hpp"

#include <unistd.h>

#include <cstdlib>
#include <iostream>

#include "common/format.hpp"
#include "engine/runtime/data/token_source.hpp"
#include "engine/runtime/trainer.hpp"
#include "schema/loader.hpp"
#include "schema/plan_json.hpp"

namespace ds::cli {

Subcommand setup_train(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  CLI::App* sub = app.add_subcommand("train", "train a model as the config and its plan say");
  add_config_args(sub, args->config);
  sub->footer(R"(Examples:
  ds train examples/quickstart.json
      a tiny GPT-2 on an embedded synthetic language: the loss falls towards its known floor in a minute
  ds train examples/quickstart.json train.steps=1000 optimizer.params.lr=1e-3
      overrides, exactly as for `ds plan`
  ds train my.json data.type=text data.path=corpus.txt data.tokenizer=bytes

The run directory (train.output_dir) receives config.json (the resolved config), plan.json and
metrics.jsonl (one JSON object per step). Progress goes to stderr: a live line on a terminal, plain
lines every steps_per_print steps (default 10) otherwise. Ctrl-C stops after the current step (exit 130).
This build trains gpt2-architecture models on one process in fp32 or bf16 with Adam/AdamW; anything
else is refused before work starts, with the reason (exit 2).)");
  return {sub, [args] { return run_train(*args); }};
}

int run_train(const TrainArgs& a) {
  return run_guarded("train", [&] {
    const Plan plan = build_plan("train", a.config);
    const Config config = load_config_file(a.config.config, a.config.overrides);
    TrainOptions opt;
    opt.resolved_config_json = resolved_config_json(a.config.config, a.config.overrides);
    opt.plan_json = plan_to_json(plan);
    const char* term = std::getenv("TERM");
    opt.live_progress = isatty(STDERR_FILENO) && !(term && std::string(term) == "dumb");
    opt.print_every = config.steps_per_print.value_or(10);
    const TrainResult r = train(plan, config, opt);
    if (r.losses.empty()) return r.interrupted ? kExitInterrupted : kExitOk;
    std::cerr << "ds train: " << (r.interrupted ? "interrupted at step " : "done: ") << r.steps << " of " << plan.steps
              << " steps in " << format_double(std::round(r.seconds * 10) / 10) << " s; loss " << format_double(std::round(r.losses.front() * 1e4) / 1e4)
              << " -> " << format_double(std::round(r.losses.back() * 1e4) / 1e4);
    if (!r.val_losses.empty()) std::cerr << " (validation " << format_double(std::round(r.val_losses.back() * 1e4) / 1e4) << ")";
    if (config.data.type == DataType::synthetic)
      std::cerr << "; the synthetic language's floor is " << format_double(std::round(markov_entropy_nats() * 1e4) / 1e4);
    if (r.skipped_steps) std::cerr << "; " << r.skipped_steps << " steps skipped";
    std::cerr << "\nds train: metrics in " << r.metrics_path << "\n";
    if (r.interrupted) std::cerr << "ds train: no checkpoint was written (this build does not write checkpoints yet)\n";
    return r.interrupted ? kExitInterrupted : kExitOk;
  });
}

}  // namespace ds::cli
