#include "cli/pending.hpp"

#include <iostream>

namespace ds::cli {
namespace {

Subcommand pending(CLI::App& app, const char* name, const char* what, const char* footer, const char* instead) {
  CLI::App* sub = app.add_subcommand(name, what);
  sub->allow_extras();
  sub->footer(footer);
  const std::string n = name, alt = instead;
  return {sub, [n, alt] {
            std::cerr << "ds " << n << ": " << red("error:", stderr) << " `ds " << n
                      << "` is not available in this build of ds yet.\n    hint: " << alt << "\n";
            return static_cast<int>(kExitRuntime);
          }};
}

}  // namespace

Subcommand setup_profile(CLI::App& app) {
  return pending(app, "profile", "where time, FLOPs, bytes and memory go in a training step",
                 R"(Examples (once available):
  ds profile config.json
  ds profile config.json --steps 5 --json)",
                 "`ds plan CONFIG` shows FLOPs per step, memory by category and bytes communicated");
}

}  // namespace ds::cli
