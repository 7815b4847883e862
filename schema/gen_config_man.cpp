// Writes man/ds-config.5 from man/ds-config.5.in and the schema. Run by `ninja -C build man`;
// the test ManPages.ConfigReferenceIsUpToDate fails when the checked-in page is stale.
#include <fstream>
#include <iostream>
#include <sstream>

#include "schema/schema_doc.hpp"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: gen_config_man TEMPLATE OUTPUT\n";
    return 2;
  }
  std::ifstream in(argv[1]);
  if (!in) {
    std::cerr << "gen_config_man: cannot read " << argv[1] << "\n";
    return 2;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  std::ofstream(argv[2]) << ds::render_config_man_page(ss.str());
  return 0;
}
