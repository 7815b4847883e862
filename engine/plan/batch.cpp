#include "engine/plan/batch.hpp"

#include "common/error.hpp"

namespace ds {
namespace {

std::string s(int64_t v) { return std::to_string(v); }

[[noreturn]] void fail(const std::string& path, const std::string& msg, const BatchInputs& in) {
  throw ConfigError("batch size", {{path, msg, in.world_name + " " + std::to_string(in.world_size) + " comes from " +
                                                   in.world_size_source + "; the three keys must satisfy "
                                                   "train_batch_size = micro x accumulation x " + in.world_name}});
}

}  // namespace

ResolvedBatch resolve_batch(const BatchInputs& in) {
  ResolvedBatch r;
  const int64_t W = in.world_size;
  r.world_size = in.world_size;
  const auto& TB = in.train_batch_size;
  const auto& MB = in.micro_batch;
  const auto& GA = in.grad_accum;
  if (TB && MB && GA) {
    if (*TB != *MB * *GA * W)
      fail("train_batch_size",
           "train_batch_size " + s(*TB) + " != micro " + s(*MB) + " x accumulation " + s(*GA) + " x " + in.world_name + " " + s(W) +
               " = " + s(*MB * *GA * W),
           in);
    r = {*TB, *MB, *GA, in.world_size, "all three given"};
  } else if (TB && MB) {
    if (*TB % (*MB * W) != 0)
      fail("train_batch_size",
           "train_batch_size " + s(*TB) + " is not divisible by micro " + s(*MB) + " x " + in.world_name + " " + s(W) + " = " +
               s(*MB * W) + " (it would need accumulation " + s(*TB) + " / " + s(*MB * W) + ")",
           in);
    r = {*TB, *MB, *TB / (*MB * W), in.world_size,
         "gradient_accumulation_steps = " + s(*TB) + " / (" + s(*MB) + " x " + s(W) + ") = " + s(*TB / (*MB * W))};
  } else if (TB && GA) {
    if (*TB % (*GA * W) != 0)
      fail("train_batch_size",
           "train_batch_size " + s(*TB) + " is not divisible by accumulation " + s(*GA) + " x " + in.world_name + " " + s(W) + " = " +
               s(*GA * W),
           in);
    r = {*TB, *TB / (*GA * W), *GA, in.world_size,
         "train_micro_batch_size_per_gpu = " + s(*TB) + " / (" + s(*GA) + " x " + s(W) + ") = " + s(*TB / (*GA * W))};
  } else if (MB && GA) {
    r = {*MB * *GA * W, *MB, *GA, in.world_size,
         "train_batch_size = " + s(*MB) + " x " + s(*GA) + " x " + s(W) + " = " + s(*MB * *GA * W)};
  } else if (TB) {
    if (*TB % W != 0)
      fail("train_batch_size", "train_batch_size " + s(*TB) + " is not divisible by " + in.world_name + " " + s(W), in);
    r = {*TB, *TB / W, 1, in.world_size,
         "gradient_accumulation_steps = 1; train_micro_batch_size_per_gpu = " + s(*TB) + " / " + s(W) + " = " + s(*TB / W)};
  } else if (MB) {
    r = {*MB * W, *MB, 1, in.world_size,
         "gradient_accumulation_steps = 1; train_batch_size = " + s(*MB) + " x " + s(W) + " = " + s(*MB * W)};
  } else {
    throw ConfigError("batch size", {{"train_batch_size",
                                      "either train_batch_size or train_micro_batch_size_per_gpu needs to be provided",
                                      "e.g. \"train_micro_batch_size_per_gpu\": 4, or \"auto\" to take the largest that fits"}});
  }
  return r;
}

}  // namespace ds
