#include "engine/runtime/model/fused_head_loss.hpp"

#include <algorithm>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "engine/runtime/model/fused_ops.hpp"  // bound_gradient
#include "engine/runtime/model/matmul.hpp"
#include "engine/runtime/device/kernel_route.hpp"
#include "kernels/cpu/cross_entropy.hpp"

namespace ds {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Off the host, the head's products are kept to dimensions cuBLAS runs at full rate: given an odd vocabulary
// (GPT-2's 50257) or row length it falls back to kernels for unaligned data, which took 36 of a step's 85 ms
// of GPU time for GPT-2 124M on an H200 (bench/RESULTS.md). So the logits' rows start a multiple of
// kDeviceRowAlign elements (16 bytes of bf16) apart, a chunk holds a multiple of kDeviceRowsAlign rows, and
// each product is split at the last multiple of kDeviceVocabAlign in the vocabulary: a large aligned part and
// a sliver of the remaining ids.
constexpr int64_t kDeviceRowAlign = 8;
constexpr int64_t kDeviceRowsAlign = 64;
constexpr int64_t kDeviceVocabAlign = 64;

// The ranges of vocabulary ids [begin, begin + size) the head's products are split into.
std::vector<std::pair<int64_t, int64_t>> vocab_parts(int64_t V, bool host) {
  const int64_t aligned = V / kDeviceVocabAlign * kDeviceVocabAlign;
  if (host || aligned == V || aligned == 0) return {{0, V}};
  return {{0, aligned}, {aligned, V - aligned}};
}

struct HeadPass {
  double loss_sum = 0;
  torch::Tensor device_loss_sum;  // off the host: the sum there (fp64 scalar), never read back here
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

// The same off the host, each row's loss written into `row_loss` (fp32, on the logits' device): kernels/cuda's
// one kernel on a GPU where ds has them, else LibTorch's operations (the gradient softmax - onehot times
// row_grad written over the logits).
void device_chunk_cross_entropy(torch::Tensor& logits, const torch::Tensor& targets, float row_grad, bool write_grad,
                                torch::Tensor row_loss) {
  if (kernel_route(logits) == KernelRoute::cuda && logits.stride(1) == 1 && targets.scalar_type() == torch::kLong &&
      targets.is_contiguous()) {
    cuda_softmax_cross_entropy(logits, targets, row_grad, write_grad, row_loss);
    return;
  }
  const torch::Tensor wide = logits.to(torch::kFloat32);
  const torch::Tensor lse = wide.logsumexp(1, /*keepdim=*/true);
  const torch::Tensor ids = targets.view({-1, 1});
  row_loss.copy_((lse - wide.gather(1, ids)).view(-1));
  if (write_grad) {
    torch::Tensor g = (wide - lse).exp_();
    g.scatter_add_(1, ids, torch::full({ids.size(0), 1}, -1.0f, g.options()));
    logits.copy_(g.mul_(row_grad));
  }
}

// Tensor parallel: the cross-entropy of a chunk of this rank's logits (rows, rows of the share) against targets of the
// whole vocabulary (int64, on the logits' device), each row's loss returned (fp32); the gradient, softmax - onehot
// times row_grad over this rank's columns (zero over its padding), written over the logits when asked.
torch::Tensor vocab_parallel_cross_entropy(torch::Tensor& logits, const torch::Tensor& targets, float row_grad, bool write_grad,
                                           const TensorGroup& group) {
  const VocabShare& v = group.vocab;
  const int t = group.size(), r = group.rank();
  const int64_t n = logits.size(0);
  torch::Tensor real = logits.narrow(1, 0, v.real);
  const torch::Tensor wide = real.to(torch::kFloat32);
  const torch::Tensor local_max = std::get<0>(wide.max(1));
  const torch::Tensor local = targets - v.begin;
  const torch::Tensor mine = (local >= 0) & (local < v.real);
  const torch::Tensor at = torch::where(mine, local, torch::zeros_like(local)).view({-1, 1});
  // Rows 2k and 2k + 1: rank k's maximum and its sum of exponentials below it; row 2t: the target's logit.
  torch::Tensor stats = torch::zeros({2 * t + 1, n}, wide.options());
  stats[2 * r].copy_(local_max);
  stats[2 * r + 1].copy_((wide - local_max.unsqueeze(1)).exp().sum(1));
  stats[2 * t].copy_(torch::where(mine, wide.gather(1, at).view(-1), torch::zeros_like(local_max)));
  group.comm->all_reduce_sum(stats, CollectiveKind::tensor_activations);
  const torch::Tensor pairs = stats.narrow(0, 0, 2 * t).view({t, 2, n});
  const torch::Tensor maxima = pairs.select(1, 0), sums = pairs.select(1, 1);
  const torch::Tensor top = std::get<0>(maxima.max(0));
  const torch::Tensor lse = (sums * (maxima - top).exp()).sum(0).log() + top;
  if (write_grad) {
    torch::Tensor g = (wide - lse.unsqueeze(1)).exp_();
    g.scatter_add_(1, at, -mine.to(torch::kFloat32).view({-1, 1}));
    real.copy_(g.mul_(row_grad));
    if (v.rows > v.real) logits.narrow(1, v.real, v.rows - v.real).zero_();
  }
  return lse - stats[2 * t];
}

// A (rows, V) buffer for the logits whose rows start `ld` elements apart: a new one, or `*kept` (made there
// when it is missing, too small or of another dtype).
torch::Tensor logits_buffer(int64_t rows, int64_t V, int64_t ld, const torch::TensorOptions& options, torch::Tensor* kept) {
  if (!kept) return torch::empty({rows, ld}, options).narrow(1, 0, V);
  if (!kept->defined() || kept->dtype() != options.dtype() || kept->device() != options.device() || kept->numel() < rows * ld)
    *kept = torch::empty({rows * ld}, options);
  return kept->view(-1).narrow(0, 0, rows * ld).view({rows, ld}).narrow(1, 0, V);
}

// `dw_into` (defined): W's gradient is added into it chunk by chunk by the GEMM, instead of made. `weight_grad`
// false (a frozen head, as under LoRA): x's gradient only, W's neither computed nor held.
// `group` (split): the head's vocabulary rows are this rank's of the group's (vocab_parallel_head_loss).
HeadPass head_pass(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& targets_in,
                   double expected_grad, int64_t chunk_elements, torch::Tensor* kept_logits, bool grads,
                   const torch::Tensor& dw_into = {}, double softcap = 0, bool weight_grad = true, const TensorGroup& group = {}) {
  torch::NoGradGuard no_grad;
  const int64_t N = x.size(0), V = weight.size(0);
  DS_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1) && targets_in.numel() == N,
           "fused head loss: shapes x ", x.sizes(), ", weight ", weight.sizes(), ", targets ", targets_in.sizes());
  const bool host = on_host(x);
  // The batch's targets are checked where they are read from the host (a GPU's kernel makes a row with a bad
  // one NaN rather than stop the queue to look), then copied without waiting. Targets already on a device
  // are looked at there when LibTorch's gather, which has no such guard, would read them.
  const bool split = group.split();
  const int64_t whole_vocab = split ? group.whole_vocab : V;
  DS_CHECK(!split || (group.vocab.rows == V && group.vocab.real >= 1), "vocabulary-parallel head: ", V, " rows where the share has ",
           group.vocab.rows);
  if (N > 0 && (split || on_host(targets_in) || kernel_route(x) != KernelRoute::cuda)) {
    const int64_t lo = targets_in.min().item<int64_t>(), hi = targets_in.max().item<int64_t>();
    DS_CHECK(lo >= 0 && hi < whole_vocab, "token id ", lo < 0 ? lo : hi, " is outside the vocabulary [0, ", whole_vocab,
             "): the data and model.vocab_size disagree");
  }
  const torch::Tensor targets = ids_to_device(targets_in, x.device()).contiguous();
  const torch::Tensor row_losses = host && !split ? torch::Tensor() : torch::empty({N}, x.options().dtype(torch::kFloat32));
  int64_t rows = std::clamp<int64_t>(chunk_elements / std::max<int64_t>(V, 1), 1, std::max<int64_t>(N, 1));
  if (!host && rows > kDeviceRowsAlign) rows = rows / kDeviceRowsAlign * kDeviceRowsAlign;
  const auto parts = vocab_parts(V, host);
  // (the plan's head_workspace_bytes counts this chunk and the weight's gradient)
  const float row_grad = static_cast<float>(expected_grad / static_cast<double>(N));
  HeadPass out;
  if (grads) out.dx = torch::empty_like(x, torch::MemoryFormat::Contiguous);
  const int64_t ld = host ? V : (V + kDeviceRowAlign - 1) / kDeviceRowAlign * kDeviceRowAlign;
  const torch::Tensor buffer = logits_buffer(std::min(rows, N), V, ld, x.options(), kept_logits);
  const torch::Tensor wt = weight.t();
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t n = std::min(rows, N - r0);
    const torch::Tensor xc = x.narrow(0, r0, n);
    torch::Tensor logits = buffer.narrow(0, 0, n);
    for (const auto& [v0, nv] : parts) matmul_into(logits.narrow(1, v0, nv), xc, wt.narrow(1, v0, nv), false);
    torch::Tensor capped;  // tanh(logits / cap) in fp32, for the gradient's factor 1 - tanh^2 (rounded once)
    if (softcap > 0) {
      logits.div_(softcap).tanh_();
      if (grads) capped = logits.to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
      logits.mul_(softcap);
    }
    if (split)
      row_losses.narrow(0, r0, n).copy_(vocab_parallel_cross_entropy(logits, targets.narrow(0, r0, n), row_grad, grads, group));
    else if (host)
      out.loss_sum += chunk_cross_entropy(logits, targets.data_ptr<int64_t>() + r0, row_grad, grads);
    else
      device_chunk_cross_entropy(logits, targets.narrow(0, r0, n), row_grad, grads, row_losses.narrow(0, r0, n));
    if (!grads) continue;
    if (capped.defined()) logits.copy_(capped.square_().neg_().add_(1).mul_(logits));
    torch::Tensor dxc = out.dx.narrow(0, r0, n);
    // (split: a 16-bit dx is rounded once more when the sliver's product is added, at most one step)
    for (size_t i = 0; i < parts.size(); ++i)
      matmul_into(dxc, logits.narrow(1, parts[i].first, parts[i].second), weight.narrow(0, parts[i].first, parts[i].second), i > 0);
    if (!weight_grad) continue;
    // Later chunks add into W's gradient: one rounding per chunk in bf16/fp16 (the GEMM adds in fp32).
    if (!dw_into.defined() && r0 == 0) out.dw = torch::empty({V, x.size(1)}, x.options());
    const torch::Tensor& dw = dw_into.defined() ? dw_into : out.dw;
    const bool add = dw_into.defined() || r0 > 0;
    for (const auto& [v0, nv] : parts) matmul_into(dw.narrow(0, v0, nv), logits.narrow(1, v0, nv).t(), xc, add);
  }
  if (split && host)
    out.loss_sum = row_losses.sum(torch::kFloat64).item<double>();
  else if (!host)
    out.device_loss_sum = row_losses.sum(torch::kFloat64);
  return out;
}

