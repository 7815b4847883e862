#include "engine/runtime/io/deepspeed_checkpoint.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>

#include "common/error.hpp"
#include "common/files.hpp"
#include "common/format.hpp"
#include "common/strings.hpp"

namespace ds {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kMaxWorld = 1 << 20;
constexpr int64_t kMaxNumel = int64_t{1} << 50;

bool has_model_states(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() >= 15 && n.compare(n.size() - 15, 15, "model_states.pt") == 0) return true;
  }
  return false;
}

// The first bytes of a small text file (`latest`): a huge or binary file is never read whole.
std::string read_head(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::string s(4096, '\0');
  in.read(s.data(), static_cast<std::streamsize>(s.size()));
  s.resize(static_cast<size_t>(in.gcount()));
  return s;
}

std::string trimmed(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

// A value the checkpoint must hold, with the file named when it does not.
const PyValue& need(const PyValue* v, const std::string& file, const std::string& key, PyKind kind) {
  if (!v || !v->is(kind))
  {
    PyValue wanted;
    wanted.kind = kind;
    throw UserError("'" + file + "' has " + (v ? std::string("a ") + v->kind_name() : std::string("no")) + " '" + key +
                        "' where a DeepSpeed checkpoint has a " + wanted.kind_name(),
                    "is this a checkpoint written by DeepSpeed's engine.save_checkpoint?");
  }
  return *v;
}

int64_t need_int(const PyValue& parent, const std::string& key, const std::string& file) {
  return need(parent.get(key), file, key, PyKind::integer).integer;
}

std::vector<int64_t> shape_of(const PyValue& v, const std::string& name, const std::string& file) {
  if (!v.is(PyKind::tuple) && !v.is(PyKind::list))
    throw UserError("'" + file + "': the shape of '" + name + "' is a " + v.kind_name() + ", not a tuple", "");
  std::vector<int64_t> shape;
  int64_t numel = 1;
  for (const PyValue* d : v.items) {
    if (!d->is(PyKind::integer) || d->integer < 0 || (d->integer > 0 && numel > kMaxNumel / d->integer))
      throw UserError("'" + file + "': the shape of '" + name + "' is not a list of sizes below 2^50 elements", "");
    shape.push_back(d->integer);
    numel *= d->integer;
  }
  return shape;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string model_name(const std::string& key) { return key.rfind("module.", 0) == 0 ? key.substr(7) : key; }


}  // namespace

bool is_deepspeed_checkpoint(const std::string& path) {
  std::error_code ec;
  const fs::path p(path);
  if (!fs::is_directory(p, ec)) return false;
  if (has_model_states(p)) return true;
  // `latest` alone is not enough: a ds run's checkpoints/ folder has one too. DeepSpeed's names a folder of
  // model-state files, or at least a global_stepN one (a dangling `latest` is then reported by the reader).
  if (!fs::is_regular_file(p / "latest", ec)) return false;
  const std::string tag = trimmed(read_head(p / "latest"));
  if (tag.rfind("global_step", 0) == 0) return true;
  if (!tag.empty() && tag.find('/') == std::string::npos && has_model_states(p / tag)) return true;
  for (const auto& e : fs::directory_iterator(p, ec))
    if (e.is_directory(ec) && has_model_states(e.path())) return true;
  return false;
}

// The files of one tag folder, by role. Anything DeepSpeed writes that ds does not read is refused by name.
struct DeepSpeedCheckpoint::TagFiles {
  std::map<int64_t, std::string> model, optim;  // by data-parallel rank (model: stage 3's per-rank files)
  std::string mp_model;                         // mp_rank_00_model_states.pt
  bool bf16_optim = false;
};

namespace {
DeepSpeedCheckpoint::TagFiles list_tag(const fs::path& dir) {
  static const std::regex mp_model(R"(mp_rank_(\d+)_model_states\.pt)"), zero_model(R"(zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt)"),
      optim(R"((bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt)");
  DeepSpeedCheckpoint::TagFiles t;
  std::error_code ec;
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir, ec)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  auto refuse_mp = [&](const std::string& n, const std::string& mp) {
    if (mp.find_first_not_of('0') != std::string::npos)
      throw UserError("'" + (dir / n).string() + "' is tensor-parallel rank " + mp + "'s: the run split its layers over ranks (mp_world_size > 1)",
                      "ds reads data-parallel DeepSpeed checkpoints (ZeRO 0-3); merge the model-parallel slices first "
                      "(DeepSpeed's ds_to_universal.py)");
  };
  std::smatch m;
  for (const std::string& n : names) {
    if (n.size() > 40) {
      if (n.find("model_states.pt") == std::string::npos && n.find("optim_states.pt") == std::string::npos) continue;
    }
    if (std::regex_match(n, m, mp_model)) {
      refuse_mp(n, m[1]);
      t.mp_model = (dir / n).string();
    } else if (std::regex_match(n, m, zero_model)) {
      refuse_mp(n, m[2]);
      if (m[1].length() > 7) throw UserError("'" + (dir / n).string() + "': a rank number beyond any world size", "");
      t.model[std::stoll(m[1])] = (dir / n).string();
    } else if (std::regex_match(n, m, optim)) {
      refuse_mp(n, m[3]);
      if (m[2].length() > 7) throw UserError("'" + (dir / n).string() + "': a rank number beyond any world size", "");
      t.optim[std::stoll(m[2])] = (dir / n).string();
      t.bf16_optim = t.bf16_optim || m[1].matched;
    } else if (n.rfind("layer_", 0) == 0 && n.find("model_states.pt") != std::string::npos) {
      throw UserError("'" + (dir / n).string() + "' is a pipeline stage's layer file: the run used DeepSpeed's PipelineModule",
                      "ds reads data-parallel DeepSpeed checkpoints (ZeRO 0-3) of Hugging Face models");
    } else if (n.rfind("expp_rank_", 0) == 0) {
      throw UserError("'" + (dir / n).string() + "' holds mixture-of-experts state (expert parallelism), which ds does not read", "");
    }
  }
  return t;
}
}  // namespace

