// Packed rows (data.packing) as the model computes them: a packed batch gives the loss and every gradient of
// its samples run one by one, for each family (learned and rotary positions, windows, per-head norms, fused
// projections), with the blocks kept or recomputed in backward.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "engine/runtime/data/sampler.hpp"
#include "engine/runtime/device/device.hpp"
#include "engine/runtime/model/language_model.hpp"
#include "engine/runtime/run/flat_params.hpp"
#include "test_helpers.hpp"

using namespace ds;

namespace {

const char* kConfig = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
  "bf16": {"enabled": false}, "model": {"preset": "llama-tiny"}, "data": {"type": "synthetic", "seq_len": 16},
  "train": {"steps": 1, "eval_every": 0, "threads": 1, "seed": 3}})";

}  // namespace

// Two rows of 16 positions: [5 | 7 | 4] and [6 | 3 | 7 of padding]; then rows of one sample each, [9 | 7 of
// padding] and [16], which only length-dependent rotary scaling tells from plain rows. Each sample alone (one
// row of its own length) with the gradient its share of the counted targets gives: their sum is the packed
// batch's loss and gradients, to 1e-5 in fp32, whether the blocks are kept or recomputed in backward.
TEST(Packing, APackedBatchGivesTheLossesAndGradientsOfItsSamplesRunOneByOne) {
  const std::vector<std::vector<std::string>> families = {
      {"model.preset=gpt2-tiny"},
      {"model.preset=llama-tiny"},
      {"model.preset=mistral-tiny", "model.sliding_window=3"},
      {"model.preset=qwen3-tiny"},
      {"model.preset=gemma2-tiny", "model.sliding_window=4"},
      {"model.preset=phi3-tiny"},
      {"model.preset=llama-tiny", "model.activation_checkpointing=true"},
      // dynamic scaling stretches the row's 16 positions past a context of 8, not a sample's own
      {"model.preset=llama-tiny", "model.max_position_embeddings=8", R"(model.rope_scaling={"rope_type": "dynamic", "factor": 2})"},
  };
  const std::vector<RowSegments> layouts = {{{5, 7, 4}, {6, 3, -7}}, {{9, -7}, {16}}};  // negative: padding
  for (const auto& overrides : families)
  for (size_t layout = 0; layout < layouts.size(); ++layout) {
    SCOPED_TRACE(overrides.back() + ", layout " + std::to_string(layout));
    const RowSegments& segments = layouts[layout];
    const Plan plan = test::plan_of(kConfig, 1, 0, overrides);
    auto device = Device::create(DeviceKind::cpu, 0);
    FlatParams flat = FlatParams::allocate(plan, 0, *device);
    torch::manual_seed(7);
    {
      torch::NoGradGuard ng;
      initialise_model(plan, flat.params, 5);
      flat.params.add_(torch::randn_like(flat.params), 0.05);
    }
    auto model = make_model(plan, flat);
    const torch::Tensor in = torch::randint(0, 256, {2, 16}, torch::kLong);
    torch::Tensor tgt = torch::randint(0, 256, {2, 16}, torch::kLong);
    tgt[0].narrow(0, 0, 2).fill_(-1);  // a prompt
    for (int64_t b = 0; b < 2; ++b) {
      int64_t start = 0;
      for (const int64_t length : segments[static_cast<size_t>(b)]) {
        if (length < 0) tgt[b].narrow(0, start, -length).fill_(-1);  // the padding
        start += std::abs(length);
      }
    }
    const double counted = static_cast<double>((tgt >= 0).sum().item<int64_t>());
    flat.grads.zero_();
    model->set_segments(&segments);
    model->set_loss_gradient(1.0);
    const torch::Tensor packed_loss = model->loss(in, tgt);
    packed_loss.backward();
    const torch::Tensor packed_grads = flat.grads.clone();
    ASSERT_GT(packed_grads.abs().max().item<double>(), 0.0);
    // One by one.
    model->set_segments(nullptr);
    flat.grads.zero_();
    double sum = 0;
    for (int64_t b = 0; b < 2; ++b) {
      int64_t start = 0;
      for (const int64_t length : segments[static_cast<size_t>(b)]) {
        const int64_t L = std::abs(length);
        const torch::Tensor i = in[b].narrow(0, start, L).unsqueeze(0), t = tgt[b].narrow(0, start, L).unsqueeze(0);
        start += L;
        const double n = static_cast<double>((t >= 0).sum().item<int64_t>());
        if (n == 0) continue;
        model->set_loss_gradient(n / counted);
        const torch::Tensor loss = model->loss(i, t);
        (loss * (n / counted)).backward();
        sum += loss.item<double>() * n;
      }
    }
    EXPECT_NEAR(packed_loss.item<double>(), sum / counted, 1e-5 * sum / counted);
    const double scale = packed_grads.abs().max().item<double>();
    EXPECT_LT((packed_grads - flat.grads).abs().max().item<double>() / scale, 1e-5);
    // Packing acted: the same rows attended to whole give another loss.
    torch::NoGradGuard ng;
    if (layout == 0) {
      EXPECT_GT(std::fabs(model->loss(in, tgt).item<double>() - packed_loss.item<double>()), 1e-4);
    }
  }
}
