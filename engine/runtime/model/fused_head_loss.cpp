#include "engine/runtime/model/fused_head_loss.hpp"

#include <algorithm>

#include "common/error.hpp"
#include "engine/runtime/model/fused_ops.hpp"  // bound_gradient
#include "engine/runtime/model/matmul.hpp"
#include "kernels/cpu/cross_entropy.hpp"

namespace ds {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct HeadPass {
  double loss_sum = 0;
  torch::Tensor dx, dw;  // empty unless gradients were asked for; dw empty too when it went into `dw_into`
};

// Softmax cross-entropy of one chunk of logits (rows, V), in place: the gradient replaces the logits
// when `row_grad` is nonzero. fp16 goes through an fp32 copy of the chunk (the kernel reads fp32/bf16).
double chunk_cross_entropy(torch::Tensor& logits, const int64_t* targets, float row_grad, bool write_grad) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  switch (logits.scalar_type()) {
    case torch::kFloat32:
      return kernels::softmax_cross_entropy_f32(logits.data_ptr<float>(), targets, rows, vocab, logits.stride(0), row_grad,
                                                write_grad);
    case torch::kBFloat16:
      return kernels::softmax_cross_entropy_bf16(reinterpret_cast<uint16_t*>(logits.data_ptr<at::BFloat16>()), targets,
                                                 rows, vocab, logits.stride(0), row_grad, write_grad);
    default: {
      torch::Tensor wide = logits.to(torch::kFloat32);
      const double sum = kernels::softmax_cross_entropy_f32(wide.data_ptr<float>(), targets, rows, vocab, vocab, row_grad,
                                                            write_grad);
      if (write_grad) logits.copy_(wide);
      return sum;
    }
  }
}

// The same off the CPU, in LibTorch's operations on the logits' device: the loss summed there (read once per
// pass, not per chunk), the gradient softmax - onehot times row_grad written over the logits.
torch::Tensor library_chunk_cross_entropy(torch::Tensor& logits, const torch::Tensor& targets, float row_grad, bool write_grad) {
  const torch::Tensor wide = logits.to(torch::kFloat32);
  const torch::Tensor lse = wide.logsumexp(1, /*keepdim=*/true);
  const torch::Tensor ids = targets.view({-1, 1});
  const torch::Tensor sum = (lse - wide.gather(1, ids)).to(torch::kFloat64).sum();
  if (write_grad) {
    torch::Tensor g = (wide - lse).exp_();
    g.scatter_add_(1, ids, torch::full({ids.size(0), 1}, -1.0f, g.options()));
    logits.copy_(g.mul_(row_grad));
  }
  return sum;
}

// A (rows, V) buffer for the logits: a new one, or `*kept` (made there when it is missing, too small
// or of another dtype).
torch::Tensor logits_buffer(int64_t rows, int64_t V, const torch::TensorOptions& options, torch::Tensor* kept) {
  if (!kept) return torch::empty({rows, V}, options);
  if (!kept->defined() || kept->dtype() != options.dtype() || kept->numel() < rows * V) *kept = torch::empty({rows, V}, options);
  return kept->view(-1).narrow(0, 0, rows * V).view({rows, V});
}

