// The validated, defaults-filled JSON -> the typed Config, plus the checks that involve more than one
// key. After validation every key read here exists and has the schema's type, so a failed lookup is
// a bug in ds (DS_CHECK), not a user error.
#include <cmath>

#include "schema/rope_scaling.hpp"
#include "schema/loader_internal.hpp"

namespace ds::loader {
namespace {

const json& at(const json& j, const char* key) {
  DS_CHECK(j.is_object() && j.contains(key), "key '", key, "' missing after defaults were filled");
  return j[key];
}

bool is_auto(const json& v) { return v.is_string() && v.get<std::string>() == "auto"; }

std::optional<int64_t> opt_int(const json& v) {
  if (v.is_null() || is_auto(v)) return std::nullopt;
  return static_cast<int64_t>(std::llround(v.get<double>()));  // 5e8 is accepted for integers, as in DeepSpeed
}
std::optional<double> opt_num(const json& v) {
  if (v.is_null() || is_auto(v)) return std::nullopt;
  return v.get<double>();
}
std::optional<bool> opt_bool(const json& v) {
  if (v.is_null() || is_auto(v)) return std::nullopt;
  return v.get<bool>();
}
std::string str_or_empty(const json& v) { return v.is_string() ? v.get<std::string>() : std::string(); }

std::optional<Dtype> read_dtype(const json& v) {
  if (v.is_null()) return std::nullopt;
  const std::string s = v.get<std::string>();
  if (s == "fp32" || s == "float32" || s == "float") return Dtype::fp32;
  if (s == "fp16" || s == "float16" || s == "half") return Dtype::fp16;
  return Dtype::bf16;
}

OffloadDevice read_device(const json& v) {
  const std::string s = v.get<std::string>();
  return s == "cpu" ? OffloadDevice::cpu : s == "nvme" ? OffloadDevice::nvme : OffloadDevice::none;
}

OffloadConfig read_offload(const json& block, bool param) {
  OffloadConfig o;
  if (block.is_null()) return o;
  o.device = read_device(at(block, "device"));
  o.nvme_path = str_or_empty(at(block, "nvme_path"));
  o.buffer_count = at(block, "buffer_count").get<int64_t>();
  o.pin_memory = at(block, "pin_memory").get<bool>();
  if (param) {
    o.buffer_size = static_cast<int64_t>(at(block, "buffer_size").get<double>());
    o.max_in_cpu = static_cast<int64_t>(at(block, "max_in_cpu").get<double>());
  } else {
    o.ratio = at(block, "ratio").get<double>();
    o.pipeline_read = at(block, "pipeline_read").get<bool>();
    o.pipeline_write = at(block, "pipeline_write").get<bool>();
    o.speculative_step = at(block, "speculative_step").get<bool>();
  }
  return o;
}

ModelFields read_model_fields(const json& m) {
  ModelFields f;
  if (m.contains("arch")) {  // the schema admits only the registry's names
    f.arch = model_arch_from_name(m["arch"].get<std::string>());
    DS_CHECK(f.arch.has_value(), "model.arch ", m["arch"].dump(), " passed validation but is no architecture ds knows");
  }
  auto i = [&](const char* k, std::optional<int64_t>& out) {
    if (m.contains(k)) out = m[k].get<int64_t>();
  };
  i("vocab_size", f.vocab_size);
  i("hidden_size", f.hidden_size);
  i("num_layers", f.num_layers);
  i("num_heads", f.num_heads);
  i("num_kv_heads", f.num_kv_heads);
  i("intermediate_size", f.intermediate_size);
  i("max_position_embeddings", f.max_position_embeddings);
  i("head_dim", f.head_dim);
  if (m.contains("sliding_window")) f.sliding_window = m["sliding_window"].is_null() ? 0 : m["sliding_window"].get<int64_t>();
  if (m.contains("attention_bias")) f.attention_bias = m["attention_bias"].get<bool>();
  if (m.contains("mlp_bias")) f.mlp_bias = m["mlp_bias"].get<bool>();
  for (const auto& [key, out] : {std::pair<const char*, std::optional<double>*>{"attn_logit_softcapping", &f.attn_logit_softcapping},
                                 {"final_logit_softcapping", &f.final_logit_softcapping},
                                 {"query_pre_attn_scalar", &f.query_pre_attn_scalar}})
    if (m.contains(key)) *out = m[key].is_null() ? 0.0 : m[key].get<double>();
  if (m.contains("tie_word_embeddings")) f.tie_word_embeddings = m["tie_word_embeddings"].get<bool>();
  if (m.contains("norm_eps")) f.norm_eps = m["norm_eps"].get<double>();
  if (m.contains("rope_theta")) f.rope_theta = m["rope_theta"].get<double>();
  if (m.contains("rope_scaling")) {
    std::vector<ConfigIssue> bad;
    f.rope_scaling = read_rope_scaling(m["rope_scaling"], "model.rope_scaling", "", bad);
    if (!bad.empty()) throw ConfigError("model", bad);
  }
  if (m.contains("dropout")) f.attn_pdrop = f.resid_pdrop = f.embd_pdrop = m["dropout"].get<double>();
  if (m.contains("attn_pdrop")) f.attn_pdrop = m["attn_pdrop"].get<double>();
  if (m.contains("resid_pdrop")) f.resid_pdrop = m["resid_pdrop"].get<double>();
  if (m.contains("embd_pdrop")) f.embd_pdrop = m["embd_pdrop"].get<double>();
  if (m.contains("bos_token_id")) f.bos_token_id = m["bos_token_id"].is_null() ? -1 : m["bos_token_id"].get<int64_t>();
  if (m.contains("eos_token_id")) {
    const json& e = m["eos_token_id"];
    f.eos_token_id = e.is_null() ? std::vector<int64_t>{} : e.is_array() ? e.get<std::vector<int64_t>>() : std::vector<int64_t>{e.get<int64_t>()};
  }
  return f;
}

void read_optimizer(const json& d, Config& c, std::vector<ConfigIssue>& errors) {
  const json& opt = at(d, "optimizer");
  const json& op = at(opt, "params");
  OptimizerConfig& o = c.optimizer;
  const std::string type = at(opt, "type").get<std::string>();
  o.type = type == "Adam" ? OptimizerType::Adam : type == "SGD" ? OptimizerType::SGD : type == "Lamb" ? OptimizerType::Lamb
                                                                                                       : OptimizerType::AdamW;
  o.lr = opt_num(at(op, "lr"));
  o.weight_decay = opt_num(at(op, "weight_decay"));
  if (o.type != OptimizerType::SGD) {
    o.eps = opt_num(at(op, "eps"));
    const json& b = at(op, "betas");
    if (b.is_array()) o.betas = std::array<double, 2>{b[0].get<double>(), b[1].get<double>()};
    o.bias_correction = at(op, "bias_correction").get<bool>();
  } else {
    o.eps = 0.0;
    o.betas = std::array<double, 2>{0.0, 0.0};
    o.momentum = at(op, "momentum").get<double>();
    o.dampening = at(op, "dampening").get<double>();
    o.nesterov = at(op, "nesterov").get<bool>();
    if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
      errors.push_back({"optimizer.params.nesterov", "Nesterov momentum needs momentum > 0 and dampening 0", ""});
  }
  if (o.type == OptimizerType::Adam || o.type == OptimizerType::AdamW) o.adam_w_mode = at(op, "adam_w_mode").get<bool>();
  if (o.type == OptimizerType::Lamb) {
    o.eps_inside_sqrt = at(op, "eps_inside_sqrt").get<bool>();
    o.max_coeff = at(op, "max_coeff").get<double>();
    o.min_coeff = at(op, "min_coeff").get<double>();
  }
}

void read_scheduler(const json& d, Config& c) {
  if (!d.contains("scheduler")) return;
  const json& s = d["scheduler"];
  const json& p = at(s, "params");
  SchedulerConfig& sc = c.scheduler;
  const std::string t = at(s, "type").get<std::string>();
  for (SchedulerType st : {SchedulerType::WarmupLR, SchedulerType::WarmupDecayLR, SchedulerType::WarmupCosineLR,
                           SchedulerType::OneCycle, SchedulerType::LRRangeTest})
    if (t == scheduler_type_name(st)) sc.type = st;
  auto num = [&](const char* k, double& out) { if (p.contains(k)) out = p[k].get<double>(); };
  auto integer = [&](const char* k, int64_t& out) { if (p.contains(k)) out = p[k].get<int64_t>(); };
  if (p.contains("warmup_min_lr")) sc.warmup_min_lr = opt_num(p["warmup_min_lr"]);
  if (p.contains("warmup_max_lr")) {
    sc.warmup_max_lr = opt_num(p["warmup_max_lr"]);
    sc.warmup_max_lr_null = p["warmup_max_lr"].is_null();
  }
  if (p.contains("warmup_num_steps")) sc.warmup_num_steps = opt_int(p["warmup_num_steps"]);
  if (p.contains("total_num_steps")) sc.total_num_steps = opt_int(p["total_num_steps"]);
  sc.warmup_type = p.value("warmup_type", std::string("log"));
  num("warmup_min_ratio", sc.warmup_min_ratio);
  num("cos_min_ratio", sc.cos_min_ratio);
  num("cycle_min_lr", sc.cycle_min_lr);
  num("cycle_max_lr", sc.cycle_max_lr);
  num("decay_lr_rate", sc.decay_lr_rate);
  integer("cycle_first_step_size", sc.cycle_first_step_size);
  integer("decay_step_size", sc.decay_step_size);
  if (p.contains("cycle_second_step_size")) sc.cycle_second_step_size = opt_int(p["cycle_second_step_size"]);
  if (p.contains("cycle_first_stair_count")) sc.cycle_first_stair_count = opt_int(p["cycle_first_stair_count"]);
  if (p.contains("cycle_second_stair_count")) sc.cycle_second_stair_count = opt_int(p["cycle_second_stair_count"]);
  if (p.contains("cycle_momentum")) sc.cycle_momentum = p["cycle_momentum"].get<bool>();
  num("cycle_min_mom", sc.cycle_min_mom);
  num("cycle_max_mom", sc.cycle_max_mom);
  num("decay_mom_rate", sc.decay_mom_rate);
  num("lr_range_test_min_lr", sc.lr_range_test_min_lr);
  num("lr_range_test_step_rate", sc.lr_range_test_step_rate);
  integer("lr_range_test_step_size", sc.lr_range_test_step_size);
  if (p.contains("lr_range_test_staircase")) sc.lr_range_test_staircase = p["lr_range_test_staircase"].get<bool>();

}

void read_precision(const json& d, Config& c, std::vector<ConfigIssue>& errors) {
  const json& f16 = at(d, "fp16");
  c.fp16.enabled = opt_bool(at(f16, "enabled"));
  c.fp16.loss_scale = at(f16, "loss_scale").get<double>();
  c.fp16.initial_scale_power = at(f16, "initial_scale_power").get<int>();
  c.fp16.loss_scale_window = at(f16, "loss_scale_window").get<int64_t>();
  c.fp16.hysteresis = at(f16, "hysteresis").get<int>();
  c.fp16.consecutive_hysteresis = at(f16, "consecutive_hysteresis").get<bool>();
  c.fp16.min_loss_scale = at(f16, "min_loss_scale").get<double>();
  const json& b16 = at(d, "bf16");
  c.bf16.enabled = opt_bool(at(b16, "enabled"));
  c.bf16.check_grad_overflow = at(b16, "check_grad_overflow").get<bool>();
  if (c.fp16.enabled.value_or(false) && c.bf16.enabled.value_or(false))
    errors.push_back({"fp16.enabled", "bf16 and fp16 cannot both be enabled",
                      "bf16 needs no loss scaling and is the fast choice on CPUs with AVX512-BF16/AMX and on A100/H100"});
}

void read_zero(const json& d, Config& c, std::vector<ConfigIssue>& errors) {
  const json& z = at(d, "zero_optimization");
  ZeroConfig& zc = c.zero;
  if (!is_auto(at(z, "stage"))) zc.stage = at(z, "stage").get<int>();
  zc.contiguous_gradients = at(z, "contiguous_gradients").get<bool>();
  zc.reduce_scatter = opt_bool(at(z, "reduce_scatter"));
  zc.reduce_bucket_size = opt_int(at(z, "reduce_bucket_size"));
  zc.allgather_partitions = at(z, "allgather_partitions").get<bool>();
  zc.allgather_bucket_size = opt_int(at(z, "allgather_bucket_size"));
  zc.overlap_comm = opt_bool(at(z, "overlap_comm"));
  zc.load_from_fp32_weights = at(z, "load_from_fp32_weights").get<bool>();
  zc.offload_optimizer = read_offload(at(z, "offload_optimizer"), false);
  zc.offload_param = read_offload(at(z, "offload_param"), true);
  {
    const json& aio = at(d, "aio");
    zc.aio.block_size = at(aio, "block_size").get<int64_t>();
    zc.aio.queue_depth = at(aio, "queue_depth").get<int64_t>();
    zc.aio.single_submit = at(aio, "single_submit").get<bool>();
  }
  zc.sub_group_size = opt_int(at(z, "sub_group_size"));
  zc.prefetch_bucket_size = opt_int(at(z, "stage3_prefetch_bucket_size"));
  zc.param_persistence_threshold = opt_int(at(z, "stage3_param_persistence_threshold"));
  zc.model_persistence_threshold = static_cast<int64_t>(std::min(at(z, "stage3_model_persistence_threshold").get<double>(), 9.2e18));
  zc.max_live_parameters = opt_int(at(z, "stage3_max_live_parameters"));
  zc.max_reuse_distance = opt_int(at(z, "stage3_max_reuse_distance"));
  zc.gather_16bit_weights_on_model_save = at(z, "stage3_gather_16bit_weights_on_model_save").get<bool>();
  zc.ignore_unused_parameters = at(z, "ignore_unused_parameters").get<bool>();
  for (const char* block : {"offload_optimizer", "offload_param"}) {
    const OffloadConfig& oc = std::string(block) == "offload_param" ? zc.offload_param : zc.offload_optimizer;
    if (oc.device == OffloadDevice::nvme && oc.nvme_path.empty())
      errors.push_back({std::string("zero_optimization.") + block + ".nvme_path", "NVMe offload needs a folder",
                        "set it to a directory on a fast local NVMe drive, e.g. \"/local_nvme\""});
  }
}

// Gradients' dtypes, clipping and reduction; what the run reports and where.
void read_reporting(const json& d, Config& c, std::vector<ConfigIssue>& errors) {
  const ZeroConfig& zc = c.zero;
  c.grad_accum_dtype = read_dtype(at(at(d, "data_types"), "grad_accum_dtype"));
  c.communication_data_type = read_dtype(at(d, "communication_data_type"));
  c.gradient_clipping = opt_num(at(d, "gradient_clipping"));
  c.gradient_allreduce_sum = at(d, "gradient_allreduce_op") == "sum";
  if (c.gradient_allreduce_sum && zc.stage && *zc.stage == 3)
    errors.push_back({"gradient_allreduce_op", "\"sum\" is not supported with ZeRO stage 3 (DeepSpeed rejects it too)",
                      "use \"mean\""});
  c.steps_per_print = opt_int(at(d, "steps_per_print"));
  c.wall_clock_breakdown = at(d, "wall_clock_breakdown").get<bool>();
  for (auto [key, dst] : {std::pair<const char*, MonitorConfig*>{"tensorboard", &c.tensorboard}, {"csv_monitor", &c.csv_monitor}}) {
    const json& m = at(d, key);
    dst->enabled = at(m, "enabled").get<bool>();
    dst->output_path = at(m, "output_path").get<std::string>();
    dst->job_name = at(m, "job_name").get<std::string>();
  }
  c.comms_logger_enabled = at(at(d, "comms_logger"), "enabled").get<bool>();
  {
    const json& f = at(d, "flops_profiler");
    c.flops_profiler.enabled = at(f, "enabled").get<bool>();
    c.flops_profiler.profile_step = at(f, "profile_step").get<int64_t>();
    c.flops_profiler.module_depth = at(f, "module_depth").get<int>();
    c.flops_profiler.top_modules = at(f, "top_modules").get<int64_t>();
    c.flops_profiler.detailed = at(f, "detailed").get<bool>();
    const json& out = at(f, "output_file");
    c.flops_profiler.output_file = out.is_string() ? out.get<std::string>() : "";
  }
}

void read_model_block(const json& d, Config& c, std::vector<ConfigIssue>& errors) {
  if (!d.contains("model")) return;
  const json& m = d["model"];
  c.model.given = true;
  c.model.preset = m.value("preset", std::string());
  c.model.hf_config = m.value("hf_config", std::string());
  c.model.explicit_fields = read_model_fields(m);
  c.model.activation_checkpointing = at(m, "activation_checkpointing").get<bool>();
  c.model.init_from = str_or_empty(at(m, "init_from"));
  if (m.contains("freeze") && m["freeze"].is_array()) c.model.freeze = m["freeze"].get<std::vector<std::string>>();
  if (m.contains("lora") && m["lora"].is_object()) {
    const json& l = m["lora"];
    LoraConfig& lc = c.model.lora;
    lc.enabled = true;
    lc.r = l.value("r", lc.r);
    lc.alpha = l.value("alpha", lc.alpha);
    lc.dropout = l.value("dropout", lc.dropout);
    if (l.contains("target_modules") && l["target_modules"].is_array()) lc.target_modules = l["target_modules"].get<std::vector<std::string>>();
    if (l.contains("target_modules") && l["target_modules"].is_string()) lc.target_modules = {kAllLinear};  // "all-linear"
    lc.init = l.value("init", std::string("kaiming_uniform")) == "gaussian" ? LoraInit::gaussian : LoraInit::kaiming_uniform;
    if (l.contains("layers_to_transform")) {  // one block (PEFT's int) or a list
      const json& layers = l["layers_to_transform"];
      if (layers.is_number_integer()) lc.layers_to_transform = {layers.get<int64_t>()};
      if (layers.is_array()) lc.layers_to_transform = layers.get<std::vector<int64_t>>();
    }
  }
  if (!c.model.preset.empty() && !c.model.hf_config.empty())
    errors.push_back({"model", "both preset and hf_config are given", "keep one of them"});

}

void read_data(const json& d, Config& c, std::vector<ConfigIssue>& errors) {
  const json& data = at(d, "data");
  const std::string dt = at(data, "type").get<std::string>();
  c.data.type = dt == "text"     ? DataType::text
                : dt == "tokens" ? DataType::tokens
                : dt == "hdf5"   ? DataType::hdf5
                : dt == "jsonl"  ? DataType::jsonl
                                 : DataType::synthetic;
  c.data.path = str_or_empty(at(data, "path"));
  c.data.tokenizer = at(data, "tokenizer").get<std::string>();
  c.data.vocab_file = str_or_empty(at(data, "vocab_file"));
  c.data.merges_file = str_or_empty(at(data, "merges_file"));
  c.data.token_format = at(data, "token_format").get<std::string>();
  c.data.dataset = at(data, "dataset").get<std::string>();
  c.data.seq_len = opt_int(at(data, "seq_len"));
  c.data.val_fraction = at(data, "val_fraction").get<double>();
  c.data.shuffle = at(data, "shuffle").get<bool>();
  c.data.tokenizer_path = str_or_empty(at(data, "tokenizer_path"));
  c.data.chat_template = at(data, "chat_template").get<std::string>();
  c.data.train_on_prompt = at(data, "train_on_prompt").get<bool>();
  c.data.packing = at(data, "packing").get<bool>();
  c.data.val_path = str_or_empty(at(data, "val_path"));
  c.data.tokens_in_memory = opt_bool(at(data, "tokens_in_memory"));
  c.data.skip_bad_lines = at(data, "skip_bad_lines").get<bool>();
  if (c.data.skip_bad_lines && c.data.type != DataType::jsonl)
    errors.push_back({"data.skip_bad_lines", "acts on jsonl data only", "remove the key, or set data.type \"jsonl\""});
  if (c.data.tokens_in_memory && c.data.type != DataType::jsonl)
    errors.push_back({"data.tokens_in_memory", "acts on jsonl data only",
                      "remove the key: text and HDF5 data are read from their files as they go already"});
  if (!c.data.val_path.empty() && c.data.type != DataType::jsonl)
    errors.push_back({"data.val_path", "acts on jsonl data only",
                      "remove the key: ds holds out data.val_fraction of text, token and HDF5 data for validation"});
  if (c.data.type != DataType::synthetic && c.data.path.empty())
    errors.push_back({"data.path", std::string("data.type \"") + dt + "\" needs a file", "set data.path, or use data.type \"synthetic\""});
  if (c.data.type == DataType::text && c.data.tokenizer == "gpt2" && (c.data.vocab_file.empty() || c.data.merges_file.empty()))
    errors.push_back({"data.vocab_file", "the gpt2 tokenizer needs vocab_file and merges_file",
                      "point them at GPT-2's vocab.json and merges.txt"});
  if (c.data.type == DataType::jsonl && c.data.tokenizer != "hf")
    errors.push_back({"data.tokenizer", "jsonl data is tokenized with the model's own tokenizer",
                      "set data.tokenizer \"hf\" and data.tokenizer_path to the model's directory (or its tokenizer.json)"});
  if (c.data.tokenizer == "hf" && c.data.tokenizer_path.empty())
    errors.push_back({"data.tokenizer_path", "the hf tokenizer needs its tokenizer.json",
                      "point data.tokenizer_path at the model's directory (the one model.init_from reads) or at its tokenizer.json"});
  if (c.data.tokenizer == "hf" && c.data.type != DataType::text && c.data.type != DataType::jsonl)
    errors.push_back({"data.tokenizer", "the hf tokenizer reads text or jsonl data", "set data.type text or jsonl"});
  if (c.data.tokenizer != "hf" && !c.data.tokenizer_path.empty())
    errors.push_back({"data.tokenizer_path", "acts with data.tokenizer \"hf\" only", "set data.tokenizer \"hf\", or remove the key"});
  if (c.data.type != DataType::jsonl && (c.data.chat_template != "auto" || c.data.train_on_prompt || c.data.packing))
    errors.push_back({c.data.train_on_prompt ? "data.train_on_prompt" : c.data.packing ? "data.packing" : "data.chat_template",
                      "acts on jsonl data only", c.data.packing ? "remove the key: text, token and HDF5 data fill every row already (no padding)"
                                                                : "remove the key, or set data.type \"jsonl\""});
}

void read_train(const json& d, Config& c) {
  const json& t = at(d, "train");
  c.train.steps = at(t, "steps").get<int64_t>();
  if (at(t, "epochs").is_number()) c.train.epochs = at(t, "epochs").get<double>();
  c.train.eval_every = at(t, "eval_every").get<int64_t>();
  c.train.eval_batches = at(t, "eval_batches").get<int64_t>();
  c.train.save_every = at(t, "save_every").get<int64_t>();
  c.train.keep_last = at(t, "keep_last").get<int64_t>();
  c.train.divergence_factor = at(t, "divergence_factor").get<double>();
  c.train.decay_all_params = at(t, "weight_decay_params").get<std::string>() == "all";
  c.train.output_dir = at(t, "output_dir").get<std::string>();
  c.train.seed = at(t, "seed").get<int64_t>();
  c.train.threads = opt_int(at(t, "threads"));
  c.train.comm_timeout_s = at(t, "comm_timeout_s").get<double>();
  const json& r = at(t, "resume");
  c.train.resume = r.is_boolean() ? (r.get<bool>() ? "auto" : "false") : r.get<std::string>();
}

// tensor_parallel and pipeline: the mesh the model is split over (engine/plan/mesh.hpp checks it against the
// model and the world).
void read_parallel(const json& d, Config& c, std::vector<ConfigIssue>& errors) {
  const int64_t tp = at(at(d, "tensor_parallel"), "autotp_size").get<int64_t>();
  c.parallel.tensor = tp < 1 ? 1 : static_cast<int>(tp);
  const json& p = at(d, "pipeline");
  const json& stages = at(p, "stages");
  c.parallel.pipeline = stages.is_number() ? static_cast<int>(stages.get<int64_t>()) : 1;
  c.parallel.partition = at(p, "partition").get<std::string>();
  c.parallel.checkpoint_interval = at(p, "activation_checkpoint_interval").get<int64_t>();
  const std::string& how = c.parallel.partition;
  if (how != "parameters" && how != "uniform" && how != "best" && how != "memory" && how.rfind("type:", 0) != 0)
    errors.push_back({"pipeline.partition", "'" + how + "' is no way ds knows to cut the blocks into stages",
                      "parameters (balanced; \"best\" too), uniform (\"type:...\" too) or memory (the heaviest stage's memory least)"});
}

}  // namespace

Config read_config(const json& d, std::vector<ConfigIssue>& errors) {
  Config c;
  c.train_batch_size = opt_int(at(d, "train_batch_size"));
  c.train_micro_batch_size_per_gpu = opt_int(at(d, "train_micro_batch_size_per_gpu"));
  c.micro_batch_auto = is_auto(at(d, "train_micro_batch_size_per_gpu"));
  c.gradient_accumulation_steps = opt_int(at(d, "gradient_accumulation_steps"));
  read_optimizer(d, c, errors);
  read_scheduler(d, c);
  read_precision(d, c, errors);
  read_zero(d, c, errors);
  read_reporting(d, c, errors);
  read_model_block(d, c, errors);
  read_data(d, c, errors);
  read_train(d, c);
  read_parallel(d, c, errors);
  return c;
}

}  // namespace ds::loader