DeepSpeedCheckpoint::DeepSpeedCheckpoint(const std::string& path, const std::string& tag) {
  locate(path, tag);
  const TagFiles t = list_tag(dir_);
  const PyValue& ms = open_model_states(t);
  open_optimizer_files(t);
  check_one_save();
  read_params(ms);
  if (params_.empty()) throw UserError("'" + dir_ + "' holds no parameters", "");
  collect_moments();
}

// dir_ and tag_: the tag folder `latest` (or `tag`) names under `path`, or `path` itself.
void DeepSpeedCheckpoint::locate(const std::string& path, const std::string& tag) {
  std::error_code ec;
  const fs::path root(path);
  if (!fs::is_directory(root, ec)) throw UserError("'" + path + "' is not a folder", "give the folder holding `latest`, or a global_stepN folder");
  auto tags_here = [&] {
    std::vector<std::string> found;
    for (const auto& e : fs::directory_iterator(root, ec))
      if (e.is_directory(ec) && has_model_states(e.path())) found.push_back(e.path().filename().string());
    std::sort(found.begin(), found.end());
    return found.empty() ? std::string("none") : join(found, ", ");
  };
  if (!tag.empty()) {
    tag_ = tag;
  } else if (fs::is_regular_file(root / "latest", ec)) {
    tag_ = trimmed(read_head(root / "latest"));
    if (tag_.empty()) throw UserError("'" + (root / "latest").string() + "' is empty", "name the checkpoint with --tag (here: " + tags_here() + ")");
  }
  if (!tag_.empty()) {
    if (tag_.find('/') != std::string::npos || tag_ == "." || tag_ == "..")
      throw UserError("the tag '" + tag_ + "' is not a folder name", "tags are folder names such as global_step500");
    dir_ = (root / tag_).string();
    if (!fs::is_directory(dir_, ec))
      throw UserError(std::string(tag.empty() ? "'latest' in '" + path + "' names '" + tag_ + "'" : "the tag '" + tag_ + "'") +
                          ", which is not a folder there",
                      "the checkpoints there: " + tags_here() + " (choose one with --tag)");
  } else {
    dir_ = root.string();
    tag_ = root.filename().string();
  }
}

// The model-state file (one below stage 3, rank 0's at stage 3) and what it records of the run.
const PyValue& DeepSpeedCheckpoint::open_model_states(const TagFiles& t) {
  // The model-state file: one below stage 3, one per rank at stage 3.
  lead_ = t.mp_model;
  if (lead_.empty() && t.model.count(0)) lead_ = t.model.at(0);
  if (lead_.empty())
    throw UserError("'" + dir_ + "' holds no mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt",
                    "give a DeepSpeed checkpoint folder (holding `latest`) or one of its global_stepN folders");
  model_files_.push_back(std::make_unique<TorchFile>(lead_));
  files_.push_back(lead_);
  const PyValue& ms = need(&model_files_[0]->root(), lead_, "the saved state", PyKind::dict);
  step_ = need_int(ms, "global_steps", lead_);
  if (const PyValue* v = ms.get("global_samples"); v && v->is(PyKind::integer)) global_samples_ = v->integer;
  if (const PyValue* v = ms.get("skipped_steps"); v && v->is(PyKind::integer)) skipped_steps_ = v->integer;
  if (const PyValue* v = ms.get("ds_version"); v && v->is(PyKind::string)) ds_version_ = v->text;
  if (const PyValue* v = ms.get("ds_config"); v && v->is(PyKind::dict)) config_ = pickle_to_json(*v, lead_);
  world_size_ = need_int(ms, "dp_world_size", lead_);
  if (world_size_ < 1 || world_size_ > kMaxWorld)
    throw UserError("'" + lead_ + "' records a world size of " + std::to_string(world_size_), "the file is damaged");
  if (const PyValue* v = ms.get("mp_world_size"); v && v->is(PyKind::integer) && v->integer > 1)
    throw UserError("'" + lead_ + "' was saved with " + std::to_string(v->integer) + " tensor-parallel ranks (mp_world_size)",
                    "ds reads data-parallel DeepSpeed checkpoints (ZeRO 0-3)");

  return ms;
}

