// ds convert-ckpt: weights out of ds (a consolidated safetensors file, or a Hugging Face directory)
// from a checkpoint of any ZeRO stage and world size, a Hugging Face directory into a ds run at step 0,
// and `--info` on any checkpoint or weights file.
#pragma once

#include "cli/common.hpp"

namespace ds::cli {

Subcommand setup_convert_ckpt(CLI::App& app);

}  // namespace ds::cli
