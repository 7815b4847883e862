#include "engine/plan/layout.hpp"

#include <algorithm>

#include "common/error.hpp"

namespace ds {

FlatLayout build_layout(const ModelSpec& model, int stage, int world_size) {
  DS_CHECK(world_size >= 1, "world size ", world_size);
  DS_CHECK(stage >= 0 && stage <= 3, "stage ", stage);
  FlatLayout L;
  L.stage = stage;
  L.world_size = world_size;
  int64_t offset = 0, partition_offset = 0;
  for (const auto& t : model.tensors) {
    ParamSlot p;
    p.name = t.name;
    p.shape = t.shape;
    p.numel = t.numel;
    p.offset = offset;
    p.weight_decay = t.weight_decay;
    p.layer = t.layer;
    if (stage == 3) {
      p.partition_numel = (t.numel + world_size - 1) / world_size;
      p.partition_offset = partition_offset;
      partition_offset += p.partition_numel;
    }
    offset += t.numel;
    L.params.push_back(std::move(p));
  }
  L.numel = offset;
  if (stage == 3) {
    L.alignment = world_size;
    L.shard_numel = partition_offset;
    L.padded_numel = partition_offset * world_size;
    return L;
  }
  L.alignment = stage == 0 ? 1 : 2 * static_cast<int64_t>(world_size);
  L.padded_numel = (L.numel + L.alignment - 1) / L.alignment * L.alignment;
  if (stage == 0) {
    L.shard_numel = L.padded_numel;
    L.shards.assign(world_size, ShardRange{0, L.padded_numel, L.numel});
    return L;
  }
  L.shard_numel = L.padded_numel / world_size;
  for (int r = 0; r < world_size; ++r) {
    ShardRange s;
    s.begin = r * L.shard_numel;
    s.end = s.begin + L.shard_numel;
    s.real = std::max<int64_t>(0, std::min(s.end, L.numel) - s.begin);
    L.shards.push_back(s);
  }
  return L;
}

ShardRange stage3_owned(const ParamSlot& p, int rank) {
  ShardRange s;
  s.begin = std::min(p.numel, rank * p.partition_numel);
  s.end = std::min(p.numel, (rank + 1) * p.partition_numel);
  s.real = s.end - s.begin;
  return s;
}

std::vector<OwnedSegment> owned_segments(const FlatLayout& L, int rank) {
  std::vector<OwnedSegment> out;
  const bool whole = L.stage == 0 || L.world_size == 1;
  for (size_t i = 0; i < L.params.size(); ++i) {
    const ParamSlot& p = L.params[i];
    OwnedSegment s;
    s.param = static_cast<int>(i);
    if (whole) {
      s.global = s.local = p.offset;
      s.numel = p.numel;
    } else if (L.stage == 3) {
      const ShardRange own = stage3_owned(p, rank);
      s.global = p.offset + own.begin;
      s.local = p.partition_offset;
      s.numel = own.real;
    } else {
      const ShardRange& r = L.shards[static_cast<size_t>(rank)];
      const int64_t b = std::max(p.offset, r.begin), e = std::min(p.offset + p.numel, r.end);
      s.global = b;
      s.local = b - r.begin;
      s.numel = e - b;
    }
    if (s.numel > 0) out.push_back(s);
  }
  return out;
}

std::vector<ParamGroup> parameter_groups(const FlatLayout& L) {
  std::vector<ParamGroup> blocks;
  ParamGroup outer;
  for (size_t i = 0; i < L.params.size(); ++i) {
    const ParamSlot& p = L.params[i];
    ParamGroup* g = &outer;
    if (p.layer >= 0) {
      if (static_cast<size_t>(p.layer) >= blocks.size()) blocks.resize(static_cast<size_t>(p.layer) + 1);
      g = &blocks[static_cast<size_t>(p.layer)];
      g->layer = p.layer;
    }
    g->params.push_back(static_cast<int>(i));
    g->numel += p.numel;
  }
  if (!outer.params.empty()) blocks.push_back(std::move(outer));
  return blocks;
}

std::vector<std::pair<int64_t, int64_t>> block_ranges(const FlatLayout& L) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const ParamGroup& g : parameter_groups(L)) {
    if (g.layer < 0) continue;
    int64_t begin = L.numel, end = 0;
    for (int i : g.params) {
      const ParamSlot& p = L.params[static_cast<size_t>(i)];
      begin = std::min(begin, p.offset);
      end = std::max(end, p.offset + p.numel);
    }
    DS_CHECK(end - begin == g.numel, "block ", g.layer, "'s parameters are not contiguous in the flat order");
    DS_CHECK(out.empty() || out.back().second == begin, "block ", g.layer, " does not follow the block before it");
    out.emplace_back(begin, end);
  }
  return out;
}

}  // namespace ds
