#include "cli/convert_ckpt.hpp"

#include <filesystem>
#include <functional>
#include <iostream>

#include <sys/mman.h>

#include <nlohmann/json.hpp>

#include "common/format.hpp"
#include "common/strings.hpp"
#include "cli/plan_json.hpp"
#include "engine/plan/plan.hpp"
#include "engine/runtime/checkpoint.hpp"
#include "engine/runtime/run_policy.hpp"
#include "engine/runtime/weights.hpp"
#include "schema/loader.hpp"

namespace ds::cli {
namespace {

namespace fs = std::filesystem;

struct ConvertArgs {
  std::string src, dst, to, dtype = "fp32", max_shard_size = "5GB", tag;
  bool info = false, json = false, overwrite = false, exclude_frozen = false;
};

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
      j["world_size"] = src.world_size;
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
              << "  saved by    " << src.world_size << (src.world_size == 1 ? " rank" : " ranks") << " at ZeRO stage "
              << src.zero_stage << ", " << src.precision << " training (fp32 master weights stored)\n";
  }
  std::cout << "  parameters  " << format_count(params) << " in " << src.tensors().size() << " tensors\n";
  for (const auto& t : src.tensors()) std::cout << "    " << pad(t.name, 48) << pad(t.dtype, 6) << format_shape(t.shape) << "\n";
  return kExitOk;
}

// A run that read GPT-2 BPE text: its vocab.json and merges.txt beside a Hugging Face export, which is
// what transformers' GPT2Tokenizer loads. A file no longer where the run read it is named, not fatal.
void copy_tokenizer_files(const std::string& checkpoint, const std::string& out_dir) {
  nlohmann::json data;
  try {
    data = nlohmann::json::parse(read_checkpoint_text(checkpoint, "config_json")).at("data");
  } catch (const nlohmann::json::exception&) {
    return;
  }
  if (data.value("tokenizer", "") != "gpt2" || data.value("type", "") != "text") return;
  for (const auto& [key, name] : {std::pair{"vocab_file", "vocab.json"}, {"merges_file", "merges.txt"}}) {
    const std::string from = data.contains(key) && data[key].is_string() ? data[key].get<std::string>() : "";
    std::error_code ec;
    if (from.empty() || !fs::is_regular_file(from, ec)) {
      print_warnings("convert-ckpt", {{std::string("data.") + key, "the run's tokenizer file '" + from + "' is not here; not copied",
                                       std::string("copy it into the export as ") + name + " for transformers' GPT2Tokenizer"}});
      continue;
    }
    fs::copy_file(from, fs::path(out_dir) / name, fs::copy_options::overwrite_existing, ec);
    if (ec) throw std::runtime_error("cannot copy '" + from + "' to '" + (fs::path(out_dir) / name).string() + "': " + ec.message());
    std::cerr << "  copied " << from << " -> " << (fs::path(out_dir) / name).string() << "\n";
  }
}

// Never replace what the user did not name: an existing destination needs --overwrite.
void check_destination(const ConvertArgs& a) {
  std::error_code ec;
  if (fs::exists(a.dst, ec) && !a.overwrite && !(fs::is_directory(a.dst, ec) && fs::is_empty(a.dst, ec)))
    throw UserError("'" + a.dst + "' already exists", "choose a new destination, or add --overwrite to replace the files ds writes there");
}

