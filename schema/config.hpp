// ds — the typed, validated, defaults-filled config. Produced only by load_config (schema/loader.hpp);
// everything downstream reads this, never JSON. Defaults live in ds_config.schema.json, not here:
// member initialisers below are neutral values that the loader always overwrites.
//
// "auto": a std::optional member that is empty means the user wrote "auto" (or, for the batch keys,
// left the key out). The plan compiler resolves every one and records the value and its source.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/error.hpp"

namespace ds {

enum class Dtype { fp32, fp16, bf16 };
const char* dtype_name(Dtype d);
int dtype_bytes(Dtype d);

enum class OffloadDevice { none, cpu, nvme };
const char* offload_device_name(OffloadDevice d);

struct OffloadConfig {
  OffloadDevice device = OffloadDevice::none;
  std::string nvme_path;
  int64_t buffer_count = 0;
  int64_t buffer_size = 0;    // elements (offload_param only)
  int64_t max_in_cpu = 0;     // elements (offload_param only)
  bool pin_memory = false;
  double ratio = 1.0;         // offload_optimizer only
  bool pipeline_read = false, pipeline_write = false;  // offload_optimizer, NVMe: overlap swaps with the step
  bool speculative_step = false;  // offload_optimizer: step each final tile during the last backward (ZeroExecution::step_in_backward)
};

// The `aio` block: how NVMe swaps are issued.
struct AioConfig {
  int64_t block_size = 1 << 20;  // bytes per request
  int64_t queue_depth = 8;       // requests in flight
  bool single_submit = false;    // submit each request on its own rather than a sub-group's at once
};

struct ZeroConfig {
  std::optional<int> stage;                  // empty: "auto" (lowest stage that fits)
  bool contiguous_gradients = false;
  std::optional<bool> reduce_scatter;            // empty: true
  std::optional<int64_t> reduce_bucket_size;      // elements; empty: auto
  bool allgather_partitions = false;
  std::optional<int64_t> allgather_bucket_size;   // elements
  std::optional<bool> overlap_comm;               // empty: true at stage 3, else false
  bool load_from_fp32_weights = false;
  OffloadConfig offload_optimizer;
  OffloadConfig offload_param;
  AioConfig aio;  // the top-level `aio` block, kept with the offload it serves
  std::optional<int64_t> sub_group_size;
  std::optional<int64_t> prefetch_bucket_size;        // stage3_prefetch_bucket_size
  std::optional<int64_t> param_persistence_threshold; // stage3_param_persistence_threshold
  int64_t model_persistence_threshold = 0;
  std::optional<int64_t> max_live_parameters;
  std::optional<int64_t> max_reuse_distance;
  bool gather_16bit_weights_on_model_save = false;
  bool ignore_unused_parameters = false;
};

enum class OptimizerType { Adam, AdamW, SGD, Lamb };
const char* optimizer_type_name(OptimizerType t);

struct OptimizerConfig {
  bool given = false;  // false: no optimizer block; ds uses the schema's default type
  OptimizerType type = OptimizerType::AdamW;
  std::optional<double> lr, eps, weight_decay;  // empty: auto
  std::optional<std::array<double, 2>> betas;
  bool bias_correction = false;
  bool adam_w_mode = false;
  double momentum = 0, dampening = 0;
  bool nesterov = false;
  bool eps_inside_sqrt = false;
  double max_coeff = 0, min_coeff = 0;
};

enum class SchedulerType { None, WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest };
const char* scheduler_type_name(SchedulerType t);

struct SchedulerConfig {
  SchedulerType type = SchedulerType::None;
  // Warmup family. Empty optionals: "auto" (or null where the schema allows it).
  std::optional<double> warmup_min_lr, warmup_max_lr;
  std::optional<int64_t> warmup_num_steps, total_num_steps;
  bool warmup_max_lr_null = false;  // WarmupLR: null means "the optimizer's lr"
  std::string warmup_type;          // "log" | "linear"
  double warmup_min_ratio = 0, cos_min_ratio = 0;
  // OneCycle
  double cycle_min_lr = 0, cycle_max_lr = 0, decay_lr_rate = 0;
  int64_t cycle_first_step_size = 0, decay_step_size = 0;
  std::optional<int64_t> cycle_second_step_size, cycle_first_stair_count, cycle_second_stair_count;
  bool cycle_momentum = false;
  double cycle_min_mom = 0, cycle_max_mom = 0, decay_mom_rate = 0;
  // LRRangeTest
  double lr_range_test_min_lr = 0, lr_range_test_step_rate = 0;
  int64_t lr_range_test_step_size = 0;
  bool lr_range_test_staircase = false;
};

struct Fp16Config {
  std::optional<bool> enabled;  // empty: auto
  double loss_scale = 0;        // 0: dynamic
  int initial_scale_power = 0;
  int64_t loss_scale_window = 0;
  int hysteresis = 0;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 0;
};

struct Bf16Config {
  std::optional<bool> enabled;  // empty: auto
  bool check_grad_overflow = false;
};

enum class ModelArch { gpt2, llama, mistral, qwen2, qwen3, phi3, gemma, gemma2 };
// Every architecture ds builds: configs, plans and checkpoints spell them by model_arch_name, and
// ds_config.schema.json's model.arch lists the same names (a test holds them equal). What each one is
// (positions, norms, biases, Hugging Face's names...) is its row in schema/arch.hpp: a new architecture
// is a row there and its tests, never an else branch that maps it to another.
inline constexpr std::array<ModelArch, 8> kModelArchs{ModelArch::gpt2,  ModelArch::llama, ModelArch::mistral, ModelArch::qwen2,
                                                      ModelArch::qwen3, ModelArch::phi3,  ModelArch::gemma,   ModelArch::gemma2};
const char* model_arch_name(ModelArch a);
// The architecture a name spells, or none.
std::optional<ModelArch> model_arch_from_name(const std::string& name);

// Rotary position scaling, as Hugging Face's rope_scaling describes it: how the rotary frequencies are
// stretched for a context longer than the one a model was trained at. none: plain rope_theta frequencies.
// The arithmetic is engine/plan/rope.hpp's.
enum class RopeType { none, linear, dynamic, llama3, yarn, longrope };
const char* rope_type_name(RopeType t);
struct RopeScaling {
  RopeType type = RopeType::none;
  double factor = 1;                                    // linear, dynamic, llama3, yarn
  double low_freq_factor = 1, high_freq_factor = 4;      // llama3
  int64_t original_max_position_embeddings = 0;          // llama3: the context the frequencies were trained at
  std::optional<double> attention_factor, beta_fast, beta_slow;  // yarn (defaults: 0.1 ln(factor) + 1, 32, 1); longrope's factor
  // longrope (Phi-3's long-context models): each frequency divided by its factor, the short list's up to
  // original_max_position_embeddings positions and the long list's past them.
  std::vector<double> short_factor, long_factor;
  bool operator==(const RopeScaling& o) const {
    return type == o.type && factor == o.factor && low_freq_factor == o.low_freq_factor && high_freq_factor == o.high_freq_factor &&
           original_max_position_embeddings == o.original_max_position_embeddings && attention_factor == o.attention_factor &&
           beta_fast == o.beta_fast && beta_slow == o.beta_slow && short_factor == o.short_factor && long_factor == o.long_factor;
  }
  bool operator!=(const RopeScaling& o) const { return !(*this == o); }
};

// Hyperparameters that may come from a preset, a Hugging Face config.json, or explicit keys.
// Each is optional so the three sources can be layered (preset < hf_config < explicit).
struct ModelFields {
  std::optional<ModelArch> arch;
  std::optional<int64_t> vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
      max_position_embeddings, head_dim;
  std::optional<bool> tie_word_embeddings, attention_bias, mlp_bias;
  std::optional<int64_t> sliding_window;  // 0: given as none (null)
  std::optional<double> attn_logit_softcapping, final_logit_softcapping, query_pre_attn_scalar;  // 0: given as none
  std::optional<double> norm_eps, rope_theta;
  std::optional<RopeScaling> rope_scaling;  // given as null: RopeType::none
  std::optional<double> attn_pdrop, resid_pdrop, embd_pdrop;
  std::optional<int64_t> bos_token_id;                // -1: given as none (null)
  std::optional<std::vector<int64_t>> eos_token_id;  // empty: given as none
};

// model.lora: a low-rank adapter trained in place of the base weights (engine/plan/lora.hpp).
enum class LoraInit { kaiming_uniform, gaussian };
// target_modules "all-linear" (PEFT's shorthand): every projection of the architecture, resolved by the plan.
inline constexpr const char* kAllLinear = "all-linear";
struct LoraConfig {
  bool enabled = false;
  int64_t r = 8;
  double alpha = 8, dropout = 0;
  std::vector<std::string> target_modules;  // empty: the architecture's default; {kAllLinear}: all its projections
  LoraInit init = LoraInit::kaiming_uniform;
  std::vector<int64_t> layers_to_transform;  // PEFT's: the blocks whose projections get an adapter (empty: every block)
};

struct ModelConfig {
  std::string preset;       // "" when none
  std::string hf_config;    // path, "" when none
  ModelFields from_hf;      // filled by the loader from hf_config
  ModelFields explicit_fields;
  bool activation_checkpointing = false;
  std::string init_from;    // "" when none
  LoraConfig lora;
  std::vector<std::string> freeze;  // model.freeze: tensor name patterns
  bool given = false;       // false: no model block at all
};

enum class DataType { synthetic, text, tokens, hdf5, jsonl };
const char* data_type_name(DataType t);

struct DataConfig {
  DataType type = DataType::synthetic;
  std::string path, tokenizer, vocab_file, merges_file, token_format, dataset;
  std::string tokenizer_path, chat_template = "auto";  // tokenizer hf; jsonl's conversations
  bool train_on_prompt = false;                        // jsonl: the loss counts the prompts too
  bool packing = false;                                // jsonl: several samples a row (engine/plan/packing.hpp)
  std::string val_path;                                // jsonl: the validation samples' file ("" : val_fraction of path)
  bool skip_bad_lines = false;                         // jsonl: a line that is no sample is skipped and counted
  std::optional<bool> tokens_in_memory;                // jsonl: empty = auto (in memory when they take under a quarter of it)
  std::optional<int64_t> seq_len;  // empty: auto (the model's context length)
  double val_fraction = 0;
  bool shuffle = true;  // false: samples in stream order (BatchSampler)
  // Not keys: the data's size, measured by the command before it compiles the plan (train.epochs needs it):
  // in tokens for a token stream, in samples (rows) for jsonl; empty when not measured.
  std::optional<int64_t> measured_tokens;
  std::optional<int64_t> measured_samples;
  std::vector<int64_t> measured_sample_tokens;  // jsonl with packing: each sample's tokens (the rows depend on seq_len)
};

struct TrainConfig {
  int64_t steps = 0, eval_every = 0, eval_batches = 0, save_every = 0, keep_last = 0, seed = 0;
  double divergence_factor = 4;
  std::string output_dir;
  std::optional<int64_t> threads;  // empty: auto
  std::string resume;              // "false" | "auto" | a path
  double comm_timeout_s = 600;     // collectives and rendezvous
  bool decay_all_params = false;   // weight_decay_params "all"; "matrices": never biases or norm weights
  std::optional<double> epochs;    // steps from passes over the training split (the plan resolves them)
};

struct MonitorConfig {
  bool enabled = false;
  std::string output_path, job_name;
};

// DeepSpeed's flops_profiler block: ds train prints ds profile's report of step `profile_step`.
struct FlopsProfilerConfig {
  bool enabled = false;
  int64_t profile_step = 1;
  int module_depth = -1;  // -1: every depth
  int64_t top_modules = 1;
  bool detailed = true;   // the per-module table
  std::string output_file;  // "": standard output
};

// The model split over ranks (engine/plan/mesh.hpp), in DeepSpeed's terms: tensor_parallel.autotp_size and
// the pipeline block. 1 and 1: data parallel alone.
struct ParallelConfig {
  int tensor = 1;    // tensor_parallel.autotp_size
  int pipeline = 1;  // pipeline.stages ("auto": 1)
  std::string partition = "parameters";  // pipeline.partition as given: "parameters", "uniform", "best", "type:..."
  int64_t checkpoint_interval = 0;        // pipeline.activation_checkpoint_interval: blocks recomputed together (0: none)
};

struct Config {
  std::optional<int64_t> train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps;
  bool micro_batch_auto = false;  // train_micro_batch_size_per_gpu was literally "auto"

  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  Fp16Config fp16;
  Bf16Config bf16;
  ZeroConfig zero;
  std::optional<Dtype> grad_accum_dtype, communication_data_type;
  std::optional<double> gradient_clipping;  // empty: auto
  bool gradient_allreduce_sum = false;      // gradient_allreduce_op "sum": ranks' gradients summed, not averaged

  std::optional<int64_t> steps_per_print;   // empty: null
  bool wall_clock_breakdown = false;
  MonitorConfig tensorboard, csv_monitor;
  bool comms_logger_enabled = false;
  FlopsProfilerConfig flops_profiler;
  // Not a key: the command measures each step's work within it (ds profile), as the flops_profiler block does.
  bool steps_measured_alone = false;

  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  ParallelConfig parallel;

  // Where the config came from and what the loader noticed.
  std::string source;                          // file path, or "<name>" for embedded configs
  std::vector<ConfigIssue> warnings;           // ignored keys, deprecated spellings, ...
  std::map<std::string, std::string> value_source;  // JSON path -> "file" | "override" | "default" | "init_from"
  std::map<std::string, std::string> auto_defaults; // JSON path -> the default an "auto" there became
};

}  // namespace ds
