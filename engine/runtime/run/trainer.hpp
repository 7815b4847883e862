// ds — the training loop: executes a Plan on one process. It re-decides nothing: batch sizes,
// precision, layout, schedule and thread count all come from the Plan. The header carries no LibTorch
// types, so cli/ stays free of it.
//
// This build trains gpt2 and llama models in fp32 or bf16 with Adam/AdamW on one process, saves
// checkpoints (engine/runtime/io/checkpoint.hpp) every train.save_every steps, at the end and on Ctrl-C,
// and resumes from one exactly: in fp32 on the CPU, N steps + resume + N steps == 2N steps, bit for bit.
// Checks at start (before any work) reject what it cannot do yet, with exit code 2 and the reason.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/plan/plan.hpp"
#include "engine/runtime/run/trainer_api.hpp"

namespace ds {

// Throws UserError for configurations this trainer cannot run (exit 2), std::runtime_error when the
// run fails (exit 1). Progress goes to stderr.
TrainResult train(const Plan& plan, const TrainOptions& options);

// The same with the ranks' communicator given (LocalGroup's threads in tests; a future backend): the
// plan's topology must name the same rank and world size. Null on one rank. `device`: the device to train
// on (borrowed; tests hand in one that checks and counts), or null for the plan's.
class Communicator;
class Device;
TrainResult train(const Plan& plan, const TrainOptions& options, Communicator* comm, Device* device = nullptr);

}  // namespace ds
