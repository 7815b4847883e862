// ds — "did you mean" suggestions for misspelled keys, presets and flags.
#pragma once

#include <string>
#include <vector>

namespace ds {

// Optimal-string-alignment distance (Damerau-Levenshtein with adjacent transpositions),
// case-insensitive, with '-' and '_' treated as equal.
int edit_distance(const std::string& a, const std::string& b);

// The closest candidate if it is close enough to be a plausible typo (distance at most
// max(1, len/3), or one is a prefix of the other), else "".
std::string closest_match(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace ds
