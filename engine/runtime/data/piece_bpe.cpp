#include "engine/runtime/data/piece_bpe.hpp"

#include <climits>
#include <queue>
#include <stdexcept>

#include "common/error.hpp"
#include "engine/runtime/data/byte_level_bpe.hpp"  // the UTF-8 helpers

namespace ds {

namespace {

std::string byte_token(int b) {
  static const char* hex = "0123456789ABCDEF";
  return std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">";
}

}  // namespace

PieceBpe::PieceBpe(Parts parts) : byte_fallback_(parts.byte_fallback), fuse_unk_(parts.fuse_unk) {
  for (auto& [tok, id] : parts.vocab) {
    if (id < 0 || id >= (int32_t{1} << 24))
      throw UserError("'" + parts.source + "' gives '" + tok + "' the id " + std::to_string(id), "token ids are from 0 to 16,777,215");
    if (static_cast<size_t>(id) >= id_to_token_.size()) id_to_token_.resize(id + 1);
    id_to_token_[id] = tok;
    token_to_id_[tok] = id;
  }
  byte_of_id_.assign(id_to_token_.size(), -1);
  for (int b = 0; b < 256; ++b) {
    auto it = token_to_id_.find(byte_token(b));
    byte_ids_[b] = it == token_to_id_.end() ? -1 : it->second;
    if (it != token_to_id_.end()) byte_of_id_[it->second] = static_cast<int16_t>(b);
    if (byte_fallback_ && byte_ids_[b] < 0)
      throw UserError("'" + parts.source + "' has byte_fallback but no token " + byte_token(b),
                      "a byte-fallback vocabulary holds all 256 <0xXX> tokens");
  }
  if (!parts.unk_token.empty()) unk_ = id_of(parts.unk_token);
  if (!parts.merge_ranks.empty() && parts.merge_ranks.size() != parts.merges.size())
    throw std::logic_error("PieceBpe: a rank for each merge, or none");
  for (size_t k = 0; k < parts.merges.size(); ++k) {
    const auto& [left, right] = parts.merges[k];
    const int32_t rank = parts.merge_ranks.empty() ? static_cast<int32_t>(k) : parts.merge_ranks[k];
    const int32_t l = id_of(left), r = id_of(right), m = id_of(left + right);
    if (l >= 0 && r >= 0 && m >= 0) merges_[pair_key(l, r)] = Merge{rank, m};  // a repeated pair: the last wins, as in HF
  }
}

int32_t PieceBpe::id_of(const std::string& token) const {
  auto it = token_to_id_.find(token);
  return it == token_to_id_.end() ? -1 : it->second;
}

void PieceBpe::encode_into(const std::string& s, std::vector<int32_t>& out, std::vector<int32_t>* lengths) const {
  // Symbols: one a character, or its bytes' tokens, or <unk> (consecutive ones fused); `len` the bytes each covers.
  std::vector<int32_t> sym, len_of;
  bool last_unk = false;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    const int len = decode_utf8(s, i, &cp);
    auto it = token_to_id_.find(s.substr(i, static_cast<size_t>(len)));
    if (it != token_to_id_.end()) {
      sym.push_back(it->second), len_of.push_back(len);
      last_unk = false;
    } else if (byte_fallback_) {
      for (int k = 0; k < len; ++k) sym.push_back(byte_ids_[static_cast<unsigned char>(s[i + k])]), len_of.push_back(1);
      last_unk = false;
    } else if (unk_ >= 0) {
      if (fuse_unk_ && last_unk) len_of.back() += len;
      else sym.push_back(unk_), len_of.push_back(len);
      last_unk = true;
    } else {
      throw UserError("the tokenizer has no token for the character '" + s.substr(i, static_cast<size_t>(len)) +
                          "' and neither byte fallback nor an unk token", "is the data in the model's language?");
    }
    i += static_cast<size_t>(len);
  }
  // Merges by rank, the leftmost first among equals (Hugging Face's order): a heap of candidate pairs,
  // each checked when it comes up, since a merge beside it may have consumed one of its symbols.
  const int n = static_cast<int>(sym.size());
  std::vector<int> next(n), prev(n);
  for (int k = 0; k < n; ++k) next[k] = k + 1, prev[k] = k - 1;
  struct Candidate {
    int32_t rank;
    int pos;
    int32_t left, right;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto offer = [&](int a) {
    if (a < 0 || next[a] >= n) return;
    auto it = merges_.find(pair_key(sym[a], sym[next[a]]));
    if (it != merges_.end()) heap.push({it->second.rank, a, sym[a], sym[next[a]]});
  };
  for (int k = 0; k + 1 < n; ++k) offer(k);
  std::vector<bool> gone(n, false);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    const int a = c.pos;
    if (gone[a] || next[a] >= n || sym[a] != c.left || sym[next[a]] != c.right) continue;  // stale
    const int b = next[a];
    sym[a] = merges_.at(pair_key(c.left, c.right)).id;
    len_of[a] += len_of[b];
    gone[b] = true;
    next[a] = next[b];
    if (next[b] < n) prev[next[b]] = a;
    offer(prev[a]);
    offer(a);
  }
  for (int k = 0; k < n; k = next[k]) {
    out.push_back(sym[k]);
    if (lengths) lengths->push_back(len_of[k]);
  }
}

std::string PieceBpe::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size()) continue;
    if (byte_of_id_[static_cast<size_t>(id)] >= 0) {
      out += static_cast<char>(byte_of_id_[static_cast<size_t>(id)]);
      continue;
    }
    const std::string& tok = id_to_token_[static_cast<size_t>(id)];
    for (size_t i = 0; i < tok.size();) {
      if (tok.compare(i, 3, "\xE2\x96\x81") == 0) {  // '▁'
        out += ' ';
        i += 3;
      } else {
        out += tok[i++];
      }
    }
  }
  return out;
}

}  // namespace ds
