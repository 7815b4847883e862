#include "schema/config.hpp"

namespace ds {

const char* dtype_name(Dtype d) {
  switch (d) {
    case Dtype::fp32: return "fp32";
    case Dtype::fp16: return "fp16";
    case Dtype::bf16: return "bf16";
  }
  return "?";
}

int dtype_bytes(Dtype d) { return d == Dtype::fp32 ? 4 : 2; }

const char* offload_device_name(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::none: return "none";
    case OffloadDevice::cpu: return "cpu";
    case OffloadDevice::nvme: return "nvme";
  }
  return "?";
}

const char* optimizer_type_name(OptimizerType t) {
  switch (t) {
    case OptimizerType::Adam: return "Adam";
    case OptimizerType::AdamW: return "AdamW";
    case OptimizerType::SGD: return "SGD";
    case OptimizerType::Lamb: return "Lamb";
  }
  return "?";
}

const char* scheduler_type_name(SchedulerType t) {
  switch (t) {
    case SchedulerType::None: return "none";
    case SchedulerType::WarmupLR: return "WarmupLR";
    case SchedulerType::WarmupDecayLR: return "WarmupDecayLR";
    case SchedulerType::WarmupCosineLR: return "WarmupCosineLR";
    case SchedulerType::OneCycle: return "OneCycle";
    case SchedulerType::LRRangeTest: return "LRRangeTest";
  }
  return "?";
}

const char* rope_type_name(RopeType t) {
  switch (t) {
    case RopeType::none: return "default";
    case RopeType::linear: return "linear";
    case RopeType::dynamic: return "dynamic";
    case RopeType::llama3: return "llama3";
    case RopeType::yarn: return "yarn";
    case RopeType::longrope: return "longrope";
  }
  return "?";
}

const char* data_type_name(DataType t) {
  switch (t) {
    case DataType::synthetic: return "synthetic";
    case DataType::text: return "text";
    case DataType::tokens: return "tokens";
    case DataType::hdf5: return "hdf5";
    case DataType::jsonl: return "jsonl";
  }
  return "?";
}

}  // namespace ds
