#include "engine/runtime/comm/comm_host.hpp"

#include "common/error.hpp"
#include "kernels/cpu/sum.hpp"

namespace ds {

void add_received_on_host(const torch::Tensor& t, const std::vector<Span>& mine, int peers, const torch::Tensor& scratch) {
  const int64_t total = span_elements(mine);
  const bool bf16 = t.scalar_type() == torch::kBFloat16;
  DS_CHECK(scratch.scalar_type() == t.scalar_type() && scratch.numel() >= total * peers, "a reduce-scatter's scratch is too small");
  if (t.scalar_type() == torch::kFloat16) {  // communication_data_type fp16 on CPU ranks: summed in fp32, rounded once
    int64_t within = 0;
    for (const Span& s : mine) {
      torch::Tensor sum = t.narrow(0, s.offset, s.numel).to(torch::kFloat32);
      for (int p = 0; p < peers; ++p) sum.add_(scratch.narrow(0, p * total + within, s.numel).to(torch::kFloat32));
      t.narrow(0, s.offset, s.numel).copy_(sum);
      within += s.numel;
    }
    return;
  }
  DS_CHECK(bf16 || t.scalar_type() == torch::kFloat32, "a reduce-scatter of ", t.scalar_type());
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