// The optimizer files, one per rank, and the stage they record; at stage 3 every rank's model file too.
void DeepSpeedCheckpoint::open_optimizer_files(const TagFiles& t) {
  // The stage, from rank 0's optimizer file (none at stage 0 without bf16).
  if (!t.optim.empty()) {
    if (!t.optim.count(0)) throw UserError("'" + dir_ + "' lacks rank 0's optimizer file (zero_pp_rank_0_mp_rank_00_optim_states.pt)", "");
  }
  auto rank_file = [&](const std::map<int64_t, std::string>& files, const std::string& pattern, const char* what) {
    for (int64_t r = 0; r < world_size_; ++r)
      if (!files.count(r))
        throw UserError("'" + dir_ + "' lacks " + std::regex_replace(pattern, std::regex("K"), std::to_string(r)) + ": the checkpoint was saved by " +
                            std::to_string(world_size_) + " ranks (dp_world_size) and each writes its " + what,
                        "a rank's save did not finish, or the file was lost; copy it from where the run saved it, or choose "
                        "another checkpoint with --tag");
    for (const auto& [r, f] : files)
      if (r >= world_size_)
        throw UserError("'" + f + "' is rank " + std::to_string(r) + "'s, but the checkpoint was saved by " + std::to_string(world_size_) +
                            " ranks: files from two saves share this folder",
                        "remove what another save left there, or give the folder of a single save");
  };
  if (!t.optim.empty()) {
    const std::string prefix = t.bf16_optim ? "bf16_" : "";
    rank_file(t.optim, prefix + "zero_pp_rank_K_mp_rank_00_optim_states.pt", "optimizer partition");
    for (const auto& [r, f] : t.optim) {
      optim_files_.push_back(std::make_unique<TorchFile>(f));
      files_.push_back(f);
    }
    const PyValue& osd = need(optim_files_[0]->root().get("optimizer_state_dict"), t.optim.at(0), "optimizer_state_dict", PyKind::dict);
    // ZeRO's optimizers record their stage; bf16's optimizer at stage 0 records none but keeps stage 1's layout.
    if (const PyValue* z = osd.get("zero_stage"); z && z->is(PyKind::integer)) stage_ = static_cast<int>(z->integer);
    else if (osd.get("fp32_flat_groups")) stage_ = 3;
    if (stage_ < 0 || stage_ > 3) throw UserError("'" + t.optim.at(0) + "' records ZeRO stage " + std::to_string(stage_), "");
    if (!osd.get(stage_ == 3 ? "fp32_flat_groups" : "single_partition_of_fp32_groups"))
      throw UserError("'" + t.optim.at(0) + "' holds no fp32 master partitions (" +
                          (stage_ == 3 ? "fp32_flat_groups" : "single_partition_of_fp32_groups") + ")",
                      "is it an optimizer file of DeepSpeed's ZeRO or bf16 optimizer?");
  } else if (!t.model.empty() && t.mp_model.empty()) {
    throw UserError("'" + dir_ + "' holds ZeRO-3 model files but no optimizer files (zero_pp_rank_K_mp_rank_00_optim_states.pt)",
                    "the fp32 weights of a ZeRO-3 run live in its optimizer files; copy them beside the model files");
  }
  if (stage_ == 3) {
    rank_file(t.model, "zero_pp_rank_K_mp_rank_00_model_states.pt", "part of the model");
    for (const auto& [r, f] : t.model)
      if (r > 0) {
        model_files_.push_back(std::make_unique<TorchFile>(f));
        files_.push_back(f);
        const int64_t s = need_int(model_files_.back()->root(), "global_steps", f);
        if (s != step_)
          throw UserError("'" + f + "' was saved at step " + std::to_string(s) + ", '" + lead_ + "' at step " + std::to_string(step_) +
                              ": files from two saves share this folder",
                          "give the folder of a single save");
      }
  }
}

