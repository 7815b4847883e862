// ds — which keys two JSON documents disagree on (for "the config differs from the checkpoint's").
#pragma once

#include <string>
#include <vector>

namespace ds {

// Dotted paths of leaves that differ, are missing on one side, or cannot be parsed ("(unreadable)").
std::vector<std::string> json_differences(const std::string& a, const std::string& b);

}  // namespace ds
