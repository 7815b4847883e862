// ds — what `ds --version` prints: enough to tell this binary from DeepSpeed's Python `ds` launcher,
// and which revision and libraries it was built from.
#pragma once

#include <string>

namespace ds::cli {

std::string version_text();
std::string version_short();  // "0.1.0 (git abc123)"

}  // namespace ds::cli