void DeepSpeedCheckpoint::check_one_save() const {
  // One save: every rank's optimizer has taken as many steps (DeepSpeed records no step in these files' headers).
  int64_t first_step = -1;
  for (size_t r = 0; r < optim_files_.size(); ++r) {
    const PyValue* osd = optim_files_[r]->root().get("optimizer_state_dict");
    const PyValue* base = osd ? (osd->get("base_optimizer_state") ? osd->get("base_optimizer_state") : osd->get("optimizer_state_dict")) : nullptr;
    const PyValue* state = base ? base->get("state") : nullptr;
    if (!state || !state->is(PyKind::dict) || state->entries.empty()) continue;
    const PyValue* s0 = state->entries.front().second;
    const PyValue* st = s0->get("step");
    int64_t step = -1;
    if (st && st->is(PyKind::integer)) step = st->integer;
    if (st && st->is(PyKind::tensor) && st->numel() == 1 && st->contiguous()) {  // torch 2's AdamW: a 0-d tensor
      float v = 0;
      optim_files_[r]->read_f32(*st, 0, 1, &v);
      step = static_cast<int64_t>(v);
    }
    if (step < 0) continue;
    if (first_step < 0) first_step = step;
    else if (step != first_step)
      throw UserError("'" + optim_files_[r]->path() + "' holds an optimizer at step " + std::to_string(step) +
                          ", rank 0's at step " + std::to_string(first_step) + ": files from two saves share this folder",
                      "give the folder of a single save");
  }

}

void DeepSpeedCheckpoint::add(DeepSpeedParam p) {
  if (!seen_.insert(p.name).second) throw UserError("'" + lead_ + "' names the parameter '" + p.name + "' twice", "the file is damaged");
  total_numel_ += p.numel;  // each below 2^50, and at most 2^21 of them (the pickle's values): no overflow
  if (total_numel_ > kMaxNumel)
    throw UserError("'" + lead_ + "' describes more than 2^50 parameters", "the file is damaged");
  params_.push_back(std::move(p));
}

// A parameter as param_shapes (or frozen_param_shapes) records it: name -> torch.Size.
DeepSpeedParam DeepSpeedCheckpoint::shaped(const PyValue& key, const PyValue& shape, DeepSpeedParam::From from, int group,
                                           int64_t offset) const {
  DeepSpeedParam p;
  p.key = need(&key, lead_, "a name in param_shapes", PyKind::string).text;
  p.name = model_name(p.key);
  p.shape = shape_of(shape, p.key, lead_);
  p.numel = numel_of(p.shape);
  p.from = from;
  p.group = group;
  p.offset = offset;
  return p;
}

void DeepSpeedCheckpoint::add_module_param(const std::string& key, const PyValue& v, bool buffer) {
  DeepSpeedParam p;
  p.key = key;
  p.name = model_name(key);
  p.shape = v.shape;
  p.numel = v.numel();
  p.buffer = buffer;
  add(std::move(p));
}