// A Hugging Face directory -> a ds run directory holding a step-0 checkpoint: the weights as fp32 master
// weights, the optimizer's moments zero, the model from the directory's config.json. `ds train` with
// train.output_dir=DST --resume continues from it, or model.init_from=DST starts from its weights.
int import_hf(const WeightSource& src, const ConvertArgs& a) {
  check_destination(a);
  if (a.overwrite) print_warnings("convert-ckpt", prepare_run_dir(a.dst, false, true));  // only what ds wrote there
  const fs::path hf_config = fs::path(src.path()) / "config.json";
  if (!fs::exists(hf_config)) throw UserError("'" + src.path() + "' has no config.json", "a Hugging Face model directory has one beside its weights");
  // The model from the directory's config.json, through the loader (the checkpoint stores the resolved config).
  const std::string cfg_text = nlohmann::json{{"train_micro_batch_size_per_gpu", 1},
                                               {"model", {{"hf_config", fs::absolute(hf_config).string()}}},
                                               {"train", {{"output_dir", a.dst}, {"steps", 1}}}}.dump(2);
  const LoadedConfig loaded = load_config_text_with_json(cfg_text, hf_config.string());
  Topology one;
  one.world_size_source = "convert-ckpt";
  const Plan plan = compile_plan(loaded.config, build_model_spec(resolve_model_hyper(loaded.config.model)), one);
  match_weights(src, plan.model);  // names and shapes, before anything is allocated
  const int64_t P = plan.layout.numel;
  std::vector<float> master(static_cast<size_t>(P));
  load_weights(src, plan.model, master.data());
  // The moments are zero: one read-only anonymous mapping serves both, and its pages stay the kernel's
  // shared zero page (no memory) while the writer reads them.
  const size_t zero_bytes = static_cast<size_t>(P) * sizeof(float);
  void* zeros = mmap(nullptr, zero_bytes, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (zeros == MAP_FAILED) throw std::runtime_error("cannot map " + format_bytes(static_cast<double>(zero_bytes)) + " of zeros");
  const std::unique_ptr<void, std::function<void(void*)>> unmap(zeros, [zero_bytes](void* p) { munmap(p, zero_bytes); });
  float* zero_moments = static_cast<float*>(zeros);  // read only: save_checkpoint never writes its buffers
  CheckpointBuffers b{master.data(), zero_moments, zero_moments, P, owned_segments(plan.layout, 0), P};
  CheckpointScalars sc;
  sc.seed = plan.run.seed;
  const SavedCheckpoint saved = save_checkpoint(a.dst, sc, b, plan_to_json(plan), loaded.resolved_json, 0);
  std::cerr << "ds convert-ckpt: " << src.path() << " (" << model_arch_name(plan.model.hp.arch) << ", "
            << format_count(plan.model.num_params) << " parameters) -> " << saved.path << " (step 0, optimizer fresh, "
            << format_bytes(static_cast<double>(saved.bytes)) << ")\n"
            << "  train from it: ds train CONFIG model.init_from=" << a.dst << "\n";
  return kExitOk;
}

int run_convert(const ConvertArgs& a) {
  return run_guarded("convert-ckpt", [&]() -> int {
    std::string src_path = a.src;
    if (!a.tag.empty()) src_path = (fs::path(a.src) / "checkpoints" / a.tag).string();  // zero_to_fp32's -t
    const std::unique_ptr<WeightSource> src = open_weights(src_path);
    if (a.info) return print_info(*src, a.json);
    if (a.dst.empty()) throw UserError("no destination given", "ds convert-ckpt SRC DST (or --info SRC); see ds convert-ckpt --help");
    if (src->kind() == WeightsKind::safetensors_file)
      throw UserError("a lone .safetensors file does not say which model it holds",
                      "convert a Hugging Face directory (config.json beside the weights), or train from the file with "
                      "model.init_from=" + a.src + " and a model block describing it");
    if (src->kind() == WeightsKind::hf_directory) return import_hf(*src, a);
    std::string to = a.to;
    if (to.empty()) to = ends_with(a.dst, ".safetensors") ? "safetensors" : "hf";
    check_destination(a);
    std::error_code ec;
    if (fs::exists(a.dst, ec) && to == "hf" && !fs::is_directory(a.dst, ec)) throw UserError("'" + a.dst + "' is a file, not a directory", "");
    ExportOptions opt;
    opt.dtype = a.dtype;
    opt.max_shard_bytes = static_cast<uint64_t>(size_flag("--max-shard-size", a.max_shard_size));
    const ModelSpec model = build_model_spec(src->model());
    std::cerr << "ds convert-ckpt: " << src->path() << " (step " << src->step << ", " << format_count(model.num_params)
              << " parameters, saved by " << src->world_size << (src->world_size == 1 ? " rank" : " ranks") << " at ZeRO stage "
              << src->zero_stage << ") -> " << a.dst << " as " << (to == "hf" ? "a Hugging Face directory" : "one safetensors file")
              << ", " << a.dtype << "\n";
    const ExportSummary s = to == "hf" ? export_hf_directory(*src, src->model(), a.dst, opt) : export_safetensors_file(*src, model, a.dst, opt);
    for (const auto& f : s.files) std::cerr << "  wrote " << f << "\n";
    if (to == "hf") copy_tokenizer_files(src->path(), a.dst);
    std::cerr << "ds convert-ckpt: " << s.tensors << " tensors, " << format_bytes(static_cast<double>(s.tensor_bytes)) << "\n";
    return kExitOk;
  }, a.json);
}

}  // namespace

Subcommand setup_convert_ckpt(CLI::App& app) {
  auto a = std::make_shared<ConvertArgs>();
  CLI::App* sub = app.add_subcommand("convert-ckpt", "ds checkpoints to Hugging Face safetensors and back; describe any checkpoint");
  sub->add_option("SRC", a->src, "a ds run directory (its newest checkpoint) or checkpoint directory, or a Hugging Face "
                                 "directory (imported as a ds run at step 0); with --info also a .safetensors file")
      ->required();
  sub->add_option("DST", a->dst, "a directory (Hugging Face layout) or a file ending in .safetensors (one consolidated file)");
  sub->add_option("--to", a->to, "force the destination's kind: hf (directory) or safetensors (one file)")
      ->check(CLI::IsMember({"hf", "safetensors"}));
  sub->add_option("--dtype", a->dtype, "the exported weights' dtype: fp32 (default, the master weights as stored), bf16, fp16")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  sub->add_option("--max-shard-size,--max_shard_size", a->max_shard_size,
                  "split a Hugging Face export into shards of at most this size, with model.safetensors.index.json "
                  "(default 5GB; GB = 10^9 bytes, GiB = 2^30)");
  sub->add_option("-t,--tag", a->tag, "the checkpoint of a run directory to read (e.g. step_00000300; default: the newest complete one)");
  sub->add_flag("--exclude-frozen-parameters", a->exclude_frozen,
                "DeepSpeed's zero_to_fp32 flag; ds trains every parameter, so nothing is excluded");
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
  ds convert-ckpt path/to/hf-llama runs/llama-init
      a Hugging Face directory as a ds run directory (a checkpoint at step 0, optimizer fresh)
  ds train my.json model.init_from=out/quickstart-hf
      start training from exported (or downloaded Hugging Face) weights

Memory stays bounded by the largest tensor: one tensor is read from the shards and written at a time.
Files are written to a temporary name and renamed, so an interrupted export leaves no partial file
under the final name. See ds-convert-ckpt(1).)");
  return {sub, [a] { return run_convert(*a); }};
}

}  // namespace ds::cli
