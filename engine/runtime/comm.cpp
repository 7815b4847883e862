#include "engine/runtime/comm.hpp"

#include "common/error.hpp"
#include "kernels/cpu/sum.hpp"

namespace ds {

std::unique_ptr<Communicator> make_gloo_communicator(const Topology& t, std::chrono::milliseconds timeout);  // comm_gloo.cpp

std::unique_ptr<Communicator> Communicator::create(CommBackend backend, const Topology& t, std::chrono::milliseconds timeout) {
  if (t.master_addr.empty() || t.master_port == 0)
    throw UserError(std::string(t.master_addr.empty() ? "MASTER_ADDR" : "MASTER_PORT") + " is not set, but the world size is above 1",
                    "start ranks with `ds train --nproc-per-node N`, torchrun --no-python, or set RANK, WORLD_SIZE, "
                    "MASTER_ADDR and MASTER_PORT yourself");
  switch (backend) {
    case CommBackend::gloo: return make_gloo_communicator(t, timeout);
    case CommBackend::nccl: break;
  }
  throw UserError(std::string("this build of ds has no ") + comm_backend_name(backend) + " communicator",
                  "GPU ranks need the CUDA build (see the README); CPU ranks use gloo");
}

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