// Every parameter and where its values are: the module (stage 0), the flat partitions (stages 1-3) with
// the module's buffers beside them, then the frozen and tied ones.
void DeepSpeedCheckpoint::read_params(const PyValue& ms) {
  const PyValue& module = need(ms.get("module"), lead_, "module", PyKind::dict);
  std::set<std::string> buffers;
  if (const PyValue* b = ms.get("buffer_names"); b && (b->is(PyKind::list) || b->is(PyKind::set)))
    for (const PyValue* n : b->items)
      if (n->is(PyKind::string)) buffers.insert(n->text);
  for (const auto& [k, v] : module.entries)
    if (v->is(PyKind::tensor)) {
      module_dtype_ = v->dtype;
      if (!buffers.count(k->text)) break;
    }
  if (stage_ == 0 && optim_files_.empty()) {
    for (const auto& [k, v] : module.entries)
      if (k->is(PyKind::string) && v->is(PyKind::tensor)) add_module_param(k->text, *v, buffers.count(k->text) > 0);
  } else {
    read_partitions(need(ms.get("param_shapes"), lead_, "param_shapes", PyKind::list));
    // Buffers stay whole in the module at every stage (zero_to_fp32 writes them too).
    for (const auto& [k, v] : module.entries)
      if (k->is(PyKind::string) && v->is(PyKind::tensor) && buffers.count(k->text) && !seen_.count(model_name(k->text)))
        add_module_param(k->text, *v, true);
  }
  // Frozen parameters (stages 2-3): whole in rank 0's fragments at stage 2, a part per rank at stage 3.
  if (const PyValue* fz = ms.get("frozen_param_shapes"); fz && fz->is(PyKind::dict)) {
    for (const auto& [k, s] : fz->entries) {
      DeepSpeedParam p = shaped(*k, *s, DeepSpeedParam::From::frozen, -1, 0);
      for (const auto& mf : model_files_) {
        const PyValue* frags = mf->root().get("frozen_param_fragments");
        const PyValue* t = frags ? frags->get(p.key) : nullptr;
        need(t, mf->path(), "frozen_param_fragments['" + p.key + "']", PyKind::tensor);
        const int64_t want = stage_ == 3 ? (p.numel + world_size_ - 1) / world_size_ : p.numel;
        if (t->numel() < std::min(want, p.numel))
          throw UserError("'" + mf->path() + "': the frozen parameter '" + p.key + "' has " + format_count(t->numel()) + " elements, not " +
                              format_count(want),
                          "");
      }
      add(std::move(p));
    }
  }
  // Below stage 3 the module holds every weight: one that no group, fragment or alias accounts for is a
  // frozen parameter stage 1 records nowhere else (zero_to_fp32.py leaves those out; ds keeps them).
  std::set<std::string> aliases;
  if (const PyValue* sh = ms.get("shared_params"); sh && sh->is(PyKind::dict))
    for (const auto& [alias, source] : sh->entries)
      if (alias->is(PyKind::string)) aliases.insert(alias->text);
  if (stage_ < 3 && !(stage_ == 0 && optim_files_.empty()))
    for (const auto& [k, v] : module.entries)
      if (k->is(PyKind::string) && v->is(PyKind::tensor) && !seen_.count(model_name(k->text)) && !aliases.count(k->text)) {
        add_module_param(k->text, *v, false);
        params_.back().from = DeepSpeedParam::From::frozen;
        params_.back().buffer = false;
      }
  if (const PyValue* sh = ms.get("shared_params"); sh && sh->is(PyKind::dict))
    for (const auto& [alias, source] : sh->entries)
      if (alias->is(PyKind::string) && source->is(PyKind::string)) {
        const std::string a = model_name(alias->text), s = model_name(source->text);
        if (!seen_.count(s))
          throw UserError("'" + lead_ + "' ties '" + a + "' to '" + s + "', which it does not hold", "the file is damaged");
        tied_.emplace_back(a, s);
        params_.erase(std::remove_if(params_.begin(), params_.end(), [&](const DeepSpeedParam& p) { return p.name == a; }), params_.end());
      }
}

// Stages 1-3: the ranks' fp32 partitions of each group (or sub-group), checked against param_shapes as
// zero_to_fp32.py checks them, and each parameter's place in them.
void DeepSpeedCheckpoint::read_partitions(const PyValue& shapes) {
  has_master_ = true;
  if (stage_ <= 2) {
    groups_.resize(shapes.items.size());
    for (size_t r = 0; r < optim_files_.size(); ++r) {
      const std::string& f = optim_files_[r]->path();
      const PyValue& parts =
          need(need(optim_files_[r]->root().get("optimizer_state_dict"), f, "optimizer_state_dict", PyKind::dict).get("single_partition_of_fp32_groups"), f,
               "single_partition_of_fp32_groups", PyKind::list);
      if (parts.items.size() != shapes.items.size())
        throw UserError("'" + f + "' holds " + std::to_string(parts.items.size()) + " parameter groups, the model file " +
                            std::to_string(shapes.items.size()),
                        "files from two saves share this folder?");
      for (size_t g = 0; g < parts.items.size(); ++g) {
        if (need(parts.items[g], f, "single_partition_of_fp32_groups[" + std::to_string(g) + "]", PyKind::tensor).numel() > kMaxNumel)
          throw UserError("'" + f + "': a partition of more than 2^50 elements", "the file is damaged");
        groups_[g].push_back({optim_files_[r].get(), parts.items[g]});
      }
    }
    for (size_t g = 0; g < shapes.items.size(); ++g) {
      const PyValue& group = need(shapes.items[g], lead_, "param_shapes[" + std::to_string(g) + "]", PyKind::dict);
      int64_t offset = 0, avail = 0;
      for (const Piece& piece : groups_[g]) avail += piece.tensor->numel();
      for (const auto& [k, s] : group.entries) {
        add(shaped(*k, *s, DeepSpeedParam::From::flat_group, static_cast<int>(g), offset));
        offset += params_.back().numel;
      }
      // The ranks' slices hold the group plus its end padding (to a multiple of 2 x world size).
      const int64_t align = 2 * world_size_;
      auto up = [&](int64_t n) { return (n + align - 1) / align * align; };
      if (offset > avail || up(offset) != up(avail))
        throw UserError("'" + dir_ + "': parameter group " + std::to_string(g) + " has " + format_count(offset) +
                            " elements by param_shapes, but its partitions hold " + format_count(avail),
                        "the model file and the optimizer files come from different saves (or world sizes)");
    }
  } else {
    flat_.resize(optim_files_.size());
    int64_t per_rank = -1;
    for (size_t r = 0; r < optim_files_.size(); ++r) {
      const std::string& f = optim_files_[r]->path();
      const PyValue& parts =
          need(need(optim_files_[r]->root().get("optimizer_state_dict"), f, "optimizer_state_dict", PyKind::dict).get("fp32_flat_groups"), f, "fp32_flat_groups", PyKind::list);
      int64_t total = 0;
      for (size_t g = 0; g < parts.items.size(); ++g) {
        if (need(parts.items[g], f, "fp32_flat_groups[" + std::to_string(g) + "]", PyKind::tensor).numel() > kMaxNumel)
          throw UserError("'" + f + "': a partition of more than 2^50 elements", "the file is damaged");
        flat_[r].push_back({optim_files_[r].get(), parts.items[g]});
        total += parts.items[g]->numel();
      }
      if (per_rank >= 0 && total != per_rank)
        throw UserError("'" + f + "' holds " + format_count(total) + " fp32 elements, rank 0's file " + format_count(per_rank) +
                            ": at ZeRO-3 every rank holds an equal part",
                        "files from two saves (or world sizes) share this folder");
      per_rank = total;
    }
    int64_t offset = 0;
    for (size_t g = 0; g < shapes.items.size(); ++g) {
      const PyValue& group = need(shapes.items[g], lead_, "param_shapes[" + std::to_string(g) + "]", PyKind::dict);
      for (const auto& [k, s] : group.entries) {
        add(shaped(*k, *s, DeepSpeedParam::From::stage3_flat, static_cast<int>(g), offset));
        offset += (params_.back().numel + world_size_ - 1) / world_size_;  // each rank's slice of it
      }
    }
    if (offset != per_rank)
      throw UserError("'" + dir_ + "': the parameters take " + format_count(offset) + " elements of each rank's partition by param_shapes, "
                          "but each rank holds " + format_count(per_rank),
                      "the model files and the optimizer files come from different saves (or world sizes)");
  }
}

