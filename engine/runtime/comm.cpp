#include "engine/runtime/comm.hpp"

#include "common/error.hpp"
#include "kernels/cpu/sum.hpp"

namespace ds {

CommStats& Communicator::count(CollectiveKind kind, CollectiveOp op, double payload_bytes, int64_t* event) {
  CommStats& s = ledger_[kind];
  s.op = collective_op_name(op);
  ++s.calls;
  const double wire = wire_bytes_per_rank(op, payload_bytes, world_);
  s.bytes += wire;
  *event = -1;
  if (recording_) {
    const auto now = std::chrono::steady_clock::now();
    events_.push_back({kind, now, now, wire});
    *event = static_cast<int64_t>(events_.size()) - 1;
  }
  return s;
}

double Communicator::payload_bytes(const torch::Tensor& t, const Ownership& owners) {
  int64_t n = 0;
  for (const auto& spans : owners) n += span_elements(spans);
  return static_cast<double>(n * static_cast<int64_t>(t.element_size()));
}

void Communicator::add_received(const torch::Tensor& t, const Ownership& owners, const torch::Tensor& scratch) const {
  const std::vector<Span>& mine = owners[static_cast<size_t>(rank_)];
  const int64_t total = span_elements(mine);
  const int peers = world_ - 1;
  const bool bf16 = t.scalar_type() == torch::kBFloat16;
  DS_CHECK(bf16 || t.scalar_type() == torch::kFloat32, "a reduce-scatter of ", t.scalar_type());
  DS_CHECK(scratch.scalar_type() == t.scalar_type() && scratch.numel() >= total * peers, "a reduce-scatter's scratch is too small");
  const int64_t width = t.element_size();
  char* base = static_cast<char*>(t.data_ptr());
  const char* received = static_cast<const char*>(scratch.data_ptr());
  std::vector<const void*> srcs(static_cast<size_t>(peers));
  int64_t within = 0;
  for (const Span& s : mine) {
    for (int p = 0; p < peers; ++p) srcs[static_cast<size_t>(p)] = received + (p * total + within) * width;
    char* dst = base + s.offset * width;
    if (bf16)
      kernels::sum_into_bf16(reinterpret_cast<uint16_t*>(dst), reinterpret_cast<const uint16_t* const*>(srcs.data()), peers, s.numel);
    else
      kernels::sum_into_f32(reinterpret_cast<float*>(dst), reinterpret_cast<const float* const*>(srcs.data()), peers, s.numel);
    within += s.numel;
  }
}

}  // namespace ds
