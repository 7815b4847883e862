#include "cli/plan.hpp"

#include <iostream>

#include "cli/render_plan.hpp"
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

Exit status: 0 valid and planned, 2 config or usage error (every problem is listed), 1 other failure.)");
  return {sub, [args] { return run_plan(*args); }};
}

int run_plan(const PlanArgs& a) {
  return run_guarded("plan", [&] {
    ConfigArgs args = with_config_path(a.config);
    if (a.show_config) {
      std::cout << resolved_config_json(args.config, args.overrides) << "\n";
      return 0;
    }
    args.model_optional = true;  // a bare DeepSpeed config plans what it can
    Plan plan = build_plan("plan", args);
    if (a.json)
      std::cout << plan_to_json(plan) << "\n";
    else
      std::cout << render_plan_text(plan, color_enabled(stdout), a.layout);
    return 0;
  }, a.json);
}

}  // namespace ds::cli