// The mean loss as an fp32 scalar: on the host, or on the device where it was summed (read when wanted).
torch::Tensor mean_loss(const HeadPass& pass, int64_t rows) {
  if (pass.device_loss_sum.defined()) return (pass.device_loss_sum / static_cast<double>(rows)).to(torch::kFloat32);
  return torch::tensor(static_cast<float>(pass.loss_sum / static_cast<double>(rows)), torch::kFloat32);
}

class FusedHeadLoss : public torch::autograd::Function<FusedHeadLoss> {
 public:
  // W's gradient goes straight into its bound buffer (ds's flat gradients) during forward, where the
  // logits' gradient exists: no V x C tensor kept until backward and then added by autograd. ZeRO's
  // exchange finishes any reduction of those buffers before the head runs (ZeroExchange::after_forward).
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& targets, double expected_grad, int64_t chunk_elements,
                               torch::Tensor* kept_logits, double softcap, const TensorGroup* group) {
    const torch::Tensor into = weight.requires_grad() ? bound_gradient(weight) : torch::Tensor();
    HeadPass pass = head_pass(x, weight, targets, expected_grad, chunk_elements, kept_logits, true, into, softcap, weight.requires_grad(),
                              *group);
    ctx->saved_data["dx"] = pass.dx;
    ctx->saved_data["dw"] = pass.dw;
    ctx->saved_data["dw_in_buffer"] = into.defined();
    ctx->saved_data["expected"] = expected_grad;
    return mean_loss(pass, x.size(0));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    torch::Tensor dx = ctx->saved_data["dx"].toTensor(), dw = ctx->saved_data["dw"].toTensor();
    ctx->saved_data.erase("dx");
    ctx->saved_data.erase("dw");
    // The gradients were made for the expected one; anything else (a loss used twice, another scale)
    // rescales them -- which W's gradient, already in its buffer, cannot be.
    const float expected = static_cast<float>(ctx->saved_data["expected"].toDouble());
    if (!on_host(grad_out[0])) {
      // On a GPU the loss's gradient stays there (reading it would stop the queue): the input's gradient is
      // rescaled by got / expected there (by 1 when used as meant); W's, already in its buffer, is trusted.
      // (an fp32 0-dim factor: dx keeps its dtype, the factor is not rounded to it)
      const torch::Tensor factor = (grad_out[0].to(torch::kFloat64) / static_cast<double>(expected)).to(torch::kFloat32);
      dx = dx * factor;
      if (dw.defined()) dw = dw * factor;
      return {dx, dw, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
    const float got = grad_out[0].item<float>();
    if (got != expected) {
      DS_CHECK(!ctx->saved_data["dw_in_buffer"].toBool(), "fused head loss: the weight's gradient went into its buffer for a loss gradient of ",
               expected, ", but ", got, " arrived (set_loss_gradient before the forward)");
      const double factor = static_cast<double>(got) / static_cast<double>(expected);
      dx = dx * factor;
      if (dw.defined()) dw = dw * factor;
    }
    return {dx, dw, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

int64_t head_product_vocab(int64_t vocab, bool host) { return vocab_parts(vocab, host).front().second; }

namespace {
torch::Tensor head_loss_over(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& targets, double expected_grad,
                             int64_t chunk_elements, torch::Tensor* kept_logits, double softcap, const TensorGroup& group) {
  DS_CHECK(expected_grad != 0, "fused head loss: the expected gradient must be nonzero");
  if (torch::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad()))
    return FusedHeadLoss::apply(x, weight, targets, expected_grad, chunk_elements, kept_logits, softcap, &group);
  const HeadPass pass = head_pass(x, weight, targets, expected_grad, chunk_elements, kept_logits, false, {}, softcap, true, group);
  return mean_loss(pass, x.size(0));
}
}  // namespace

torch::Tensor fused_head_loss(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& targets,
                              double expected_grad, int64_t chunk_elements, torch::Tensor* kept_logits, double softcap) {
  return head_loss_over(x, weight, targets, expected_grad, chunk_elements, kept_logits, softcap, TensorGroup{});
}

torch::Tensor vocab_parallel_head_loss(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& targets,
                                       const TensorGroup& group, double expected_grad, int64_t chunk_elements,
                                       torch::Tensor* kept_logits, double softcap) {
  return head_loss_over(x, weight, targets, expected_grad, chunk_elements, kept_logits, softcap, group);
}

}  // namespace ds