// Adam's moments lie beside the fp32 master in the same flat shape: the base optimizer's state, keyed by
// group (stages 1-2) or sub-group (stage 3), one flat tensor per moment.
void DeepSpeedCheckpoint::collect_moments() {
  const std::vector<std::vector<Piece>>& master = stage_ == 3 ? flat_ : groups_;
  if (master.empty()) {
    collect_stage0_moments();
    return;
  }
  for (auto& m : moments_) m.assign(master.size(), {});
  for (size_t r = 0; r < optim_files_.size(); ++r) {
    const std::string& f = optim_files_[r]->path();
    const PyValue* osd = optim_files_[r]->root().get("optimizer_state_dict");
    const PyValue* base = osd ? osd->get(stage_ == 3 ? "optimizer_state_dict" : "base_optimizer_state") : nullptr;
    const PyValue* state = base ? base->get("state") : nullptr;
    const size_t count = stage_ == 3 ? flat_[r].size() : groups_.size();
    for (size_t k = 0; k < count; ++k) {
      const PyValue* entry = nullptr;
      if (state && state->is(PyKind::dict))
        for (const auto& [key, v] : state->entries)
          if (key->is(PyKind::integer) && key->integer == static_cast<int64_t>(k)) entry = v;
      const Piece& twin = stage_ == 3 ? flat_[r][k] : groups_[k][r];
      for (int m = 0; m < 2; ++m) {
        const PyValue* t = entry ? entry->get(m == 0 ? "exp_avg" : "exp_avg_sq") : nullptr;
        // Stages 1-2 save the fp32 slice without its end padding but the moments with it (less than 2 x world
        // elements, all after every real one): the real elements sit at the same offsets either way.
        const int64_t extra = t && t->is(PyKind::tensor) ? t->numel() - twin.tensor->numel() : -1;
        if (extra < 0 || (stage_ == 3 ? extra != 0 : extra >= 2 * world_size_)) {
          moments_missing_ = "'" + f + "' holds no " + (m == 0 ? "exp_avg" : "exp_avg_sq") + " of the size of its fp32 partition " +
                             std::to_string(k) + " (an optimizer other than Adam, or its state not saved)";
          for (auto& mm : moments_) mm.clear();
          return;
        }
        if (stage_ == 3) {
          if (moments_[m].size() < optim_files_.size()) moments_[m].resize(optim_files_.size());
          moments_[m][r].push_back({optim_files_[r].get(), t});
        } else {
          moments_[m][k].push_back({optim_files_[r].get(), t});
        }
      }
    }
  }
  has_moments_ = true;
}

