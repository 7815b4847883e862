#include "engine/plan/packing.hpp"

#include <algorithm>
#include <set>
#include <utility>
#include <numeric>

#include "common/error.hpp"

namespace ds {

int64_t sample_positions(int64_t tokens, int64_t seq_len) { return std::clamp<int64_t>(tokens - 1, 0, seq_len); }

std::vector<std::vector<int64_t>> pack_samples(const std::vector<int64_t>& tokens, int64_t seq_len) {
  DS_CHECK(seq_len > 0);
  std::vector<int64_t> order(tokens.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return sample_positions(tokens[static_cast<size_t>(a)], seq_len) > sample_positions(tokens[static_cast<size_t>(b)], seq_len);
  });
  std::vector<std::vector<int64_t>> rows;
  std::set<std::pair<int64_t, size_t>> room;  // (free positions, row): the fullest first, then the first made
  for (const int64_t i : order) {
    const int64_t need = sample_positions(tokens[static_cast<size_t>(i)], seq_len);
    if (need == 0) break;  // sorted: the rest take no position either
    auto fit = room.lower_bound({need, 0});
    size_t row = rows.size();
    int64_t left = seq_len;
    if (fit != room.end()) {
      row = fit->second;
      left = fit->first;
      room.erase(fit);
    } else {
      rows.emplace_back();
    }
    rows[row].push_back(i);
    if (left - need > 0) room.emplace(left - need, row);
  }
  for (auto& r : rows) std::sort(r.begin(), r.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.front() < b.front(); });
  return rows;
}

}  // namespace ds
