// ds convert-ckpt on a DeepSpeed checkpoint: describe it (--info), or write its weights as one
// .safetensors file or a Hugging Face directory, tensor by tensor, without Python or its pickles running.
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>

#include <nlohmann/json.hpp>

#include "cli/common.hpp"
#include "cli/convert_args.hpp"
#include "common/files.hpp"
#include "common/format.hpp"
#include "common/strings.hpp"
#include "cli/run_policy.hpp"
#include "engine/plan/plan.hpp"
#include "engine/plan/plan_record.hpp"
#include "engine/runtime/io/deepspeed_checkpoint.hpp"
#include "schema/loader.hpp"

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
  std::vector<std::string> files = c.files();  // listed by name (read rank by rank, each's model and optimizer files)
  std::sort(files.begin(), files.end());
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
    j["files"] = files;
    nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
    for (const DeepSpeedParam& p : c.params())
      tensors.push_back({{"name", p.name}, {"shape", p.shape}, {"from", p.buffer ? "buffer" : from_name(p.from)}});
    j["tensors"] = tensors;
    std::cout << j.dump(2) << "\n";
    return kExitOk;
  }
  std::cout << c.dir() << ": DeepSpeed checkpoint " << c.tag() << (c.ds_version().empty() ? "" : " (DeepSpeed " + c.ds_version() + ")") << "\n"
            << "  step        " << c.step() << " (" << format_count(c.global_samples()) << " samples"
            << (c.skipped_steps() ? ", " + std::to_string(c.skipped_steps()) + (c.skipped_steps() == 1 ? " step" : " steps") + " skipped on overflow" : std::string()) << ")\n"
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
  for (const std::string& f : files) std::cout << "    " << fs::path(f).filename().string() << "\n";
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

double number_in(const PyValue* v, double fallback) {
  if (v && v->is(PyKind::real)) return v->real;
  if (v && v->is(PyKind::integer)) return static_cast<double>(v->integer);
  return fallback;
}

