// ds convert-ckpt on a DeepSpeed checkpoint: describe it (--info), or write its weights as one
// .safetensors file or a Hugging Face directory, tensor by tensor, without Python or its pickles running.
#include <filesystem>
#include <iostream>
#include <memory>

#include <nlohmann/json.hpp>

#include "cli/common.hpp"
#include "cli/convert_args.hpp"
#include "common/files.hpp"
#include "common/format.hpp"
#include "common/strings.hpp"
#include "engine/runtime/io/deepspeed_checkpoint.hpp"

namespace ds::cli {
namespace {

namespace fs = std::filesystem;

const char* from_name(DeepSpeedParam::From f) {
  switch (f) {
    case DeepSpeedParam::From::module: return "module";
    case DeepSpeedParam::From::flat_group: return "fp32 partitions";
    case DeepSpeedParam::From::stage3_flat: return "fp32 partitions";
    case DeepSpeedParam::From::frozen: return "frozen";
  }
  return "?";
}

// The config keys a person checks first, as "key value" pairs (absent keys left out).
std::vector<std::pair<std::string, std::string>> main_keys(const nlohmann::json& c) {
  std::vector<std::pair<std::string, std::string>> out;
  auto add = [&](const std::string& label, const nlohmann::json::json_pointer& at) {
    if (c.is_object() && c.contains(at)) out.emplace_back(label, c.at(at).is_string() ? c.at(at).get<std::string>() : c.at(at).dump());
  };
  add("train_batch_size", nlohmann::json::json_pointer("/train_batch_size"));
  add("train_micro_batch_size_per_gpu", nlohmann::json::json_pointer("/train_micro_batch_size_per_gpu"));
  add("gradient_accumulation_steps", nlohmann::json::json_pointer("/gradient_accumulation_steps"));
  add("optimizer.type", nlohmann::json::json_pointer("/optimizer/type"));
  add("optimizer.params.lr", nlohmann::json::json_pointer("/optimizer/params/lr"));
  add("scheduler.type", nlohmann::json::json_pointer("/scheduler/type"));
  add("zero_optimization.stage", nlohmann::json::json_pointer("/zero_optimization/stage"));
  add("bf16.enabled", nlohmann::json::json_pointer("/bf16/enabled"));
  add("fp16.enabled", nlohmann::json::json_pointer("/fp16/enabled"));
  add("gradient_clipping", nlohmann::json::json_pointer("/gradient_clipping"));
  return out;
}

std::string weights_read(const DeepSpeedCheckpoint& c, bool module_weights) {
  if (module_weights || !c.has_master()) return std::string("the module's ") + st_dtype_name(c.module_dtype()) + " weights";
  return "the fp32 master weights (" + std::to_string(c.world_size()) + (c.world_size() == 1 ? " partition" : " partitions") + ")";
}

int print_deepspeed_info(const DeepSpeedCheckpoint& c, bool as_json) {
  int64_t params = 0, frozen = 0;
  uint64_t bytes = 0;
  for (const DeepSpeedParam& p : c.params()) {
    params += p.numel;
    if (p.from == DeepSpeedParam::From::frozen) ++frozen;
  }
  std::error_code ec;
  for (const std::string& f : c.files()) bytes += fs::file_size(f, ec);
  if (as_json) {
    nlohmann::ordered_json j;
    j["schema_version"] = 1;
    j["kind"] = "DeepSpeed checkpoint";
    j["path"] = c.dir();
    j["tag"] = c.tag();
    j["ds_version"] = c.ds_version();
    j["step"] = c.step();
    j["global_samples"] = c.global_samples();
    j["skipped_steps"] = c.skipped_steps();
    j["world_size"] = c.world_size();
    j["zero_stage"] = c.stage();
    j["module_dtype"] = st_dtype_name(c.module_dtype());
    j["fp32_master"] = c.has_master();
    j["adam_moments"] = c.has_moments();
    j["num_params"] = params;
    j["tied"] = nlohmann::ordered_json::object();
    for (const auto& [alias, source] : c.tied()) j["tied"][alias] = source;
    j["config"] = c.config();
    j["files"] = c.files();
    nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
    for (const DeepSpeedParam& p : c.params())
      tensors.push_back({{"name", p.name}, {"shape", p.shape}, {"from", p.buffer ? "buffer" : from_name(p.from)}});
    j["tensors"] = tensors;
    std::cout << j.dump(2) << "\n";
    return kExitOk;
  }
  std::cout << c.dir() << ": DeepSpeed checkpoint " << c.tag() << (c.ds_version().empty() ? "" : " (DeepSpeed " + c.ds_version() + ")") << "\n"
            << "  step        " << c.step() << " (" << format_count(c.global_samples()) << " samples"
            << (c.skipped_steps() ? ", " + std::to_string(c.skipped_steps()) + " steps skipped on overflow" : std::string()) << ")\n"
            << "  saved by    " << c.world_size() << (c.world_size() == 1 ? " rank" : " ranks") << " at ZeRO stage " << c.stage()
            << ", module weights " << st_dtype_name(c.module_dtype()) << "\n"
            << "  weights     " << weights_read(c, false) << (c.has_moments() ? "; Adam moments stored" : "") << "\n"
            << "  parameters  " << format_count(params) << " in " << c.params().size() << " tensors"
            << (frozen ? " (" + std::to_string(frozen) + " frozen)" : std::string()) << "\n";
  for (const auto& [alias, source] : c.tied()) std::cout << "  tied        " << alias << " = " << source << " (written once)\n";
  const auto keys = main_keys(c.config());
  if (!keys.empty()) {
    std::cout << "  config     ";
    for (const auto& [k, v] : keys) std::cout << " " << k << "=" << v;
    std::cout << "\n";
  }
  std::cout << "  files       " << c.files().size() << " read (" << format_bytes(static_cast<double>(bytes)) << "):\n";
  for (const std::string& f : c.files()) std::cout << "    " << fs::path(f).filename().string() << "\n";
  for (const DeepSpeedParam& p : c.params())
    std::cout << "    " << pad(p.name, 48) << pad(format_shape(p.shape), 16) << (p.buffer ? "buffer" : from_name(p.from)) << "\n";
  return kExitOk;
}

// The Hugging Face config.json to ship: --hf-config, else the one Hugging Face's Trainer saves beside the
// checkpoint (in the folder holding `latest`, or the tag folder). With it, the tokenizer and generation
// files found beside it, so the export loads as the model did.
std::string find_hf_config(const ConvertArgs& a, const DeepSpeedCheckpoint& c) {
  if (!a.hf_config.empty()) {
    const fs::path p = fs::is_directory(a.hf_config) ? fs::path(a.hf_config) / "config.json" : fs::path(a.hf_config);
    if (!fs::is_regular_file(p)) throw UserError("--hf-config '" + a.hf_config + "': no config.json there", "give the model's config.json or its folder");
    return p.string();
  }
  for (const fs::path& dir : {fs::path(a.src), fs::path(c.dir())})
    if (fs::is_regular_file(dir / "config.json")) return (dir / "config.json").string();
  return "";
}

}  // namespace

int convert_deepspeed(const ConvertArgs& a) {
  {
    auto ckpt = std::make_shared<const DeepSpeedCheckpoint>(a.src, a.tag);
    if (a.info) return print_deepspeed_info(*ckpt, a.json);
    if (a.dst.empty()) throw UserError("no destination given", "ds convert-ckpt DEEPSPEED_DIR OUT (a folder, or a file ending in .safetensors); or --info DEEPSPEED_DIR");
    if (a.to == "ds" || a.world_size > 0 || a.stage >= 0)
      throw UserError("a DeepSpeed checkpoint cannot be written as a ds run yet (--to ds, --world-size, --stage)",
                      "export its weights (DST a folder or a .safetensors file) and start a ds run from them with model.init_from=DST; "
                      "the optimizer's moments then start fresh");
    if (a.adapter || a.merge || !a.base.empty())
      throw UserError("--adapter, --merge and --base apply to ds's own LoRA runs", "a DeepSpeed checkpoint exports its weights as they are");
    const DeepSpeedSource src(ckpt, a.module_weights, a.exclude_frozen);
    const bool one_file = a.to == "safetensors" || (a.to.empty() && ends_with(a.dst, ".safetensors"));
    std::string config_json;
    std::vector<std::pair<std::string, std::string>> extra;
    if (!one_file) {
      const std::string config = find_hf_config(a, *ckpt);
      if (config.empty())
        throw UserError("a Hugging Face directory needs the model's config.json, which a DeepSpeed checkpoint does not hold (none in '" + a.src +
                            "' either)",
                        "give it with --hf-config PATH (the config.json of the model you trained), or write one file: a DST ending in .safetensors");
      config_json = read_file_bytes(config);
      try {
        if (!nlohmann::json::parse(config_json).is_object()) throw UserError("'" + config + "' is not a JSON object", "");
      } catch (const nlohmann::json::exception& e) {
        throw UserError("'" + config + "' is not valid JSON: " + e.what(), "");
      }
      for (const char* name : {"generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                               "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja"}) {
        const fs::path p = fs::path(config).parent_path() / name;
        std::error_code ec;
        if (fs::is_regular_file(p, ec)) extra.emplace_back(name, read_file_bytes(p.string()));
      }
    }
    check_destination(a, {a.src, ckpt->dir()}, !one_file);
    std::error_code ec;
    if (!one_file && fs::exists(a.dst, ec) && !fs::is_directory(a.dst, ec)) throw UserError("'" + a.dst + "' is a file, not a directory", "");
    ExportOptions opt;
    opt.dtype = a.dtype;
    opt.allow_fp16_overflow = a.allow_fp16_overflow;
    opt.max_shard_bytes = static_cast<uint64_t>(size_flag("--max-shard-size", a.max_shard_size));
    int64_t params = 0;
    for (const NamedShape& t : src.tensors()) params += t.numel();
    std::cerr << "ds convert-ckpt: " << ckpt->dir() << " (DeepSpeed, step " << ckpt->step() << ", ZeRO stage " << ckpt->stage() << " on "
              << ckpt->world_size() << (ckpt->world_size() == 1 ? " rank" : " ranks") << ", " << format_count(params) << " parameters) -> "
              << a.dst << " as " << (one_file ? "one safetensors file" : "a Hugging Face directory") << ", " << a.dtype << "\n"
              << "  reading " << weights_read(*ckpt, a.module_weights) << ", one tensor at a time\n";
    for (const auto& [alias, source] : ckpt->tied()) std::cerr << "  " << alias << " is tied to " << source << ": written once, as transformers saves it\n";
    const ExportSummary s = export_as_named(src, a.dst, config_json, extra, opt);
    for (const auto& f : s.files) std::cerr << "  wrote " << f << "\n";
    for (const auto& f : s.removed) std::cerr << "  removed " << f << " (the previous export's)\n";
    if (s.fp16_overflowed > 0)
      print_warnings("convert-ckpt", {{"", std::to_string(s.fp16_overflowed) + " values beyond fp16's range were written as +-inf (--allow-fp16-overflow)", ""}});
    if (s.fp16_flushed > 0)
      print_warnings("convert-ckpt", {{"", std::to_string(s.fp16_flushed) + " nonzero values smaller than fp16's least subnormal (2^-24) were written as 0",
                                       "--dtype bf16 keeps fp32's range"}});
    std::cerr << "ds convert-ckpt: " << s.tensors << " tensors, " << format_bytes(static_cast<double>(s.tensor_bytes)) << "\n";
    return kExitOk;
  }
}

}  // namespace ds::cli
