#include "common/did_you_mean.hpp"

#include <algorithm>
#include <cctype>
#include <climits>

namespace ds {

static char fold(char c) {
  if (c == '-') return '_';
  return static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
}

int edit_distance(const std::string& a, const std::string& b) {
  // Three rolling rows (the transposition looks two rows back) instead of the whole table.
  const size_t n = a.size(), m = b.size();
  std::vector<int> prev2(m + 1), prev(m + 1), cur(m + 1);
  for (size_t j = 0; j <= m; ++j) prev[j] = static_cast<int>(j);
  for (size_t i = 1; i <= n; ++i) {
    cur[0] = static_cast<int>(i);
    for (size_t j = 1; j <= m; ++j) {
      const int cost = fold(a[i - 1]) == fold(b[j - 1]) ? 0 : 1;
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost});
      if (i > 1 && j > 1 && fold(a[i - 1]) == fold(b[j - 2]) && fold(a[i - 2]) == fold(b[j - 1]))
        cur[j] = std::min(cur[j], prev2[j - 2] + 1);
    }
    std::swap(prev2, prev);
    std::swap(prev, cur);
  }
  return prev[m];
}

std::string closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  if (word.size() > 64) return "";  // no key is that long: not a typo of one
  std::string best;
  int best_d = INT_MAX;
  for (const auto& c : candidates) {
    // The distance is at least the difference in length; past a third of the longer word it could not
    // be accepted below, so the quadratic comparison is skipped.
    const size_t n = word.size(), m = c.size();
    if ((n > m ? n - m : m - n) * 3 > std::max(n, m)) continue;
    int d = edit_distance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  if (best.empty()) return "";
  int limit = std::max<int>(1, static_cast<int>(std::max(word.size(), best.size())) / 3);
  // A word that starts otherwise is one typo or two away at most: "io_parallel" shares only its tail with
  // "tensor_parallel" (five edits, within a third of the longer), which is no typo of it.
  const bool same_start = !word.empty() && fold(word[0]) == fold(best[0]);
  if (best_d <= limit && (same_start || best_d <= 2)) return best;
  // "stage3_prefetch" for "stage3_prefetch_bucket_size": a long prefix is a clear intent.
  std::string lw, lb;
  for (char c : word) lw += fold(c);
  for (char c : best) lb += fold(c);
  for (const auto& c : candidates) {
    std::string lc;
    for (char ch : c) lc += fold(ch);
    if (lw.size() >= 4 && lc.rfind(lw, 0) == 0) return c;
  }
  return "";
}

}  // namespace ds
