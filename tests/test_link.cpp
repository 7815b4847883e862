// Errors crossing between LibTorch and ds under the GPU build's link: libstdc++ bound statically into the binary
// and hidden, LibTorch's own C++ library beside it (CMakeLists.txt, DS_STATIC_STDCXX_OPTIONS). This binary is
// linked that way in every build, so CI checks what the GPU machine runs: when the binary also carried a private
// unwinder (-static-libgcc), every error LibTorch threw aborted the process before ds's handler saw it (a store's
// timeout, a bad shape, the GPU's out-of-memory), where ds means to print what went wrong and what to do.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <stdexcept>
#include <string>

namespace {

// What `call` throws, as ds's handlers catch it ("" when it returns).
template <typename Call>
std::string caught(Call call) {
  try {
    call();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// A step of autograd that fails in ds's code while LibTorch's engine runs it.
struct FailingBackward : torch::autograd::Function<FailingBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x * 2; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, const torch::autograd::variable_list&) {
    throw std::runtime_error("ds's backward gave up");
  }
};

}  // namespace

TEST(LinkedWithLibTorch, AnErrorLibTorchThrowsReachesDsHandlerWithItsMessage) {
  const std::string what = caught([] { torch::zeros({2}).view({3}); });
  EXPECT_NE(what.find("shape '[3]' is invalid for input of size 2"), std::string::npos) << what;
}

TEST(LinkedWithLibTorch, LibTorchsOwnErrorTypeIsRecognisedHere) {
  bool as_c10 = false;
  try {
    torch::ones({2, 3}).matmul(torch::ones({2, 3}));
  } catch (const c10::Error& e) {
    as_c10 = true;
    EXPECT_NE(std::string(e.what()).find("cannot be multiplied"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(as_c10);
}

TEST(LinkedWithLibTorch, DsErrorInsideLibTorchsAutogradComesBackToTheCaller) {
  const torch::Tensor x = torch::ones({4}, torch::requires_grad());
  const std::string what = caught([&] { FailingBackward::apply(x).sum().backward(); });
  EXPECT_NE(what.find("ds's backward gave up"), std::string::npos) << what;
}
