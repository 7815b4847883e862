// The entry point of libds_train.so: the LibTorch half of ds, loaded by runtime_library.cpp.
#include "engine/runtime/run/trainer.hpp"

extern "C" __attribute__((visibility("default"))) void ds_runtime_train(const ds::Plan* plan, const ds::TrainOptions* options,
                                                                         ds::TrainResult* result) {
  *result = ds::train(*plan, *options);
}
