#include "cli/app.hpp"

#include <iostream>

#include "cli/common.hpp"
#include "common/did_you_mean.hpp"
#include "common/strings.hpp"
#include "cli/convert_ckpt.hpp"
#include "cli/env.hpp"
#include "cli/estimate_memory.hpp"
#include "cli/profile.hpp"
#include "cli/plan.hpp"
#include "cli/train.hpp"
#include "cli/version.hpp"

namespace ds::cli {

int run_ds(int argc, char** argv) {
  set_command_line(argc, argv);
  CLI::App app{"ds: native C++ training with ZeRO, mixed precision and offload, driven by one JSON config", "ds"};
  std::string color = "auto";
  bool version = false;
  app.add_option("--color", color, "colour: auto (a terminal without NO_COLOR), always, never")
      ->check(CLI::IsMember({"auto", "always", "never"}));
  app.add_flag("--version", version, "print the version, git revision and libraries, then exit");
  app.fallthrough();  // --color after the command (ds train --color=never) is the same flag
  app.footer(R"(Examples:
  ds plan templates/zero2.json                 the execution plan of a config
  ds plan templates/zero3.json --world-size 8  ... planned for 8 ranks
  ds env                                       versions, cores, memory, GPUs

Exit status: 0 ok, 1 runtime failure, 2 usage or config error, 130 interrupted, 143 terminated.
Run `ds <command> --help` for a command's options and examples. Every config key: `man ds-config` once
installed (cmake --install), or `man -l man/ds-config.5` in the source tree.)");

  std::vector<Subcommand> subs = {setup_plan(app), setup_estimate_memory(app), setup_train(app), setup_convert_ckpt(app),
                                  setup_profile(app), setup_env(app)};
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);  // prints the help of the subcommand asked about; exit 0
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const UserError& e) {  // a flag answered with its ds equivalent (--include, ...)
    return run_guarded(argc > 1 ? argv[1] : "ds", [&]() -> int { throw e; });
  } catch (const CLI::ParseError& e) {
    std::string sub;
    const CLI::App* parsed = &app;
    for (const auto& s : subs)
      if (s.app->parsed()) sub = " " + s.app->get_name(), parsed = s.app;
    std::cerr << "ds" << sub << ": " << red("error:", stderr) << " " << e.what() << "\n";
    std::string hint;
    // A mistyped command (`ds trian`): the nearest one.
    if (sub.empty() && argc > 1 && argv[1][0] != '-') {
      std::vector<std::string> names;
      for (const auto& s : subs) names.push_back(s.app->get_name());
      if (std::string near = closest_match(argv[1], names); !near.empty()) hint = "did you mean `ds " + near + "`? ";
      else hint = "the commands are " + join(names, ", ") + "; ";
    }
    // A mistyped flag: the nearest one this command has.
    for (const std::string& word : command_line())
      if (word.rfind("--", 0) == 0 && std::string(e.what()).find(word) != std::string::npos)
        if (std::string near = flag_suggestion(parsed, word); !near.empty() && near != word.substr(0, word.find('=')))
          hint = "did you mean " + near + "? ";
    std::cerr << "    hint: " << hint << "run `ds" << sub << " --help` for usage and examples\n";
    return kExitUsage;
  }
  set_color_mode(color);
  if (version) {
    std::cout << version_text();
    return kExitOk;
  }
  for (const auto& s : subs)
    if (s.app->parsed()) return s.run();
  // Bare `ds`: a usage error (a script that forgot its command must not pass), the commands one line each.
  std::cerr << "ds " << version_short() << ": native C++ training driven by one JSON config\n\nUsage: ds [--version] [--color WHEN] <command> [args]\n\nCommands:\n";
  for (const auto& s : subs) {
    std::string name = s.app->get_name();
    std::cerr << "  " << name << std::string(name.size() < 17 ? 17 - name.size() : 1, ' ') << s.app->get_description() << "\n";
  }
  std::cerr << "\nRun `ds <command> --help` for options and examples (`ds --help` for all).\n";
  return kExitUsage;
}

}  // namespace ds::cli
