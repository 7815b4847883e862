#include "cli/convert_ckpt.hpp"
#include "cli/convert_args.hpp"

#include <filesystem>
#include <algorithm>
#include <functional>
#include <iostream>


#include <nlohmann/json.hpp>

#include "common/files.hpp"
#include "common/format.hpp"
#include "common/hash.hpp"
#include "common/json_depth.hpp"
#include "common/strings.hpp"
#include "engine/plan/plan_record.hpp"
#include "cli/tokenizer_record.hpp"
#include "engine/plan/plan.hpp"
#include "engine/runtime/io/checkpoint.hpp"
#include "engine/runtime/io/deepspeed_checkpoint.hpp"
#include "cli/run_policy.hpp"
#include "engine/runtime/io/weights.hpp"
#include "schema/loader.hpp"

namespace ds::cli {
namespace {

// Who wrote a ds checkpoint: "4 ranks (tensor 2 x data 2)", "8 ranks (tensor 2 x pipeline 2 x data 2)", "2 ranks", "1 rank".
std::string saved_by(const WeightSource& src) {
  const int64_t world = src.world_size * src.tensor_parallel * src.pipeline_stages;
  std::string s = std::to_string(world) + (world == 1 ? " rank" : " ranks");
  if (src.tensor_parallel > 1 || src.pipeline_stages > 1)
    s += " (tensor " + std::to_string(src.tensor_parallel) + (src.pipeline_stages > 1 ? " x pipeline " + std::to_string(src.pipeline_stages) : "") +
         " x data " + std::to_string(src.world_size) + ")";
  return s;
}

namespace fs = std::filesystem;

int print_info(const WeightSource& src, bool as_json) {
  int64_t params = 0;
  for (const auto& t : src.tensors()) params += t.numel();
  if (as_json) {
    nlohmann::ordered_json j;
    j["schema_version"] = 1;
    j["kind"] = weights_kind_name(src.kind());
    j["path"] = src.path();
    j["num_params"] = params;
    if (src.kind() == WeightsKind::ds_checkpoint) {
      j["step"] = src.step;
      j["world_size"] = src.world_size * src.tensor_parallel * src.pipeline_stages;  // every rank that wrote it
      j["data_parallel"] = src.world_size;
      j["tensor_parallel"] = src.tensor_parallel;
      j["pipeline_stages"] = src.pipeline_stages;
      j["zero_stage"] = src.zero_stage;
      j["precision"] = src.precision;
      j["model"] = {{"name", src.model().name},
                    {"arch", model_arch_name(src.model().arch)},
                    {"hidden_size", src.model().hidden_size},
                    {"num_layers", src.model().num_layers},
                    {"vocab_size", src.model().vocab_size}};
    }
    nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
    for (const auto& t : src.tensors()) tensors.push_back({{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}});
    j["tensors"] = tensors;
    std::cout << j.dump(2) << "\n";
    return kExitOk;
  }
  std::cout << src.path() << ": " << weights_kind_name(src.kind()) << "\n";
  if (src.kind() == WeightsKind::ds_checkpoint) {
    const ModelHyper& m = src.model();
    std::cout << "  step        " << src.step << "\n"
              << "  model       " << m.name << " (" << model_arch_name(m.arch) << ", " << m.num_layers << " layers, hidden "
              << m.hidden_size << ", vocab " << m.vocab_size << ")\n"
              << "  saved by    " << saved_by(src) << " at ZeRO stage " << src.zero_stage << ", " << src.precision
              << " training (fp32 master weights stored)\n";
  }
  std::cout << "  parameters  " << format_count(params) << " in " << src.tensors().size() << " tensors\n";
  for (const auto& t : src.tensors()) std::cout << "    " << pad(t.name, 48) << pad(t.dtype, 6) << format_shape(t.shape) << "\n";
  return kExitOk;
}

// A file to ship beside a Hugging Face export: its name there, where it came from, its bytes.
struct TokenizerFile {
  std::string name, from, bytes;
};

// A run that read GPT-2 BPE text: its vocab.json and merges.txt, which transformers' GPT2Tokenizer loads
// from an export. Read (and checked) before the export writes anything. The run's plan records each
// file's absolute path and checksum: a file that changed since is refused (the export would ship another
// tokenizer), one that is gone is named, not fatal. Runs from before that record are read by the
// config's paths.
std::vector<TokenizerFile> tokenizer_files(const std::string& checkpoint) {
  std::vector<TokenizerFile> out;
  const PlanRecord plan = read_checkpoint_plan(checkpoint);
  if (plan.tokenizer_files) {
    for (const TokenizerFileRecord& f : *plan.tokenizer_files) {
      const std::string& name = f.name;
      if (name.empty() || name.find('/') != std::string::npos || name.find("..") != std::string::npos) continue;  // never outside DST
      const std::string key = f.role == "init_from" ? "model.init_from" : "data." + f.role;
      std::error_code ec;
      if (!fs::is_regular_file(f.path, ec)) {
        print_warnings("convert-ckpt", {{key, "the run's tokenizer file '" + f.path + "' is not there any more; not copied",
                                         "copy it into the export as " + name}});
        continue;
      }
      std::string bytes = read_file_bytes(f.path);
      const std::string hex = checksum64_hex(bytes);
      if (f.checksum64 != hex)
        throw UserError("'" + f.path + "' has changed since the run read it (checksum " + f.checksum64 + ", now " + hex +
                            "): the export would ship another tokenizer than the model was trained with",
                        "restore the file the run read (" + key + "), then export again");
      out.push_back({name, f.path, std::move(bytes)});
    }
    return out;
  }
  nlohmann::json data;
  try {
    const std::string config = read_checkpoint_text(checkpoint, "config_json");
    check_json_nesting(config, checkpoint + " (config_json)");
    data = nlohmann::json::parse(config).at("data");
  } catch (const nlohmann::json::exception&) {
    return out;
  }
  if (data.value("tokenizer", "") != "gpt2" || data.value("type", "") != "text") return out;
  for (const auto& [key, name] : {std::pair{"vocab_file", "vocab.json"}, {"merges_file", "merges.txt"}}) {
    const std::string from = data.contains(key) && data[key].is_string() ? data[key].get<std::string>() : "";
    std::error_code ec;
    if (from.empty() || !fs::is_regular_file(from, ec)) {
      print_warnings("convert-ckpt", {{std::string("data.") + key, "the run's tokenizer file '" + from + "' is not here; not copied",
                                       std::string("copy it into the export as ") + name + " for transformers' GPT2Tokenizer"}});
      continue;
    }
    out.push_back({name, from, read_file_bytes(from)});
  }
  return out;
}

void write_tokenizer_files(const std::vector<TokenizerFile>& files, const std::string& dst) {
  for (const TokenizerFile& t : files) {
    write_text_atomically((fs::path(dst) / t.name).string(), t.bytes);
    std::cerr << "  copied " << t.from << " -> " << (fs::path(dst) / t.name).string() << "\n";
  }
}

}  // namespace

// Never replace what the user did not name: an existing destination needs --overwrite, and no destination,
// --overwrite or not, may be (or hold) what the command reads: the run, its checkpoint, a merge's base.
// `sources` are what this conversion reads; `exports` is true when DST receives Hugging Face files.
void check_destination(const ConvertArgs& a, const std::vector<std::string>& sources, bool exports) {
  std::error_code ec;
  if (ends_with(a.dst, ".bin") || ends_with(a.dst, ".pt") || ends_with(a.dst, ".pth"))
    throw UserError("'" + a.dst + "' names a PyTorch pickle file; ds writes safetensors, never pickles",
                    "give a directory (a Hugging Face directory: model.safetensors loads in transformers wherever "
                    "pytorch_model.bin did) or a file ending in .safetensors (one consolidated file, zero_to_fp32's job)");
  for (const std::string& source : sources) {
    if (source.empty()) continue;
    if (path_within(source, a.dst))
      throw UserError("'" + a.dst + "' is " + (same_path(source, a.dst) ? "" : "or holds ") + "what this conversion reads ('" + source +
                          "'): writing there would replace it",
                      "choose another destination, e.g. " + a.dst + "-export");
    // Inside a source directory (base-hf/model.safetensors): a file of it would be replaced.
    if (fs::is_directory(source, ec) && path_within(a.dst, source))
      throw UserError("'" + a.dst + "' lies inside '" + source + "', which this conversion reads: writing there could replace its files",
                      "choose a destination outside it");
    const std::string run = checkpoint_run_dir(source);
    if (!run.empty() && path_within(a.dst, (fs::path(run) / "checkpoints").string()))
      throw UserError("'" + a.dst + "' lies inside the run's checkpoints/, which ds keeps to itself", "choose a destination outside it");
  }
  if (exports && fs::is_directory(a.dst, ec) && holds_run(a.dst))
    throw UserError("'" + a.dst + "' holds a ds run (checkpoints, metrics.jsonl): an export written there would hide it",
                    "export into a new directory (e.g. " + a.dst + "/hf or " + a.dst + "-hf)");
  if (fs::exists(a.dst, ec) && !a.overwrite && !(fs::is_directory(a.dst, ec) && fs::is_empty(a.dst, ec)))
    throw UserError("'" + a.dst + "' already exists", "choose a new destination, or add --overwrite to replace the files ds writes there");
}

namespace {

// A Hugging Face directory -> a ds run directory holding a step-0 checkpoint: the weights as fp32 master
// weights (streamed tensor by tensor), the optimizer's moments zero, the model from the directory's config.json. `ds train` with
// train.output_dir=DST --resume continues from it, or model.init_from=DST starts from its weights.
int import_hf(const WeightSource& src, const ConvertArgs& a) {
  if (a.dtype != "fp32")
    throw UserError("--dtype " + a.dtype + " does not apply to an import: a ds run holds fp32 master weights (and trains in the "
                    "precision its config says)",
                    "leave --dtype out; train the run in " + a.dtype + " with " + a.dtype + ".enabled=true");
  if (ends_with(a.dst, ".safetensors"))
    throw UserError("'" + a.src + "' is a Hugging Face directory: importing it writes a ds run directory, not '" + a.dst + "'",
                    "give a directory for the run (e.g. runs/NAME-init); a Hugging Face directory already is safetensors");
  check_destination(a, {src.path()}, false);
  if (a.overwrite) print_warnings("convert-ckpt", prepare_run_dir({a.dst, false, "", true, {src.path()}}));  // only what ds wrote there
  const fs::path hf_config = fs::path(src.path()) / "config.json";
  if (!fs::exists(hf_config)) throw UserError("'" + src.path() + "' has no config.json", "a Hugging Face model directory has one beside its weights");
  // The model from the directory's config.json, through the loader (the checkpoint stores the resolved config).
  const std::string cfg_text = nlohmann::json{{"train_micro_batch_size_per_gpu", 1},
                                               {"model", {{"hf_config", fs::absolute(hf_config).string()}}},
                                               {"train", {{"output_dir", a.dst}, {"steps", 1}}}}.dump(2);
  LoadedConfig loaded;
  try {
    loaded = load_config_text_with_json(cfg_text, hf_config.string());
  } catch (const ConfigError& e) {  // the directory's config.json, not a key the user set
    std::vector<ConfigIssue> issues = e.issues();
    for (ConfigIssue& i : issues)
      if (i.path == "model.hf_config") i.path = "SRC";
    throw ConfigError(e.source(), issues);
  }
  Topology one;
  one.world_size_source = "convert-ckpt";
  const Plan plan = compile_plan(loaded.config, build_model_spec(resolve_model_hyper(loaded.config.model)), one);
  match_weights(src, plan.model);  // names and shapes, before anything is allocated
  const int64_t P = plan.layout.numel;
  // Streamed: the weights one tensor at a time in the flat order, the optimizer's moments zero.
  CheckpointBuffers b{nullptr, nullptr, nullptr, P, owned_segments(plan.layout, 0), P};
  b.pieces.moments = plan.optimizer.moments;
  b.pieces.read = [weights = weights_in_pieces(src, plan.model)](int64_t at, int64_t n, float* master, float* m1, float* m2) {
    weights(at, n, master);
    for (float* m : {m1, m2})
      if (m) std::fill(m, m + n, 0.0f);
  };
  CheckpointScalars sc;
  sc.seed = plan.run.seed;
  // The directory's tokenizer files are recorded, so the run's exports ship them again.
  const std::string plan_json = plan_to_json(plan, tokenizer_record(loaded.config.data, src.path()));
  const SavedCheckpoint saved = save_checkpoint(a.dst, sc, b, plan_json, loaded.resolved_json, 0);
  std::cerr << "ds convert-ckpt: " << src.path() << " (" << model_arch_name(plan.model.hp.arch) << ", "
            << format_count(plan.model.num_params) << " parameters) -> " << saved.path << " (step 0, optimizer fresh, "
            << format_bytes(static_cast<double>(saved.bytes)) << ")\n"
            << "  train from it: ds train CONFIG model.init_from=" << a.dst << "\n";
  return kExitOk;
}

constexpr int kMaxReshardRanks = 65536;

// The overrides that put a run's config at another shape: the stage, and the checkpoint's global batch kept
// (a resume keeps it too): the accumulation follows from the micro batch and the world size, and where the
// run's micro batch cannot keep it, the largest smaller one that does (`note` says so). UserError when the
// world size does not divide the global batch at all. (A recorded batch below 1 is refused by the record's reader.)
std::vector<std::string> reshard_overrides(const PlanRecord& plan, int world, int stage, const std::string& dst, std::string* note) {
  std::vector<std::string> o{"zero_optimization.stage=" + std::to_string(stage), "train.output_dir=" + dst};
  // A split model's checkpoint is the whole model's already: resharded as data parallelism's (any mesh resumes
  // either).
  if (plan.mesh_tensor > 1) o.push_back("tensor_parallel.autotp_size=1");
  if (plan.mesh_pipeline > 1) o.push_back("pipeline.stages=1");
  if (plan.train_batch_size == 0 || plan.micro_batch == 0) {
    o.push_back("~train_batch_size");  // a record without its batch: the batch follows the world size, as it did before
    return o;
  }
  const int64_t global = plan.train_batch_size, was_micro = plan.micro_batch;
  if (global % world != 0) {
    std::vector<std::string> fits;
    for (int64_t w = 1; w <= global && fits.size() < 12; ++w)
      if (global % w == 0) fits.push_back(std::to_string(w));
    throw UserError("--world-size " + std::to_string(world) + " cannot keep the run's global batch of " + std::to_string(global) +
                        " samples (each rank takes an equal share)",
                    "world sizes that keep it: " + join(fits, ", ") + (fits.size() == 12 ? ", ..." : "") +
                        "; to change the batch knowingly, reshard for one of those and resume with train_batch_size set");
  }
  int64_t micro = std::min(was_micro, global / world);
  while (global % (micro * world) != 0) --micro;
  if (micro != was_micro)
    *note = "the global batch of " + std::to_string(global) + " kept on " + std::to_string(world) + " ranks with micro batch " +
            std::to_string(micro) + " (the run had " + std::to_string(was_micro) + ")";
  o.push_back("train_batch_size=" + std::to_string(global));
  o.push_back("train_micro_batch_size_per_gpu=" + std::to_string(micro));
  o.push_back("gradient_accumulation_steps=" + std::to_string(global / (micro * world)));
  return o;
}

// The overrides that shaped the resharded run, as the resume command gives them: the run's own config still names its
// mesh and batch, which the new world size may not take (a pipeline's checkpoint resharded for data ranks alone).
std::string resume_overrides(const std::vector<std::string>& overrides) {
  std::string out;
  for (const std::string& o : overrides) out += " " + (o.find_first_of(" '\"") == std::string::npos ? o : "'" + o + "'");
  return out;
}

}  // namespace

void report_export(const ExportSummary& s) {
  for (const auto& f : s.files) std::cerr << "  wrote " << f << "\n";
  for (const auto& f : s.removed) std::cerr << "  removed " << f << " (the previous export's)\n";
  if (s.fp16_overflowed > 0)
    print_warnings("convert-ckpt", {{"", std::to_string(s.fp16_overflowed) + " values beyond fp16's range were written as +-inf (--allow-fp16-overflow)", ""}});
  if (s.fp16_flushed > 0)
    print_warnings("convert-ckpt", {{"", std::to_string(s.fp16_flushed) + " nonzero values smaller than fp16's least subnormal (2^-24) were written as 0",
                                     "--dtype bf16 keeps fp32's range"}});
}

Plan plan_for_rank(const Config& config, const ModelSpec& spec, int world, int rank, const char* source) {
  Topology t;
  t.world_size = t.ranks_per_node = world;
  t.rank = t.local_rank = rank;
  t.world_size_source = source;
  return compile_plan(config, spec, t);
}

SavedCheckpoint write_run_checkpoint(const std::string& dst, const CheckpointScalars& scalars, int files,
                                     const std::function<CheckpointBuffers(int rank)>& shard_of, const std::string& plan_json,
                                     const std::string& config_json) {
  // save_checkpoint's protocol, played by one process: rank 0 creates the directory and reaches its first
  // barrier, every other rank writes its file, rank 0 writes its own and marks the checkpoint complete.
  CheckpointWriter writer{0, files, nullptr};
  bool others_written = files == 1;
  writer.barrier = [&] {
    if (others_written) return;
    others_written = true;
    std::cerr << "  writing a file for each of " << files << " ranks (rank 0's, with the run's state, last)\n";
    for (int r = 1; r < files; ++r) {
      save_checkpoint(dst, scalars, shard_of(r), plan_json, config_json, 0, CheckpointWriter{r, files, nullptr});
      std::cerr << "  rank " << r << "'s file written\n";
    }
  };
  return save_checkpoint(dst, scalars, shard_of(0), plan_json, config_json, 0, writer);
}

namespace {

// A ds checkpoint -> a ds run directory whose checkpoint is sharded for `world_size` ranks at ZeRO
// `stage`: each rank's file holds exactly the segments a run of that shape owns (weights, moments,
// counters unchanged), so the new run resumes from its own shard without remapping. Values are copied,
// never converted: a round trip is bit-exact.
int reshard_ds(const WeightSource& src, const ConvertArgs& a) {
  if (a.dtype != "fp32")
    throw UserError("--dtype " + a.dtype + " does not apply to a ds checkpoint: it always holds fp32 master weights and moments",
                    "train in " + a.dtype + " by setting the config's " + a.dtype + ".enabled=true when resuming; "
                    "--dtype converts exports (--to hf or safetensors)");
  if (a.to == "hf" || a.to == "safetensors")
    throw UserError("--to " + a.to + " exports; --world-size and --stage reshard into a ds run directory", "give one or the other");
  if (ends_with(a.dst, ".safetensors"))
    throw UserError("--world-size and --stage write a ds run directory, not '" + a.dst + "'", "give a directory for the resharded run");
  check_destination(a, {src.path()}, false);
  const int world = a.world_size > 0 ? a.world_size : static_cast<int>(src.world_size);
  const int stage = a.stage >= 0 ? a.stage : src.zero_stage;
  const std::string config_text = read_checkpoint_text(src.path(), "config_json");
  std::string batch_note;
  const PlanRecord record = read_checkpoint_plan(src.path());
  const std::vector<std::string> shape = reshard_overrides(record, world, stage, a.dst, &batch_note);
  const LoadedConfig loaded = load_config_text_with_json(config_text, src.path() + " (config_json)", shape);
  const ModelSpec spec = build_model_spec(resolve_model_hyper(loaded.config.model));
  // One file per rank, each owning part of every buffer: past the parameter count some ranks own nothing.
  int64_t numel = 0;
  for (const auto& t : src.tensors()) numel += t.numel();
  if (world > kMaxReshardRanks || world > numel)
    throw UserError("--world-size " + std::to_string(world) + " for a model of " + format_count(numel) + " parameters: " +
                        (world > kMaxReshardRanks ? "ds convert-ckpt writes one file per rank, at most " + std::to_string(kMaxReshardRanks)
                                                  : std::string("some ranks would hold no parameter at all")),
                    "reshard for the world size the run will resume on");
  if (a.overwrite) print_warnings("convert-ckpt", prepare_run_dir({a.dst, false, "", true, {src.path()}}));
  const Plan lead_plan = plan_for_rank(loaded.config, spec, world, 0, "convert-ckpt --world-size");
  // The source's counters, with its checksums verified once here rather than once per piece.
  CheckpointBuffers probe;
  probe.model_numel = lead_plan.layout.numel;
  const CheckpointScalars scalars = load_checkpoint(src.path(), probe);
  // Rank r's shard drawn piece by piece from whichever source files hold those elements: memory is one
  // piece of each buffer, never a shard.
  auto shard_of = [&](int rank) {
    const Plan plan = rank == 0 ? lead_plan : plan_for_rank(loaded.config, spec, world, rank, "convert-ckpt --world-size");
    CheckpointBuffers b{nullptr, nullptr, nullptr, plan.execution.local_numel, owned_segments(plan.layout, rank), plan.layout.numel};
    b.pieces.moments = plan.optimizer.moments;
    b.pieces.read = [&src, segments = b.segments, P = plan.layout.numel](int64_t at, int64_t n, float* m, float* m1, float* m2) {
      CheckpointBuffers piece{m, m1, m2, n, {}, P};
      piece.verify = false;
      for (const OwnedSegment& g : segments) {  // the rank's segments cut to [at, at + n), placed from `at`
        const int64_t lo = std::max(g.local, at), hi = std::min(g.local + g.numel, at + n);
        if (lo < hi) piece.segments.push_back({g.param, g.global + (lo - g.local), lo - at, hi - lo});
      }
      for (float* p : {m, m1, m2})
        if (p) std::fill(p, p + n, 0.0f);  // padding between segments
      load_checkpoint(src.path(), piece);
    };
    return b;
  };
  const bool sharded = lead_plan.execution.sharded;
  // The run's tokenizer record goes with it: exports of the resharded run ship the same files.
  const std::string plan_json = plan_to_json(lead_plan, record.tokenizer_files.value_or(std::vector<TokenizerFileRecord>{}));
  const SavedCheckpoint saved = write_run_checkpoint(a.dst, scalars, sharded ? world : 1, shard_of, plan_json, loaded.resolved_json);
  std::cerr << "ds convert-ckpt: " << src.path() << " (step " << src.step << ", ZeRO stage " << src.zero_stage << " on "
            << saved_by(src) << ") -> " << saved.path << " (ZeRO stage " << stage
            << " on " << world << (world == 1 ? " rank" : " ranks") << (sharded ? ", one shard per rank" : ", one file") << ")\n"
            << "  resume it: ds train CONFIG" << resume_overrides(shape) << (world > 1 ? " --nproc-per-node " + std::to_string(world) : "")
            << " --resume\n";
  if (!batch_note.empty()) std::cerr << "  " << batch_note << "\n";
  return kExitOk;
}

// A LoRA run's checkpoint and its base -> the base with the adapter folded in, as a Hugging Face directory or
// one .safetensors file. The base is the one the run recorded (or --base), checked against the run's checksum.
int export_merged(const WeightSource& src, const ConvertArgs& a) {
  const std::string base_path = a.base.empty() ? src.base_path : a.base;
  if (base_path.empty())
    throw UserError("'" + src.path() + "' trained on a random base (no model.init_from), which no file holds",
                    std::string(src.lora ? "export the adapter with --adapter instead, or g" : "G") + "ive the base's weights with --base PATH");
  std::error_code ec;
  if (a.base.empty() && !fs::exists(base_path, ec))
    throw UserError("the base '" + src.path() + "' trained on, '" + base_path + "', is not there any more",
                    "give its new place with --base PATH (its frozen weights are checked against the run's checksum)");
  check_destination(a, {src.path(), base_path}, true);
  const std::unique_ptr<WeightSource> base = open_weights(base_path);
  const ModelSpec model = build_model_spec(src.model());
  // The frozen tensors are those the checkpoint does not hold (every one under LoRA).
  std::vector<uint8_t> frozen(model.tensors.size(), 1);
  for (size_t i = 0; i < model.tensors.size(); ++i) frozen[i] = src.find(model.tensors[i].name) == nullptr;
  std::cerr << "ds convert-ckpt: checking the base " << base_path << " against the run's record\n";
  const std::string checksum = weights_checksum(*base, model, frozen);
  if (!src.base_checksum.empty() && checksum != src.base_checksum)
    throw UserError("'" + base_path + "' is not the base '" + src.path() + "' trained on (its frozen weights' checksum is " + checksum +
                        ", the run recorded " + src.base_checksum + ")",
                    "give the run's own base with --base PATH");
  const bool one_file = a.to == "safetensors" || (a.to.empty() && ends_with(a.dst, ".safetensors"));
  ExportOptions opt;
  opt.dtype = a.dtype;
  opt.allow_fp16_overflow = a.allow_fp16_overflow;
  opt.max_shard_bytes = static_cast<uint64_t>(size_flag("--max-shard-size", a.max_shard_size));
  const std::unique_ptr<WeightSource> merged = merged_weights(*base, src);
  std::cerr << "ds convert-ckpt: " << base_path << " + what " << src.path() << " trained ("
            << (src.lora ? "LoRA r " + std::to_string(src.lora->r) + ", scale " + format_double(src.lora->alpha / static_cast<double>(src.lora->r))
                         : std::to_string(src.tensors().size()) + " tensors")
            << ") -> " << a.dst << " as "
            << (one_file ? "one safetensors file" : "a Hugging Face directory") << ", " << a.dtype << "\n";
  const std::vector<TokenizerFile> tokenizer = one_file ? std::vector<TokenizerFile>{} : tokenizer_files(src.path());
  const ExportSummary s = one_file ? export_safetensors_file(*merged, model, a.dst, opt) : export_hf_directory(*merged, src.model(), a.dst, opt);
  for (const auto& f : s.files) std::cerr << "  wrote " << f << "\n";
  write_tokenizer_files(tokenizer, a.dst);
  std::cerr << "ds convert-ckpt: " << s.tensors << " tensors, " << format_bytes(static_cast<double>(s.tensor_bytes)) << "\n";
  return kExitOk;
}

// A LoRA run's checkpoint -> PEFT's adapter directory. Anything else asked of it is refused: it holds
// the adapter, not the model.
int export_adapter(const WeightSource& src, const ConvertArgs& a) {
  if (!src.frozen_part)
    throw UserError("'" + src.path() + "' trained every weight: it holds no LoRA adapter and no frozen weights to merge",
                    "export it without --adapter or --merge (--to hf or safetensors)");
  if (a.merge) return export_merged(src, a);
  if (!src.lora)
    throw UserError("'" + src.path() + "' holds only the tensors that trained (model.freeze kept the rest frozen)" +
                        (a.adapter ? std::string(": it has no LoRA adapter") : std::string(", not a whole model")),
                    "export the whole model with --merge (the frozen tensors read from the run's model.init_from)");
  if (!a.adapter)
    throw UserError("'" + src.path() + "' holds a LoRA adapter, not a whole model (its base was frozen and is not in the checkpoint)",
                    "export the adapter in PEFT's format with --adapter, or the base with the adapter folded in with --merge");
  if (a.to == "safetensors" || ends_with(a.dst, ".safetensors"))
    throw UserError("--adapter writes a directory (adapter_config.json and adapter_model.safetensors)", "give a directory as DST");
  check_destination(a, {src.path()}, true);
  std::error_code ec;
  if (fs::exists(a.dst, ec) && !fs::is_directory(a.dst, ec)) throw UserError("'" + a.dst + "' is a file, not a directory", "");
  ExportOptions opt;
  opt.dtype = a.dtype;
  opt.allow_fp16_overflow = a.allow_fp16_overflow;
  std::cerr << "ds convert-ckpt: " << src.path() << " (step " << src.step << ", LoRA r " << src.lora->r << " on "
            << join(src.lora->target_modules, ", ") << ") -> " << a.dst << " as a PEFT adapter, " << a.dtype << "\n";
  const ExportSummary s = export_peft_adapter(src, a.dst, opt);
  for (const auto& f : s.files) std::cerr << "  wrote " << f << "\n";
  std::cerr << "ds convert-ckpt: " << s.tensors << " tensors, " << format_bytes(static_cast<double>(s.tensor_bytes)) << "\n";
  if (src.base_path.empty())
    std::cerr << "  base_model_name_or_path is null: the run's base was a random init (no model.init_from)\n";
  return kExitOk;
}

int run_convert(const ConvertArgs& a) {
  return run_guarded("convert-ckpt", [&]() -> int {
    std::string src_path = a.src;
    if (!a.tag.empty() && !is_deepspeed_checkpoint(a.src)) {  // zero_to_fp32's -t
      src_path = (fs::path(a.src) / "checkpoints" / a.tag).string();
      std::error_code ec;
      if (!fs::is_directory(src_path, ec)) {
        std::vector<std::string> tags;
        for (const auto& e : fs::directory_iterator(fs::path(a.src) / "checkpoints", ec))
          if (e.path().filename().string().rfind("step_", 0) == 0 && fs::exists(e.path() / "DONE", ec)) tags.push_back(e.path().filename().string());
        std::sort(tags.begin(), tags.end());
        throw UserError("'" + a.src + "' has no checkpoint tagged '" + a.tag + "'",
                        tags.empty() ? "it holds no complete checkpoint (is it a ds run directory?)" : "its checkpoints: " + join(tags, ", "));
      }
    }
    // A DeepSpeed checkpoint before a Hugging Face directory: Hugging Face's Trainer saves both in one folder.
    if (is_deepspeed_checkpoint(a.src)) return convert_deepspeed(a);
    const std::unique_ptr<WeightSource> src = open_weights(src_path);
    if (a.info) return print_info(*src, a.json);
    if (a.dst.empty()) throw UserError("no destination given", "ds convert-ckpt SRC DST (or --info SRC); see ds convert-ckpt --help");
    if (src->kind() == WeightsKind::peft_adapter)
      throw UserError("'" + a.src + "' is a PEFT adapter directory, which ds converts only from its own LoRA runs",
                      "train from it (model.init_from, with model.lora as its adapter_config.json says), or merge it with PEFT");
    if (src->kind() == WeightsKind::safetensors_file)
      throw UserError("a lone .safetensors file does not say which model it holds",
                      "convert a Hugging Face directory (config.json beside the weights), or train from the file with "
                      "model.init_from=" + a.src + " and a model block describing it");
    if (src->kind() == WeightsKind::hf_directory) {
      if (a.to == "hf" || a.to == "safetensors") throw UserError("'" + a.src + "' is already a Hugging Face directory", "");
      return import_hf(*src, a);
    }
    if (a.adapter && (a.to == "ds" || a.world_size > 0 || a.stage >= 0))
      throw UserError("--adapter exports; it does not combine with --to ds, --world-size or --stage", "give one or the other");
    if (a.to == "ds" || a.world_size > 0 || a.stage >= 0) return reshard_ds(*src, a);
    if (a.merge && a.adapter) throw UserError("--adapter and --merge are exclusive", "--adapter writes the adapter alone, --merge the base with it folded in");
    if (!a.base.empty() && !a.merge) throw UserError("--base goes with --merge", "");
    if (a.adapter || a.merge || src->frozen_part) return export_adapter(*src, a);
    std::string to = a.to;
    if (to.empty()) to = ends_with(a.dst, ".safetensors") ? "safetensors" : "hf";
    check_destination(a, {src->path()}, true);
    std::error_code ec;
    if (fs::exists(a.dst, ec) && to == "hf" && !fs::is_directory(a.dst, ec)) throw UserError("'" + a.dst + "' is a file, not a directory", "");
    const std::vector<TokenizerFile> tokenizer = to == "hf" ? tokenizer_files(src->path()) : std::vector<TokenizerFile>{};
    ExportOptions opt;
    opt.dtype = a.dtype;
    opt.allow_fp16_overflow = a.allow_fp16_overflow;
    opt.max_shard_bytes = static_cast<uint64_t>(size_flag("--max-shard-size", a.max_shard_size));
    const ModelSpec model = build_model_spec(src->model());
    std::cerr << "ds convert-ckpt: " << src->path() << " (step " << src->step << ", " << format_count(model.num_params)
              << " parameters, saved by " << saved_by(*src) << " at ZeRO stage "
              << src->zero_stage << ") -> " << a.dst << " as " << (to == "hf" ? "a Hugging Face directory" : "one safetensors file")
              << ", " << a.dtype << "\n";
    const ExportSummary s = to == "hf" ? export_hf_directory(*src, src->model(), a.dst, opt) : export_safetensors_file(*src, model, a.dst, opt);
    report_export(s);
    write_tokenizer_files(tokenizer, a.dst);
    std::cerr << "ds convert-ckpt: " << s.tensors << " tensors, " << format_bytes(static_cast<double>(s.tensor_bytes)) << "\n";
    return kExitOk;
  }, a.json);
}

}  // namespace

Subcommand setup_convert_ckpt(CLI::App& app) {
  auto a = std::make_shared<ConvertArgs>();
  CLI::App* sub = app.add_subcommand("convert-ckpt", "ds checkpoints to Hugging Face safetensors and back; describe any checkpoint");
  sub->add_option("SRC", a->src, "a ds run directory (its newest checkpoint) or checkpoint directory, a DeepSpeed checkpoint "
                                 "folder (holding `latest`, or a global_stepN folder), or a Hugging Face directory (imported "
                                 "as a ds run at step 0); with --info also a .safetensors file")
      ->required();
  sub->add_option("DST", a->dst, "a directory (Hugging Face layout) or a file ending in .safetensors (one consolidated file)");
  sub->add_option("--to", a->to, "force the destination's kind: hf (directory), safetensors (one file) or ds (a run "
                                 "directory; implied by --world-size and --stage; from a DeepSpeed checkpoint, a ds run that "
                                 "resumes it with its optimizer state)")
      ->check(CLI::IsMember({"hf", "safetensors", "ds"}));
  sub->add_option("--world-size", a->world_size, "ds -> ds: shard the checkpoint for this many ranks (default: as saved)")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--stage", a->stage, "ds -> ds: the ZeRO stage to shard for, 0-3 (default: as saved)")->check(CLI::Range(0, 3));
  sub->add_option("--dtype", a->dtype, "the exported weights' dtype: fp32 (default, the master weights as stored), bf16, fp16")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  sub->add_flag("--allow-fp16-overflow", a->allow_fp16_overflow,
                "with --dtype fp16: write values beyond fp16's range (+-65504) as +-inf instead of refusing the export");
  sub->add_option("--max-shard-size,--max_shard_size", a->max_shard_size,
                  "split a Hugging Face export into shards of at most this size, with model.safetensors.index.json "
                  "(default 5GB; GB = 10^9 bytes, GiB = 2^30)");
  sub->add_option("-t,--tag", a->tag, "the checkpoint of a run directory to read (e.g. step_00000300; default: the newest complete "
                                     "one), or of a DeepSpeed folder (e.g. global_step500; default: the one `latest` names)");
  sub->add_flag("--exclude-frozen-parameters", a->exclude_frozen,
                "DeepSpeed's zero_to_fp32 flag: leave a DeepSpeed checkpoint's frozen parameters out; a ds checkpoint holds only "
                "what trained (a LoRA run: the adapter), so nothing is excluded there");
  sub->add_flag("--from-module-weights", a->module_weights,
                "a DeepSpeed checkpoint (ZeRO 0-2): export the module's weights (the bf16 or fp16 values it trained with, "
                "written in --dtype, fp32 by default) instead of the fp32 master weights of its optimizer files");
  sub->add_option("--hf-config", a->hf_config,
                  "a DeepSpeed checkpoint exported as a Hugging Face directory: the model's config.json (or its folder); "
                  "default: the config.json beside the checkpoint, where Hugging Face's Trainer saves it");
  sub->add_flag("--adapter", a->adapter,
                "a LoRA run (model.lora) -> PEFT's adapter directory (adapter_config.json, adapter_model.safetensors)");
  sub->add_flag("--merge", a->merge,
                "a run with frozen weights (model.lora, model.freeze) -> the whole model: its base with the adapter folded in "
                "(W + alpha/r B A) or the trained tensors put back, as a Hugging Face directory or one .safetensors file; "
                "the base is the run's model.init_from, checked against the checksum the run recorded");
  sub->add_option("--base", a->base, "with --merge: the base's weights, where the run's model.init_from has moved");
  sub->add_flag("--info", a->info, "describe SRC (kind, step, model, ZeRO stage and world size, every tensor) and exit");
  sub->add_flag("--json", a->json, "with --info: the description as JSON");
  sub->add_flag("--overwrite", a->overwrite, "replace the files ds writes in an existing DST");
  sub->footer(R"(Examples:
  ds convert-ckpt runs/quickstart out/quickstart-hf
      the newest checkpoint of a run as a Hugging Face directory (config.json, model.safetensors,
      generation_config.json): transformers' from_pretrained loads it
  ds convert-ckpt runs/gpt2/checkpoints/step_00000300 gpt2.safetensors --dtype bf16
      one consolidated file, whatever ZeRO stage and world size saved it (zero_to_fp32's job)
  ds convert-ckpt runs/gpt2 out/ --max-shard-size 2GB
      shards model-00001-of-0000N.safetensors and model.safetensors.index.json
  ds convert-ckpt --info runs/gpt2 --json
  ds convert-ckpt runs/gpt2 runs/gpt2-w8 --world-size 8 --stage 3
      the same state sharded as an 8-rank ZeRO-3 run owns it (ds train ... --resume reads any layout;
      this writes the one it will save, so every rank reads only its own file)
  ds convert-ckpt path/to/hf-llama runs/llama-init
      a Hugging Face directory as a ds run directory (a checkpoint at step 0, optimizer fresh)
  ds train my.json model.init_from=out/quickstart-hf
      start training from exported (or downloaded Hugging Face) weights
  ds convert-ckpt runs/lora out/lora-adapter --adapter
      a LoRA run's adapter in PEFT's format: PeftModel.from_pretrained(base, "out/lora-adapter")
  ds convert-ckpt runs/lora out/lora-merged --merge
      the base with the adapter folded in: a plain Hugging Face directory
  ds convert-ckpt --info output/checkpoint-500
      a DeepSpeed checkpoint (the folder holding `latest`): step, ZeRO stage, world size, dtypes, the
      config's main keys, every tensor; reads the pickles only, never a weight
  ds convert-ckpt output/checkpoint-500 out/model.safetensors
      its fp32 master weights consolidated from every rank's partition (zero_to_fp32's job, one
      tensor in memory at a time); a folder as DST writes a Hugging Face directory with the
      config.json found beside the checkpoint (or --hf-config PATH)
  ds convert-ckpt output/checkpoint-500 runs/continued --to ds
      the DeepSpeed run as a ds run (fp32 master, Adam's moments, step, loss scaler); continue it with
      ds train ds_config.json train.output_dir=runs/continued --resume

Memory stays bounded by the largest tensor: one tensor is read from the shards and written at a time.
Files are written to a temporary name and renamed, so an interrupted export leaves no partial file
under the final name. See ds-convert-ckpt(1).)");
  return {sub, [a] { return run_convert(*a); }};
}

}  // namespace ds::cli
