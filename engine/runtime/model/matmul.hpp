// ds — the products of the linear layers and the head, fp32 through oneDNN's sgemm where ds was built
// with it. On Zen 4 it runs the models' shapes 9-16% faster than OpenBLAS, which LibTorch 1.13 calls for
// fp32 (bench/RESULTS.md), and on ds's own OpenMP threads instead of OpenBLAS's worker. Other dtypes,
// and builds without oneDNN, go through LibTorch as before.
#pragma once

#include <torch/torch.h>

namespace ds {

// c = a b, or c += a b with `accumulate`; a and b 2-D, each row-major or the transpose of a row-major
// matrix (x.t(), a narrowed chunk of rows); c row-major.
void matmul_into(const torch::Tensor& c, const torch::Tensor& a, const torch::Tensor& b, bool accumulate);
// A new a b.
torch::Tensor matmul_new(const torch::Tensor& a, const torch::Tensor& b);

}  // namespace ds
