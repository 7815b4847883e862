// ds — small string helpers used in more than one layer.
#pragma once

#include <string>

namespace ds {

inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), std::string::npos, suffix) == 0;
}

}  // namespace ds