// A DeepSpeed checkpoint -> a ds run directory that `ds train --resume` continues: the fp32 master weights
// and both Adam moments laid out for ds's plan at the checkpoint's world size and stage (one file per rank
// where the plan shards), the step, the skipped steps and the loss scaler; the stored config is DeepSpeed's
// own, read by ds's schema, with the model from the Hugging Face config.json. Streamed: one piece of each
// buffer in memory at a time.
int import_deepspeed(const ConvertArgs& a, const std::shared_ptr<const DeepSpeedCheckpoint>& ckpt) {
  const DeepSpeedCheckpoint& c = *ckpt;
  const std::string resume_instead = "start from its weights instead: model.init_from=" + a.src + " (the optimizer's moments start fresh)";
  if (!c.has_moments()) throw UserError("'" + c.dir() + "' cannot be resumed in ds: " + c.moments_missing(), resume_instead);
  for (const DeepSpeedParam& p : c.params())
    if (p.from == DeepSpeedParam::From::frozen || p.buffer)
      throw UserError("'" + c.dir() + "' holds " + (p.buffer ? "the buffer" : "the frozen parameter") + " '" + p.name +
                          "', which a resumed ds run would not keep as DeepSpeed did",
                      resume_instead);
  if (a.dtype != "fp32")
    throw UserError("--dtype " + a.dtype + " does not apply to a ds run: it holds fp32 master weights", "leave --dtype out");
  if (a.world_size > 0 || a.stage >= 0)
    throw UserError("--world-size and --stage: a DeepSpeed checkpoint is written as it was saved (" + std::to_string(c.world_size()) +
                        " ranks, ZeRO stage " + std::to_string(c.stage()) + ")",
                    "ds train --resume reads it at any world size and stage; to reshard ahead of time, run ds convert-ckpt on the "
                    "written run with --world-size and --stage");
  if (ends_with(a.dst, ".safetensors")) throw UserError("--to ds writes a run directory, not '" + a.dst + "'", "give a directory for the run");
  const std::string hf_config = find_hf_config(a, c);
  if (hf_config.empty())
    throw UserError("a ds run needs the model's config.json, which a DeepSpeed checkpoint does not hold (none in '" + a.src + "' either)",
                    "give it with --hf-config PATH (the config.json of the model you trained)");
  check_destination(a, {a.src, c.dir()}, false);
  if (a.overwrite) print_warnings("convert-ckpt", prepare_run_dir({a.dst, false, "", true, {c.dir()}}));
  // DeepSpeed's config as the run's: ds's schema reads it as it reads any ds_config.json (warnings and refusals
  // name its keys); the model block and the output directory are added.
  nlohmann::json cfg = c.config();
  if (!cfg.is_object()) throw UserError("'" + c.dir() + "' stores no ds_config", "");
  cfg["model"] = {{"hf_config", fs::absolute(hf_config).string()}};
  cfg["train"] = {{"output_dir", a.dst}, {"steps", std::max<int64_t>(c.step(), 1)}};
  const std::string source = c.dir() + " (its ds_config)";
  const LoadedConfig loaded = load_config_text_with_json(cfg.dump(2), source);
  print_warnings("convert-ckpt", loaded.config.warnings);
  const ModelSpec spec = build_model_spec(resolve_model_hyper(loaded.config.model));
  const int world = static_cast<int>(c.world_size());
  const Plan lead = plan_for_rank(loaded.config, spec, world, 0, "the DeepSpeed checkpoint");
  if (lead.optimizer.moments != 2)
    throw UserError("the checkpoint's config trains with an optimizer without Adam's two moments in ds", resume_instead);
  // Each of ds's tensors is the DeepSpeed parameter of the same name (GPT-2 with or without "transformer.").
  const DeepSpeedSource src(ckpt, false, false);
  const std::vector<std::string> names = match_weights(src, lead.model);
  std::map<std::string, const DeepSpeedParam*> by_ds_name;
  for (size_t i = 0; i < lead.model.tensors.size(); ++i) by_ds_name[lead.model.tensors[i].name] = c.find(names[i]);
  std::vector<const DeepSpeedParam*> slot_param;
  for (const ParamSlot& slot : lead.layout.params) {
    const DeepSpeedParam* p = by_ds_name.count(slot.name) ? by_ds_name.at(slot.name) : nullptr;
    DS_CHECK(p != nullptr, "import_deepspeed: no DeepSpeed parameter for " + slot.name);
    slot_param.push_back(p);
  }
  CheckpointScalars sc;
  sc.step = c.step();
  sc.skipped_steps = c.skipped_steps();
  sc.applied_steps = c.step() - c.skipped_steps();
  sc.seed = lead.run.seed;
  if (const PyValue* ls = c.loss_scaler()) {
    sc.loss_scaler.scale = number_in(ls->get("cur_scale"), 1.0);
    sc.loss_scaler.iteration = static_cast<int64_t>(number_in(ls->get("cur_iter"), 0));
    sc.loss_scaler.last_overflow_iteration = static_cast<int64_t>(number_in(ls->get("last_overflow_iter"), -1));
    sc.loss_scaler.hysteresis_left = static_cast<int>(number_in(ls->get("cur_hysteresis"), 0));
  }
  auto shard_of = [&](int rank) {
    const Plan plan = rank == 0 ? lead : plan_for_rank(loaded.config, spec, world, rank, "the DeepSpeed checkpoint");
    CheckpointBuffers b{nullptr, nullptr, nullptr, plan.execution.local_numel, owned_segments(plan.layout, rank), plan.layout.numel};
    b.pieces.moments = 2;
    b.pieces.read = [&c, &slot_param, layout = plan.layout, segments = b.segments](int64_t at, int64_t n, float* m, float* m1, float* m2) {
      for (float* p : {m, m1, m2})
        if (p) std::fill(p, p + n, 0.0f);  // padding between segments
      for (const OwnedSegment& g : segments) {
        const int64_t lo = std::max(g.local, at), hi = std::min(g.local + g.numel, at + n);
        if (lo >= hi) continue;
        const ParamSlot& slot = layout.params[static_cast<size_t>(g.param)];
        const int64_t in_param = g.global - slot.offset + (lo - g.local);
        float* outs[3] = {m, m1, m2};
        for (int which = 0; which < 3; ++which)
          if (outs[which]) c.read_state(*slot_param[static_cast<size_t>(g.param)], which, in_param, hi - lo, outs[which] + (lo - at));
      }
    };
    return b;
  };
  // DeepSpeed records no data: the stored config leaves the block out (its defaults would not be what the run read),
  // so a resume's data block is taken as the run's, not reported as a change.
  nlohmann::json stored = nlohmann::json::parse(loaded.resolved_json);
  stored.erase("data");
  const SavedCheckpoint saved = write_run_checkpoint(a.dst, sc, lead.execution.sharded ? world : 1, shard_of, plan_to_json(lead),
                                                     stored.dump(2));
  std::cerr << "ds convert-ckpt: " << c.dir() << " (DeepSpeed, step " << c.step() << ", ZeRO stage " << c.stage() << " on " << world
            << (world == 1 ? " rank" : " ranks") << ") -> " << saved.path << " (fp32 master weights, Adam's moments, step "
            << c.step() << ", " << format_bytes(static_cast<double>(saved.bytes)) << ")\n"
            << "  resume it: ds train CONFIG train.output_dir=" << a.dst << (world > 1 ? " --nproc-per-node " + std::to_string(world) : "")
            << " --resume   (CONFIG: your ds_config.json with a model block; "
            << "the run's own config is stored in the checkpoint)\n";
  return kExitOk;
}

}  // namespace