// Stage 0 without ZeRO: the model file holds torch's own optimizer state, keyed by parameter index in the
// order of its groups, without names. The index is tied to a name the way Hugging Face's Trainer (and
// ds) build the groups: one group of every parameter in the module's order, or two, the one with weight
// decay holding the matrices and embeddings (2 or more dimensions) and the other the rest, each in the
// module's order. Every moment's size must then match its parameter's, else nothing is guessed.
void DeepSpeedCheckpoint::collect_stage0_moments() {
  const PyValue* opt = model_files_[0]->root().get("optimizer");
  const PyValue* state = opt ? opt->get("state") : nullptr;
  const PyValue* groups = opt ? opt->get("param_groups") : nullptr;
  moments_missing_ = "the model file holds no optimizer state ds can read (torch's state and param_groups)";
  if (!state || !state->is(PyKind::dict) || !groups || !groups->is(PyKind::list) || groups->items.empty() || groups->items.size() > 2) return;
  std::vector<std::vector<const DeepSpeedParam*>> members(groups->items.size());
  for (const DeepSpeedParam& p : params_) {
    if (p.buffer) continue;
    size_t g = 0;
    if (groups->items.size() == 2) {
      const PyValue* wd = groups->items[0]->get("weight_decay");
      const bool first_decays = wd && ((wd->is(PyKind::real) && wd->real > 0) || (wd->is(PyKind::integer) && wd->integer > 0));
      g = (p.shape.size() >= 2) == first_decays ? 0 : 1;
    }
    members[g].push_back(&p);
  }
  std::map<std::string, std::array<const PyValue*, 2>> found;
  for (size_t g = 0; g < members.size(); ++g) {
    const PyValue* ids = groups->items[g]->get("params");
    if (!ids || !ids->is(PyKind::list) || ids->items.size() != members[g].size()) {
      moments_missing_ = "at ZeRO stage 0 the optimizer keeps its state by parameter index, and its parameter group " + std::to_string(g) +
                         " does not match the module's parameters by count";
      return;
    }
    for (size_t i = 0; i < members[g].size(); ++i) {
      const PyValue* entry = nullptr;
      if (ids->items[i]->is(PyKind::integer))
        for (const auto& [key, v] : state->entries)
          if (key->is(PyKind::integer) && key->integer == ids->items[i]->integer) entry = v;
      const DeepSpeedParam& p = *members[g][i];
      std::array<const PyValue*, 2> m{entry ? entry->get("exp_avg") : nullptr, entry ? entry->get("exp_avg_sq") : nullptr};
      for (const PyValue* t : m)
        if (!t || !t->is(PyKind::tensor) || t->numel() != p.numel || !t->contiguous()) {
          moments_missing_ = "at ZeRO stage 0 the optimizer keeps its state by parameter index, and the state of '" + p.name +
                             "' (by the Trainer's grouping) is not of its size";
          return;
        }
      found[p.name] = m;
    }
  }
  stage0_moments_ = std::move(found);
  moments_missing_.clear();
  has_moments_ = true;
}

const PyValue* DeepSpeedCheckpoint::loss_scaler() const {
  if (optim_files_.empty()) return nullptr;
  const PyValue* osd = optim_files_[0]->root().get("optimizer_state_dict");
  const PyValue* ls = osd ? osd->get("loss_scaler") : nullptr;
  return ls && ls->is(PyKind::object) ? ls : nullptr;
}

void DeepSpeedCheckpoint::read_state(const DeepSpeedParam& p, int which, int64_t lo, int64_t n, float* out) const {
  DS_CHECK(which >= 0 && which <= 2 && lo >= 0 && n >= 0 && lo + n <= p.numel, "read_state: a range outside the parameter");
  DS_CHECK(which == 0 || has_moments_, "read_state: no moments: " + moments_missing_);
  if (p.from == DeepSpeedParam::From::flat_group) {
    const auto& pieces = which == 0 ? groups_[static_cast<size_t>(p.group)] : moments_[which - 1][static_cast<size_t>(p.group)];
    read_concat(pieces, p.offset + lo, n, out);
    return;
  }
  if (p.from == DeepSpeedParam::From::module) {  // stage 0: the module's weights and torch's per-parameter state
    const PyValue* t = which == 0 ? &module_tensor(p) : stage0_moments_.at(p.name)[static_cast<size_t>(which - 1)];
    model_files_[0]->read_f32(*t, lo, n, out);
    return;
  }
  DS_CHECK(p.from == DeepSpeedParam::From::stage3_flat, "read_state: '" + p.name + "' is not in the optimizer's partitions");
  // Stage 3: element e of the parameter is rank e / part's element e % part of its slice.
  const int64_t part = (p.numel + world_size_ - 1) / world_size_;
  for (int64_t e = lo; e < lo + n;) {
    const int64_t r = e / part, within = e % part, len = std::min(part - within, lo + n - e);
    const auto& pieces = which == 0 ? flat_[static_cast<size_t>(r)] : moments_[which - 1][static_cast<size_t>(r)];
    read_concat(pieces, p.offset + within, len, out + (e - lo));
    e += len;
  }
}

