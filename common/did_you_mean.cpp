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
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<int>> d(n + 1, std::vector<int>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = static_cast<int>(i);
  for (size_t j = 0; j <= m; ++j) d[0][j] = static_cast<int>(j);
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= m; ++j) {
      int cost = fold(a[i - 1]) == fold(b[j - 1]) ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && fold(a[i - 1]) == fold(b[j - 2]) && fold(a[i - 2]) == fold(b[j - 1]))
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}

std::string closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  int best_d = INT_MAX;
  for (const auto& c : candidates) {
    int d = edit_distance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  if (best.empty()) return "";
  int limit = std::max<int>(1, static_cast<int>(std::max(word.size(), best.size())) / 3);
  if (best_d <= limit) return best;
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
