// ds — the LibTorch half of ds, loaded when a command first needs it. `ds plan`, `ds estimate-memory`
// and `ds env` never load LibTorch (its libraries take ~0.5 s to map and relocate, more on a busy
// machine), so scripts can call them in loops; `ds train` loads libds_train.so (the trainer, the
// models, c10d) once, by dlopen. No LibTorch type crosses this header.
#pragma once

#include <string>

#include "engine/runtime/run/trainer_api.hpp"

namespace ds {

// train(plan, config, options) from libds_train.so. The library is looked up beside the running binary,
// then in ../lib/ds/ (an installed ds), or where DS_RUNTIME_LIBRARY says; throws std::runtime_error
// naming every place tried when it is in none. Exceptions thrown by the trainer pass through.
TrainResult train_with_runtime(const Plan& plan, const TrainOptions& options);

// Where the library was found ("" before the first load), for `ds --version`.
std::string runtime_library_path();

}  // namespace ds