const DeepSpeedParam* DeepSpeedCheckpoint::find(const std::string& name) const {
  for (const DeepSpeedParam& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

const PyValue& DeepSpeedCheckpoint::module_tensor(const DeepSpeedParam& p) const {
  const PyValue* module = model_files_[0]->root().get("module");
  const PyValue* t = module ? module->get(p.key) : nullptr;
  if (!t || !t->is(PyKind::tensor))
    throw UserError("'" + model_files_[0]->path() + "' holds no module weight '" + p.key + "'", "");
  if (t->numel() != p.numel)
    throw UserError("'" + model_files_[0]->path() + "': the module weight '" + p.key + "' has " + format_count(t->numel()) +
                        " elements" + (stage_ == 3 ? " (ZeRO-3 keeps placeholders there; its weights are in the optimizer files)" : ""),
                    stage_ == 3 ? "leave out --from-module-weights" : "");
  return *t;
}

void DeepSpeedCheckpoint::read_concat(const std::vector<Piece>& pieces, int64_t from, int64_t n, float* out) const {
  int64_t at = 0;  // where the current piece starts in the concatenation
  for (const Piece& piece : pieces) {
    const int64_t len = piece.tensor->numel();
    const int64_t lo = std::max(from, at), hi = std::min(from + n, at + len);
    if (lo < hi) piece.file->read_f32(*piece.tensor, lo - at, hi - lo, out + (lo - from));
    at += len;
    if (at >= from + n) return;
  }
  throw UserError("'" + dir_ + "': a parameter reaches past the end of its partitions", "the files come from different saves");
}

void DeepSpeedCheckpoint::read(const DeepSpeedParam& p, bool module_weights, float* out) const {
  if (p.buffer || p.from == DeepSpeedParam::From::module || (module_weights && p.from != DeepSpeedParam::From::frozen)) {
    model_files_[0]->read_f32(module_tensor(p), 0, p.numel, out);
    return;
  }
  switch (p.from) {
    case DeepSpeedParam::From::flat_group:
    case DeepSpeedParam::From::stage3_flat: read_state(p, 0, 0, p.numel, out); return;
    case DeepSpeedParam::From::frozen: {
      const int64_t part = (p.numel + world_size_ - 1) / world_size_;
      if (p.from == DeepSpeedParam::From::frozen && stage_ != 3) {  // its fragment is whole, else the module holds it
        const TorchFile& f = *model_files_[0];
        const PyValue* frags = f.root().get("frozen_param_fragments");
        const PyValue* t = frags ? frags->get(p.key) : nullptr;
        f.read_f32(t && t->is(PyKind::tensor) ? *t : module_tensor(p), 0, p.numel, out);
        return;
      }
      for (int64_t r = 0; r < world_size_; ++r) {
        const int64_t lo = r * part, n = std::min(part, p.numel - lo);
        if (n <= 0) break;
        const TorchFile& f = *model_files_[static_cast<size_t>(r)];
        f.read_f32(*f.root().get("frozen_param_fragments")->get(p.key), 0, n, out + lo);
      }
      return;
    }
    case DeepSpeedParam::From::module: break;
  }
}

DeepSpeedSource::DeepSpeedSource(std::shared_ptr<const DeepSpeedCheckpoint> ckpt, bool module_weights, bool exclude_frozen)
    : ckpt_(std::move(ckpt)), module_weights_(module_weights) {
  kind_ = WeightsKind::deepspeed_checkpoint;
  path_ = ckpt_->dir();
  step = ckpt_->step();
  world_size = ckpt_->world_size();
  zero_stage = ckpt_->stage();
  if (module_weights && ckpt_->stage() == 3)
    throw UserError("--from-module-weights: a ZeRO-3 checkpoint keeps no module weights (each rank's model file holds placeholders)",
                    "leave it out: the fp32 weights come from the optimizer files");
  const std::string dtype = (module_weights || !ckpt_->has_master()) ? st_dtype_name(ckpt_->module_dtype()) : "F32";
  for (const DeepSpeedParam& p : ckpt_->params()) {
    if (exclude_frozen && p.from == DeepSpeedParam::From::frozen) continue;
    tensors_.push_back({p.name, p.shape, p.buffer ? st_dtype_name(ckpt_->module_dtype()) : dtype});
  }
}

void DeepSpeedSource::read_f32(const std::string& name, float* out) const {
  const DeepSpeedParam* p = ckpt_->find(name);
  DS_CHECK(p != nullptr, "DeepSpeedSource: no tensor " + name);
  ckpt_->read(*p, module_weights_, out);
}

}  // namespace ds