// `dw_into` (defined): W's gradient is added into it chunk by chunk by the GEMM, instead of made.
HeadPass head_pass(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& targets_in,
                   double expected_grad, int64_t chunk_elements, torch::Tensor* kept_logits, bool grads,
                   const torch::Tensor& dw_into = {}, double softcap = 0) {
  torch::NoGradGuard no_grad;
  const int64_t N = x.size(0), V = weight.size(0);
  DS_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1) && targets_in.numel() == N,
           "fused head loss: shapes x ", x.sizes(), ", weight ", weight.sizes(), ", targets ", targets_in.sizes());
  const torch::Tensor targets = targets_in.to(x.device(), torch::kLong).contiguous();  // the batch's, from the host
  const bool host = x.device().is_cpu();
  torch::Tensor device_sum = host ? torch::Tensor() : torch::zeros({}, x.options().dtype(torch::kFloat64));
  if (N > 0) {
    const int64_t lo = targets.min().item<int64_t>(), hi = targets.max().item<int64_t>();
    DS_CHECK(lo >= 0 && hi < V, "token id ", lo < 0 ? lo : hi, " is outside the vocabulary [0, ", V,
             "): the data and model.vocab_size disagree");
  }
  const int64_t rows = std::clamp<int64_t>(chunk_elements / std::max<int64_t>(V, 1), 1, std::max<int64_t>(N, 1));
  // (the plan's head_workspace_bytes counts this chunk and the weight's gradient)
  const float row_grad = static_cast<float>(expected_grad / static_cast<double>(N));
  HeadPass out;
  if (grads) out.dx = torch::empty_like(x, torch::MemoryFormat::Contiguous);
  const torch::Tensor buffer = logits_buffer(std::min(rows, N), V, x.options(), kept_logits);
  const torch::Tensor wt = weight.t();
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t n = std::min(rows, N - r0);
    const torch::Tensor xc = x.narrow(0, r0, n);
    torch::Tensor logits = buffer.narrow(0, 0, n);
    matmul_into(logits, xc, wt, false);
    torch::Tensor capped;  // tanh(logits / cap) in fp32, for the gradient's factor 1 - tanh^2 (rounded once)
    if (softcap > 0) {
      logits.div_(softcap).tanh_();
      if (grads) capped = logits.to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
      logits.mul_(softcap);
    }
    if (host)
      out.loss_sum += chunk_cross_entropy(logits, targets.data_ptr<int64_t>() + r0, row_grad, grads);
    else
      device_sum += library_chunk_cross_entropy(logits, targets.narrow(0, r0, n), row_grad, grads);
    if (!grads) continue;
    if (capped.defined()) logits.copy_(capped.square_().neg_().add_(1).mul_(logits));
    torch::Tensor dxc = out.dx.narrow(0, r0, n);
    matmul_into(dxc, logits, weight, false);
    // Later chunks add into W's gradient: one rounding per chunk in bf16/fp16 (the GEMM adds in fp32).
    if (dw_into.defined())
      matmul_into(dw_into, logits.t(), xc, true);
    else if (r0 == 0)
      out.dw = matmul_new(logits.t(), xc);
    else
      matmul_into(out.dw, logits.t(), xc, true);
  }
  if (!host) out.loss_sum = device_sum.item<double>();
  return out;
}

class FusedHeadLoss : public torch::autograd::Function<FusedHeadLoss> {
 public:
  // W's gradient goes straight into its bound buffer (ds's flat gradients) during forward, where the
  // logits' gradient exists: no V x C tensor kept until backward and then added by autograd. ZeRO's
  // exchange finishes any reduction of those buffers before the head runs (ZeroExchange::after_forward).
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& targets, double expected_grad, int64_t chunk_elements,
                               torch::Tensor* kept_logits, double softcap) {
    const torch::Tensor into = weight.requires_grad() ? bound_gradient(weight) : torch::Tensor();
    HeadPass pass = head_pass(x, weight, targets, expected_grad, chunk_elements, kept_logits, true, into, softcap);
    ctx->saved_data["dx"] = pass.dx;
    ctx->saved_data["dw"] = pass.dw;
    ctx->saved_data["dw_in_buffer"] = into.defined();
    ctx->saved_data["expected"] = expected_grad;
    return torch::tensor(static_cast<float>(pass.loss_sum / static_cast<double>(x.size(0))), torch::kFloat32);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    torch::Tensor dx = ctx->saved_data["dx"].toTensor(), dw = ctx->saved_data["dw"].toTensor();
    ctx->saved_data.erase("dx");
    ctx->saved_data.erase("dw");
    // The gradients were made for the expected one; anything else (a loss used twice, another scale)
    // rescales them -- which W's gradient, already in its buffer, cannot be.
    const float expected = static_cast<float>(ctx->saved_data["expected"].toDouble());
    const float got = grad_out[0].item<float>();
    if (got != expected) {
      DS_CHECK(!ctx->saved_data["dw_in_buffer"].toBool(), "fused head loss: the weight's gradient went into its buffer for a loss gradient of ",
               expected, ", but ", got, " arrived (set_loss_gradient before the forward)");
      const double factor = static_cast<double>(got) / static_cast<double>(expected);
      dx = dx * factor;
      dw = dw * factor;
    }
    return {dx, dw, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor fused_head_loss(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& targets,
                              double expected_grad, int64_t chunk_elements, torch::Tensor* kept_logits, double softcap) {
  DS_CHECK(expected_grad != 0, "fused head loss: the expected gradient must be nonzero");
  if (torch::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad()))
    return FusedHeadLoss::apply(x, weight, targets, expected_grad, chunk_elements, kept_logits, softcap);
  const HeadPass pass = head_pass(x, weight, targets, expected_grad, chunk_elements, kept_logits, false, {}, softcap);
  return torch::tensor(static_cast<float>(pass.loss_sum / static_cast<double>(x.size(0))), torch::kFloat32);
}

}  // namespace ds
