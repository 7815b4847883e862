#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>

#include "schema/schema_doc.hpp"
#include "schema/schema_walk.hpp"
#include "test_helpers.hpp"

using namespace ds;

TEST(ManPages, ConfigReferenceIsUpToDate) {
  const std::string tmpl = test::read_text(std::string(DS_SOURCE_DIR) + "/man/ds-config.5.in");
  const std::string page = test::read_text(std::string(DS_SOURCE_DIR) + "/man/ds-config.5");
  ASSERT_FALSE(tmpl.empty());
  EXPECT_TRUE(render_config_man_page(tmpl) == page)
      << "man/ds-config.5 is stale: run `ninja -C build man` after changing the schema or the template";
}

TEST(ManPages, ConfigReferenceNamesEveryTopLevelKey) {
  const std::string ref = config_key_reference_roff();
  for (const auto& [key, sub] : config_schema()["properties"].items())
    EXPECT_NE(ref.find(".B " + key), std::string::npos) << key;
}

TEST(Readme, ListsEveryExampleWithTheCommandThatRunsItAndPointsAtNothingOutsideTheProject) {
  const std::string readme = test::read_text(std::string(DS_SOURCE_DIR) + "/README.md");
  for (const auto& e : std::filesystem::directory_iterator(std::string(DS_SOURCE_DIR) + "/examples")) {
    if (e.is_directory()) continue;  // examples/data: what the examples read
    const std::string name = e.path().filename().string();
    bool has_command = false;  // a `ds <subcommand> examples/<name>` line
    std::istringstream lines(readme);
    for (std::string line; std::getline(lines, line);) {
      const size_t at = line.find("ds ");
      has_command |= at != std::string::npos && line.find(" examples/" + name, at) != std::string::npos;
    }
    EXPECT_TRUE(has_command) << name << " has no command in README.md";
    const Config c = load_config_file(e.path().string());  // and every example loads without a warning
    EXPECT_TRUE(c.warnings.empty()) << name << ": " << test::dump(c.warnings);
  }
  EXPECT_EQ(readme.find("../shared"), std::string::npos) << "users do not have ../shared";
}