int convert_deepspeed(const ConvertArgs& a) {
  {
    auto ckpt = std::make_shared<const DeepSpeedCheckpoint>(a.src, a.tag);
    if (a.info) return print_deepspeed_info(*ckpt, a.json);
    if (a.dst.empty()) throw UserError("no destination given", "ds convert-ckpt DEEPSPEED_DIR OUT (a folder, or a file ending in .safetensors); or --info DEEPSPEED_DIR");
    if (a.adapter || a.merge || !a.base.empty())
      throw UserError("--adapter, --merge and --base apply to ds's own LoRA runs", "a DeepSpeed checkpoint exports its weights as they are");
    if (a.to == "ds" || a.world_size > 0 || a.stage >= 0) {
      if (a.module_weights || a.exclude_frozen)
        throw UserError(std::string(a.module_weights ? "--from-module-weights" : "--exclude-frozen-parameters") +
                            " applies to an export; a ds run resumes from the fp32 master weights and every parameter",
                        "leave it out with --to ds");
      return import_deepspeed(a, ckpt);
    }
    const DeepSpeedSource src(ckpt, a.module_weights, a.exclude_frozen);
    const bool one_file = a.to == "safetensors" || (a.to.empty() && ends_with(a.dst, ".safetensors"));
    if (one_file && !a.hf_config.empty())
      print_warnings("convert-ckpt", {{"", "--hf-config has no effect on one .safetensors file (it holds no config.json)",
                                       "give a directory as DST for a Hugging Face directory with it"}});
    if (one_file && a.max_shard_size != ConvertArgs{}.max_shard_size)
      print_warnings("convert-ckpt", {{"", "--max-shard-size has no effect on one .safetensors file", "give a directory as DST to shard"}});
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
    report_export(s);
    std::cerr << "ds convert-ckpt: " << s.tensors << " tensors, " << format_bytes(static_cast<double>(s.tensor_bytes)) << "\n";
    return kExitOk;
  }
}

}  // namespace ds::cli
