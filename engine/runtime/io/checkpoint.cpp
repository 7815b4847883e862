#include "engine/runtime/io/checkpoint.hpp"

#include "common/hash.hpp"
#include "engine/plan/plan_record.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <chrono>
#include <cmath>
#include <climits>
#include <memory>
#include <random>
#include <stdexcept>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/strings.hpp"
#include "engine/runtime/io/hdf5_quiet.hpp"

namespace ds {
namespace fs = std::filesystem;
namespace {

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

[[noreturn]] void io_fail(const std::string& what, const std::string& path) {
  throw std::runtime_error("checkpoint I/O failed: " + what + " (" + path + ")");
}

// HDF5 file and memory types of the scalar attributes (int64 counters and the float64 loss scale).
template <class T>
struct H5Scalar;
template <>
struct H5Scalar<int64_t> {
  static hid_t file() { return H5T_STD_I64LE; }
  static hid_t memory() { return H5T_NATIVE_INT64; }
};
template <>
struct H5Scalar<double> {
  static hid_t file() { return H5T_IEEE_F64LE; }
  static hid_t memory() { return H5T_NATIVE_DOUBLE; }
};

template <class T>
void write_attr(hid_t file, const char* name, T v, const std::string& path) {
  hid_t space = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(file, name, H5Scalar<T>::file(), space, H5P_DEFAULT, H5P_DEFAULT);
  if (a < 0 || H5Awrite(a, H5Scalar<T>::memory(), &v) < 0) io_fail(std::string("writing attribute ") + name, path);
  H5Aclose(a);
  H5Sclose(space);
}

template <class T>
T read_attr(hid_t file, const char* name, const std::string& path) {
  T v{};
  hid_t a = H5Aopen(file, name, H5P_DEFAULT);
  if (a < 0 || H5Aread(a, H5Scalar<T>::memory(), &v) < 0)
    throw UserError("'" + path + "' lacks attribute '" + name + "': not a ds checkpoint", "");
  H5Aclose(a);
  return v;
}

bool has_attr(hid_t loc, const char* name) { return H5Aexists(loc, name) > 0; }

// The root attributes a checkpoint file may carry, in the order the metadata checksum folds them.
constexpr const char* kIntAttrs[] = {"format_version", "step", "applied_steps", "skipped_steps", "seed", "world_size", "model_numel",
                                     "loss_scale_iteration", "loss_scale_last_overflow", "loss_scale_hysteresis", "save_id"};

int64_t dataset_length(hid_t f, const char* name);
std::vector<OwnedSegment> read_segments(hid_t loc, const std::string& path);
std::string read_string(hid_t loc, const char* name, const std::string& path);

uint64_t fold_bytes(uint64_t h, const void* p, size_t n) { return splitmix64(h ^ checksum64(p, n)); }
uint64_t fold_text(uint64_t h, const std::string& s) { return fold_bytes(h, s.data(), s.size()); }

// A checksum of everything in a checkpoint file that is not float data (whose data sets carry their own):
// the root attributes, the plan and config texts, the segment table and every data set's length. Computed
// from the file as it stands, by the writer after writing and by the reader before trusting it, so a flipped
// counter, a swapped segment row or a data set that claims another length is found.
uint64_t metadata_checksum(hid_t f, const std::string& path) {
  uint64_t h = 0x6473636b70746d65ull;  // "dsckptme"
  for (const char* name : kIntAttrs) {
    h = fold_text(h, name);
    int64_t v = INT64_MIN;
    if (has_attr(f, name)) v = read_attr<int64_t>(f, name, path);
    h = fold_bytes(h, &v, sizeof v);
  }
  for (const char* name : {"loss_scale", "loss"})
    if (has_attr(f, name)) {
      const double v = read_attr<double>(f, name, path);
      h = fold_bytes(h, &v, sizeof v);
    }
  for (const char* text : {"plan_json", "config_json"})
    h = fold_text(h, H5Lexists(f, text, H5P_DEFAULT) > 0 ? read_string(f, text, path) : std::string("\1 absent"));
  if (H5Lexists(f, "base_json", H5P_DEFAULT) > 0) h = fold_text(h, read_string(f, "base_json", path));  // LoRA runs only
  for (const OwnedSegment& g : read_segments(f, path)) {
    const int64_t row[3] = {g.global, g.local, g.numel};
    h = fold_bytes(h, row, sizeof row);
  }
  for (const char* set : {"master", "optimizer/exp_avg", "optimizer/exp_avg_sq"}) {
    const int64_t n = H5Lexists(f, "optimizer", H5P_DEFAULT) > 0 || std::string(set) == "master" ? dataset_length(f, set) : -1;
    h = fold_bytes(h, &n, sizeof n);
  }
  return h;
}

// A checkpoint's save id: a random number rank 0 draws for each save and every rank's file records, so a
// shard copied in from another save (another step, another run) is told apart from this save's own.
int64_t draw_save_id() {
  std::random_device rd;
  uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  v ^= static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^ (static_cast<uint64_t>(::getpid()) << 17);
  return static_cast<int64_t>(splitmix64(v) >> 1);  // positive, so it prints plainly
}

// Each data set carries a "checksum" attribute, verified on load: checksum64 of each 32 MiB piece of its
// little-endian bytes, folded in order, so a reader checks a shard of any size in bounded memory.
constexpr int64_t kChecksumPieceFloats = int64_t{1} << 23;
uint64_t fold_piece(uint64_t h, const float* piece, int64_t n) {
  return splitmix64(h ^ checksum64(piece, static_cast<size_t>(n) * sizeof(float)));
}

// A 1-D fp32 data set written in checksum-sized pieces, in order; the checksum attribute at the end.
class FloatDataset {
 public:
  FloatDataset(hid_t loc, const char* name, int64_t n, const std::string& path) : name_(name), path_(path), hash_(static_cast<uint64_t>(n)) {
    hsize_t dims[1] = {static_cast<hsize_t>(n)};
    space_ = H5Screate_simple(1, dims, nullptr);
    d_ = H5Dcreate2(loc, name, H5T_IEEE_F32LE, space_, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    if (d_ < 0) io_fail(std::string("creating ") + name, path);
  }
  ~FloatDataset() {
    if (d_ >= 0) H5Dclose(d_);
    H5Sclose(space_);
  }
  FloatDataset(const FloatDataset&) = delete;
  FloatDataset& operator=(const FloatDataset&) = delete;
  void write(int64_t at, int64_t n, const float* data) {
    const hsize_t start[1] = {static_cast<hsize_t>(at)}, len[1] = {static_cast<hsize_t>(n)};
    hid_t mem = H5Screate_simple(1, len, nullptr);
    const bool ok = H5Sselect_hyperslab(space_, H5S_SELECT_SET, start, nullptr, len, nullptr) >= 0 &&
                    H5Dwrite(d_, H5T_NATIVE_FLOAT, mem, space_, H5P_DEFAULT, data) >= 0;
    H5Sclose(mem);
    if (!ok) io_fail("writing " + name_ + " (is the disk full?)", path_);
    hash_ = fold_piece(hash_, data, n);
  }
  void finish() { write_attr<int64_t>(d_, "checksum", static_cast<int64_t>(hash_), path_); }

 private:
  std::string name_, path_;
  uint64_t hash_;
  hid_t space_ = -1, d_ = -1;
};

// Reads the whole of a float data set in bounded pieces and compares its checksum attribute; files
// written before checksums existed (format 1-2) may have none and pass, from format 3 on it is required.
// Throws UserError naming the file and data set (verify_or_point_back adds which checkpoint to resume from instead).
void verify_floats(hid_t loc, const char* name, const std::string& path, bool required) {
  hid_t d = H5Dopen2(loc, name, H5P_DEFAULT);
  if (d < 0) return;  // absent: the reader reports it if it needs it
  int64_t want = 0;
  bool has = false;
  if (H5Aexists(d, "checksum") > 0) {
    hid_t a = H5Aopen(d, "checksum", H5P_DEFAULT);
    has = a >= 0 && H5Aread(a, H5T_NATIVE_INT64, &want) >= 0;
    if (a >= 0) H5Aclose(a);
  }
  if (!has) {
    H5Dclose(d);
    if (required) throw UserError("'" + path + "': data set '" + name + "' has lost its checksum: the file is corrupt");
    return;
  }
  hid_t space = H5Dget_space(d);
  hsize_t dims[1] = {0};
  H5Sget_simple_extent_dims(space, dims, nullptr);
  const int64_t n = static_cast<int64_t>(dims[0]);
  std::vector<float> piece(static_cast<size_t>(std::min(kChecksumPieceFloats, n)));
  uint64_t h = static_cast<uint64_t>(n);
  bool ok = true;
  for (int64_t at = 0; at < n && ok; at += kChecksumPieceFloats) {
    const hsize_t start[1] = {static_cast<hsize_t>(at)}, count[1] = {static_cast<hsize_t>(std::min(kChecksumPieceFloats, n - at))};
    hid_t mem = H5Screate_simple(1, count, nullptr);
    ok = H5Sselect_hyperslab(space, H5S_SELECT_SET, start, nullptr, count, nullptr) >= 0 &&
         H5Dread(d, H5T_NATIVE_FLOAT, mem, space, H5P_DEFAULT, piece.data()) >= 0;
    H5Sclose(mem);
    if (ok) h = fold_piece(h, piece.data(), static_cast<int64_t>(count[0]));
  }
  H5Sclose(space);
  H5Dclose(d);
  if (!ok) throw UserError("'" + path + "': data set '" + name + "' cannot be read: the file is damaged");
  if (static_cast<int64_t>(h) != want)
    throw UserError("'" + path + "': data set '" + name + "' does not match its checksum: the file is corrupt");
}

// The metadata checksum (required from format 3 on), then every float data set against its own.
void verify_shard(hid_t f, const std::string& path, bool current_format) {
  const bool has_meta = has_attr(f, "meta_checksum");
  if (current_format && !has_meta)
    throw UserError("'" + path + "' has lost its metadata checksum: the file is corrupt");
  if (has_meta && static_cast<uint64_t>(read_attr<int64_t>(f, "meta_checksum", path)) != metadata_checksum(f, path))
    throw UserError("'" + path + "': its counters, segment table or data set sizes do not match their checksum: the file is corrupt");
  verify_floats(f, "master", path, current_format);
  if (H5Lexists(f, "optimizer", H5P_DEFAULT) > 0)
    for (const char* name : {"optimizer/exp_avg", "optimizer/exp_avg_sq"})
      if (H5Lexists(f, name, H5P_DEFAULT) > 0) verify_floats(f, name, path, current_format);
}

// What a shard's segment table claims, checked against the model and the shard's own arrays: every row
// inside the model and inside the arrays, no two rows sharing local elements nor the model's, every array as
// long as master.
void check_segments(const std::vector<OwnedSegment>& segs, int64_t model_numel, hid_t f, const std::string& path) {
  const int64_t local = dataset_length(f, "master");
  for (const char* moment : {"optimizer/exp_avg", "optimizer/exp_avg_sq"}) {
    if (H5Lexists(f, "optimizer", H5P_DEFAULT) <= 0 || H5Lexists(f, moment, H5P_DEFAULT) <= 0) continue;
    if (dataset_length(f, moment) != local)
      throw UserError("'" + path + "': data set '" + moment + "' holds " + std::to_string(dataset_length(f, moment)) +
                      " elements but master holds " + std::to_string(local) + ": the file is corrupt");
  }
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const OwnedSegment& g : segs) {
    const bool inside = g.numel > 0 && g.global >= 0 && g.local >= 0 && g.global <= model_numel - g.numel && g.local <= local - g.numel;
    if (!inside)
      throw UserError("'" + path + "': segment [global " + std::to_string(g.global) + ", local " + std::to_string(g.local) + ", length " +
                      std::to_string(g.numel) + "] lies outside the model (" + std::to_string(model_numel) + " elements) or the shard (" +
                      std::to_string(local) + "): the file is corrupt");
    spans.emplace_back(g.local, g.local + g.numel);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second)
      throw UserError("'" + path + "': two segments share local elements " + std::to_string(spans[i].first) + ".." +
                      std::to_string(spans[i - 1].second) + ": the file is corrupt");
  // Nor the model's: read_overlaps searches them in the model's order.
  spans.clear();
  for (const OwnedSegment& g : segs) spans.emplace_back(g.global, g.global + g.numel);
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second)
      throw UserError("'" + path + "': two segments hold the model's elements " + std::to_string(spans[i].first) + ".." +
                      std::to_string(spans[i - 1].second) + ": the file is corrupt");
}

void write_segments(hid_t loc, const std::vector<OwnedSegment>& segs, const std::string& path) {
  std::vector<int64_t> flat;
  for (const auto& g : segs) flat.insert(flat.end(), {g.global, g.local, g.numel});
  hsize_t dims[2] = {static_cast<hsize_t>(segs.size()), 3};
  hid_t space = H5Screate_simple(2, dims, nullptr);
  hid_t d = H5Dcreate2(loc, "segments", H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  if (d < 0 || (!flat.empty() && H5Dwrite(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, flat.data()) < 0))
    io_fail("writing segments", path);
  H5Dclose(d);
  H5Sclose(space);
}

// A file's segments: [global, local, numel] rows.
std::vector<OwnedSegment> read_segments(hid_t loc, const std::string& path) {
  hid_t d = H5Dopen2(loc, "segments", H5P_DEFAULT);
  if (d < 0) throw UserError("'" + path + "' has no dataset 'segments': not a ds checkpoint shard", "");
  hid_t space = H5Dget_space(d);
  hsize_t dims[2] = {0, 0};
  H5Sget_simple_extent_dims(space, dims, nullptr);
  H5Sclose(space);
  std::vector<int64_t> flat(dims[0] * 3);
  if (!flat.empty() && H5Dread(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, flat.data()) < 0) io_fail("reading segments", path);
  H5Dclose(d);
  std::vector<OwnedSegment> out(dims[0]);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i].global = flat[3 * i];
    out[i].local = flat[3 * i + 1];
    out[i].numel = flat[3 * i + 2];
  }
  return out;
}

// Elements [at, at + n) of a 1-D fp32 dataset into `data`.
void read_float_range(hid_t loc, const char* name, int64_t at, int64_t n, float* data, const std::string& path) {
  hid_t d = H5Dopen2(loc, name, H5P_DEFAULT);
  if (d < 0)
    throw UserError("'" + path + "' has no dataset '" + name + "'",
                    "the checkpoint was written with another optimizer; resume with the one it was trained with");
  hid_t space = H5Dget_space(d);
  hsize_t start[1] = {static_cast<hsize_t>(at)}, count[1] = {static_cast<hsize_t>(n)};
  hid_t mem = H5Screate_simple(1, count, nullptr);
  const bool ok = H5Sselect_hyperslab(space, H5S_SELECT_SET, start, nullptr, count, nullptr) >= 0 &&
                  H5Dread(d, H5T_NATIVE_FLOAT, mem, space, H5P_DEFAULT, data) >= 0;
  H5Sclose(mem);
  H5Sclose(space);
  H5Dclose(d);
  if (!ok) io_fail(std::string("reading ") + name, path);
}

// The segment table, then master and the moments piece by piece: from the caller's buffers, or drawn
// from `b.pieces` into one piece of each.
void write_shard(hid_t f, const CheckpointBuffers& b, const std::string& path) {
  write_segments(f, b.segments, path);
  const bool streamed = static_cast<bool>(b.pieces.read);
  const int moments = streamed ? b.pieces.moments : (b.exp_avg ? 1 : 0) + (b.exp_avg_sq ? 1 : 0);
  hid_t g = H5Gcreate2(f, "optimizer", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  {
    std::vector<std::unique_ptr<FloatDataset>> sets;
    sets.push_back(std::make_unique<FloatDataset>(f, "master", b.numel, path));
    if (moments >= 1) sets.push_back(std::make_unique<FloatDataset>(g, "exp_avg", b.numel, path));
    if (moments >= 2) sets.push_back(std::make_unique<FloatDataset>(g, "exp_avg_sq", b.numel, path));
    const int64_t cap = std::min(kChecksumPieceFloats, b.numel);
    std::vector<float> piece(streamed ? static_cast<size_t>(cap) * sets.size() : 0);
    const float* held[3] = {b.master, b.exp_avg, b.exp_avg_sq};
    for (int64_t at = 0; at < b.numel; at += kChecksumPieceFloats) {
      const int64_t n = std::min(kChecksumPieceFloats, b.numel - at);
      float* out[3] = {nullptr, nullptr, nullptr};
      for (size_t k = 0; streamed && k < sets.size(); ++k) out[k] = piece.data() + k * static_cast<size_t>(cap);
      if (streamed) b.pieces.read(at, n, out[0], out[1], out[2]);
      for (size_t k = 0; k < sets.size(); ++k) sets[k]->write(at, n, streamed ? out[k] : held[k] + at);
    }
    for (auto& d : sets) d->finish();
  }
  H5Gclose(g);
}

std::string shard_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "shard_%05d.h5", rank);
  return buf;
}

void write_string(hid_t loc, const char* name, const std::string& s, const std::string& path) {
  hid_t type = H5Tcopy(H5T_C_S1);
  H5Tset_size(type, std::max<size_t>(1, s.size()));
  hid_t space = H5Screate(H5S_SCALAR);
  hid_t d = H5Dcreate2(loc, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  std::string padded = s.empty() ? std::string(1, '\0') : s;
  if (d < 0 || H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, padded.data()) < 0) io_fail(std::string("writing ") + name, path);
  H5Dclose(d);
  H5Sclose(space);
  H5Tclose(type);
}

std::string read_string(hid_t loc, const char* name, const std::string& path) {
  hid_t d = H5Dopen2(loc, name, H5P_DEFAULT);
  if (d < 0) throw UserError("'" + path + "' has no dataset '" + name + "'", "");
  hid_t type = H5Dget_type(d);
  const size_t size = H5Tget_size(type);
  std::string s(size, '\0');
  if (H5Dread(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, s.data()) < 0) io_fail(std::string("reading ") + name, path);
  H5Tclose(type);
  H5Dclose(d);
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

void fsync_path(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// The step of a "step_NNNNNNNN" name, -1 for any other name (step_garbage, a step past int64).
int64_t step_of_name(const std::string& n) {
  if (n.rfind("step_", 0) != 0 || n.size() == 5 || n.size() > 5 + 18) return -1;
  int64_t step = 0;
  for (size_t i = 5; i < n.size(); ++i) {
    if (n[i] < '0' || n[i] > '9') return -1;
    step = step * 10 + (n[i] - '0');
  }
  return step;
}

bool complete(const fs::path& dir) { return fs::exists(dir / "DONE") && fs::exists(dir / "state.h5"); }

std::vector<std::pair<int64_t, fs::path>> complete_checkpoints(const fs::path& ckpt_root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  if (!fs::is_directory(ckpt_root)) return out;
  for (const auto& e : fs::directory_iterator(ckpt_root)) {
    const std::string n = e.path().filename().string();
    const int64_t step = step_of_name(n);
    if (step < 0 || !e.is_directory() || !complete(e.path())) continue;
    out.emplace_back(step, e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The training loss a checkpoint was saved at (its "loss" attribute), NaN when it has none or cannot be read.
double saved_loss(const fs::path& dir) {
  quiet_hdf5();
  const std::string file = (dir / "state.h5").string();
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) return std::numeric_limits<double>::quiet_NaN();
  double v = std::numeric_limits<double>::quiet_NaN();
  if (has_attr(f, "loss")) {
    hid_t a = H5Aopen(f, "loss", H5P_DEFAULT);
    if (a < 0 || H5Aread(a, H5T_NATIVE_DOUBLE, &v) < 0) v = std::numeric_limits<double>::quiet_NaN();
    if (a >= 0) H5Aclose(a);
  }
  H5Fclose(f);
  return v;
}

// Of these checkpoints, the one saved at the lowest finite loss ("" when none records one).
fs::path best_loss_checkpoint(const std::vector<std::pair<int64_t, fs::path>>& all) {
  fs::path best;
  double lowest = std::numeric_limits<double>::infinity();
  for (const auto& [step, dir] : all) {
    const double l = saved_loss(dir);
    if (std::isfinite(l) && l < lowest) lowest = l, best = dir;
  }
  return best;
}

}  // namespace

std::string best_checkpoint(const std::string& run_dir) {
  const fs::path best = best_loss_checkpoint(complete_checkpoints(fs::path(run_dir) / "checkpoints"));
  return best.empty() ? find_latest_checkpoint(run_dir) : best.string();
}

SavedCheckpoint save_checkpoint(const std::string& run_dir, const CheckpointScalars& sc, const CheckpointBuffers& b,
                                const std::string& plan_json, const std::string& config_json, int64_t keep_last,
                                const CheckpointWriter& w) {
  quiet_hdf5();
  const fs::path root = fs::path(run_dir) / "checkpoints";
  const std::string name = step_name(sc.step);
  const fs::path partial = root / ("." + name + ".partial"), final_dir = root / name;
  const bool lead = w.rank == 0;
  auto barrier = [&] {
    if (w.barrier) w.barrier();
  };
  std::error_code ec;
  const fs::path save_id_file = partial / ".save_id";
  int64_t save_id = 0;
  if (lead) {
    fs::create_directories(root, ec);
    fs::remove_all(partial, ec);
    if (!fs::create_directories(partial, ec)) io_fail("creating the directory", partial.string());
    save_id = draw_save_id();
    std::ofstream(save_id_file) << save_id << "\n";
    fsync_path(save_id_file);
  }
  barrier();  // the directory and the save id exist before any rank writes into it
  if (!lead && !(std::ifstream(save_id_file) >> save_id)) io_fail("reading the save id rank 0 wrote", save_id_file.string());
  const fs::path file = partial / (lead ? std::string("state.h5") : shard_name(w.rank));
  hid_t f = H5Fcreate(file.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (f < 0) io_fail("creating the file", file.string());
  // Every file says which save it belongs to; rank 0's also holds the run's counters and texts.
  write_attr<int64_t>(f, "save_id", save_id, file.string());
  if (!lead) write_attr<int64_t>(f, "step", sc.step, file.string());
  if (lead) {
    write_attr<int64_t>(f, "format_version", int64_t{kCheckpointFormatVersion}, file.string());
    write_attr<int64_t>(f, "step", sc.step, file.string());
    write_attr<int64_t>(f, "applied_steps", sc.applied_steps, file.string());
    write_attr<int64_t>(f, "skipped_steps", sc.skipped_steps, file.string());
    write_attr<int64_t>(f, "seed", static_cast<int64_t>(sc.seed), file.string());
    write_attr<int64_t>(f, "world_size", int64_t{w.world_size}, file.string());
    write_attr<int64_t>(f, "model_numel", b.model_numel, file.string());
    write_attr<double>(f, "loss_scale", sc.loss_scaler.scale, file.string());
    write_attr<int64_t>(f, "loss_scale_iteration", sc.loss_scaler.iteration, file.string());
    write_attr<int64_t>(f, "loss_scale_last_overflow", sc.loss_scaler.last_overflow_iteration, file.string());
    write_attr<int64_t>(f, "loss_scale_hysteresis", sc.loss_scaler.hysteresis_left, file.string());
    write_attr<double>(f, "loss", sc.loss, file.string());
    write_string(f, "plan_json", plan_json, file.string());
    write_string(f, "config_json", config_json, file.string());
    if (!sc.base_json.empty()) write_string(f, "base_json", sc.base_json, file.string());
  }
  write_shard(f, b, file.string());
  write_attr<int64_t>(f, "meta_checksum", static_cast<int64_t>(metadata_checksum(f, file.string())), file.string());
  if (H5Fclose(f) < 0) io_fail("closing the file (is the disk full?)", file.string());
  fsync_path(file);
  barrier();  // every shard is on disk before the checkpoint is marked complete
  if (!lead) return {final_dir.string(), 0, {}};
  fs::remove(save_id_file, ec);
  std::ofstream(partial / "DONE") << "step " << sc.step << ", " << w.world_size << (w.world_size == 1 ? " rank" : " ranks") << "\n";
  fsync_path(partial / "DONE");
  uint64_t bytes = 0;
  for (const auto& e : fs::directory_iterator(partial)) bytes += static_cast<uint64_t>(fs::file_size(e.path()));
  // Re-saving a step (after a resume): the earlier save's files go; a user's files in it move into the new one.
  if (fs::exists(final_dir, ec))
    for (const std::string& kept : remove_checkpoint(final_dir.string())) {
      fs::rename(kept, partial / fs::path(kept).filename(), ec);
      if (ec) io_fail("moving " + kept + " into the new save: " + ec.message(), final_dir.string());
    }
  fs::rename(partial, final_dir, ec);
  if (ec) io_fail("renaming into place: " + ec.message(), final_dir.string());
  fsync_path(root);
  const fs::path latest_tmp = root / ".latest.tmp";
  std::ofstream(latest_tmp) << name;
  fsync_path(latest_tmp);
  fs::rename(latest_tmp, root / "latest", ec);
  if (ec) io_fail("updating latest: " + ec.message(), (root / "latest").string());

  // Prune the oldest beyond keep_last, never the one just written (a fresh run in a directory that
  // holds later steps from an earlier run must not delete its own checkpoint and leave `latest`
  // dangling), and never the one saved at the lowest loss (a diverging run must not prune its last good state).
  SavedCheckpoint saved{final_dir.string(), bytes, {}};
  if (keep_last > 0) {
    auto all = complete_checkpoints(root);
    const fs::path best = best_loss_checkpoint(all);
    for (size_t i = 0; i + static_cast<size_t>(keep_last) < all.size(); ++i) {
      if (all[i].second == final_dir || all[i].second == best) continue;
      bool busy = false;
      const std::vector<std::string> kept = remove_checkpoint(all[i].second.string(), &busy);
      if (busy) {
        saved.notes.push_back("train.keep_last: kept " + all[i].second.string() + " for now: another process is reading it "
                              "(an export?); a later save prunes it");
        continue;
      }
      if (!kept.empty())
        saved.notes.push_back("train.keep_last: removed the checkpoint in " + all[i].second.string() + " and kept what ds did not write there: " +
                              join(kept, ", "));
    }
  }
  return saved;
}

bool is_checkpoint_file_name(const std::string& n) {
  if (n == "state.h5" || n == "DONE" || n == ".save_id") return true;
  // shard_NNNNN.h5 (five digits or more: a rank past 99999)
  if (n.size() < 14 || n.rfind("shard_", 0) != 0 || n.compare(n.size() - 3, 3, ".h5") != 0) return false;
  return std::all_of(n.begin() + 6, n.end() - 3, [](char c) { return c >= '0' && c <= '9'; });
}

std::vector<std::string> remove_checkpoint(const std::string& checkpoint_dir, bool* busy) {
  std::error_code ec;
  std::vector<std::string> kept;
  // Exclusive against readers (CheckpointReader's shared lock), held while the files go. Only a reader's
  // hold counts as busy: a filesystem that cannot lock directories (NFS) removes without the lock.
  const int fd = ::open(checkpoint_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (busy) *busy = false;
  if (fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
    if (busy) {
      ::close(fd);
      *busy = true;
      return kept;
    }
    // It must go (a re-save, --overwrite): the reader gets a minute to finish, then the one waiting is told.
    bool locked = false;
    for (int tick = 0; tick < 600 && !locked; ++tick) {
      ::usleep(100000);
      locked = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    }
    if (!locked) {
      ::close(fd);
      throw std::runtime_error(checkpoint_dir + " has been read by another process (ds convert-ckpt?) for over a minute, and "
                               "this command must replace it: let that finish, then run this again");
    }
  }
  struct Closer {
    int fd;
    ~Closer() {
      if (fd >= 0) ::close(fd);
    }
  } closer{fd};
  // DONE first: a directory interrupted half-way through is then incomplete, never resumed from.
  fs::remove(fs::path(checkpoint_dir) / "DONE", ec);
  for (const auto& e : fs::directory_iterator(checkpoint_dir, ec)) {
    const std::string n = e.path().filename().string();
    if (is_checkpoint_file_name(n) && !e.is_symlink(ec) && e.is_regular_file(ec)) {
      fs::remove(e.path(), ec);
      if (ec) throw std::runtime_error("cannot remove " + e.path().string() + ": " + ec.message());
    } else {
      kept.push_back(e.path().string());
    }
  }
  std::sort(kept.begin(), kept.end());
  if (kept.empty()) fs::remove(checkpoint_dir, ec);
  return kept;
}

CheckpointReader::CheckpointReader(const std::string& path) {
  // A run directory's newest checkpoint may be pruned between finding it and locking it: then the newest again.
  for (int attempt = 0;; ++attempt) {
    dir_ = resolve_checkpoint_path(path);
    fd_ = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd_ >= 0) ::flock(fd_, LOCK_SH);
    if (complete(dir_) || attempt == 3) return;  // still complete under the lock, or resolve names what is wrong
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
}

CheckpointReader::~CheckpointReader() {
  if (fd_ >= 0) ::close(fd_);
}

std::string find_latest_checkpoint(const std::string& run_dir) {
  const fs::path root = fs::path(run_dir) / "checkpoints";
  // `latest` names the checkpoint the last run wrote last; it wins when it is complete. Otherwise
  // (absent, or naming a directory removed by hand) the highest complete step.
  std::ifstream in(root / "latest");
  std::string name;
  if (in >> name && step_of_name(name) >= 0 && complete(root / name)) return (root / name).string();
  auto all = complete_checkpoints(root);
  return all.empty() ? std::string() : all.back().second.string();
}

std::vector<std::string> unreadable_checkpoint_names(const std::string& run_dir) {
  std::vector<std::string> out;
  std::error_code ec;
  const fs::path root = fs::path(run_dir) / "checkpoints";
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("step_", 0) == 0 && step_of_name(n) < 0) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string resolve_checkpoint_path(const std::string& path) {
  fs::path p(path);
  if (p.filename() == "state.h5") p = p.parent_path();
  if (complete(p)) return p.string();
  if (fs::is_directory(p / "checkpoints")) {
    const std::string latest = find_latest_checkpoint(p.string());
    if (!latest.empty()) return latest;
  }
  if (p.filename() == "checkpoints") {
    const std::string latest = find_latest_checkpoint(p.parent_path().string());
    if (!latest.empty()) return latest;
  }
  throw UserError("no complete checkpoint at '" + path + "'",
                  "give a checkpoint directory (runs/x/checkpoints/step_00000100) or a run directory; "
                  "directories without a DONE marker are incomplete and never resumed from");
}

namespace {
// What to do about a damaged checkpoint: resume from the newest complete one before it.
std::string previous_checkpoint_hint(const std::string& dir) {
  const fs::path here = fs::weakly_canonical(fs::path(dir));
  std::string previous;
  for (const auto& [step, path] : complete_checkpoints(here.parent_path()))
    if (fs::weakly_canonical(path) != here && step < step_of_name(here.filename().string())) previous = path.string();
  return previous.empty() ? std::string("no earlier complete checkpoint is left in ") + here.parent_path().string()
                          : "resume from the previous complete checkpoint: train.resume=" + previous;
}

// verify_shard, with the previous complete checkpoint named in the hint when this one is damaged.
void verify_or_point_back(hid_t f, const std::string& file, const std::string& dir, bool current_format) {
  try {
    verify_shard(f, file, current_format);
  } catch (const UserError& e) {
    throw UserError(e.what(), previous_checkpoint_hint(dir));
  }
}

// One of a checkpoint's files, read-only; UserError saying why it cannot be opened (missing, empty,
// truncated or not HDF5) and which checkpoint to use instead.
hid_t open_checkpoint_file(const std::string& file, const std::string& dir) {
  quiet_hdf5();
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f >= 0) return f;
  std::error_code ec;
  const auto size = fs::file_size(file, ec);
  const std::string why = ec ? "is missing" : size == 0 ? "is empty" : "is not a readable HDF5 file (" + format_bytes(static_cast<double>(size)) + "): truncated or damaged";
  throw UserError("checkpoint file '" + file + "' " + why, ec ? "copy the whole checkpoint directory, or " + previous_checkpoint_hint(dir)
                                                               : previous_checkpoint_hint(dir));
}

// Copies every element of the caller's segments that `file`'s segments hold; returns how many.
int64_t read_overlaps(hid_t f, const std::vector<OwnedSegment>& theirs_in, const CheckpointBuffers& b, const std::string& path) {
  // A tensor-parallel rank's segments are a row each of a tensor split by columns (hundreds of thousands for a
  // 7B model): the file's segments are searched in global order, and reads that continue the previous one in
  // the file and in memory are made as one.
  std::vector<OwnedSegment> theirs = theirs_in;
  std::sort(theirs.begin(), theirs.end(), [](const OwnedSegment& x, const OwnedSegment& y) { return x.global < y.global; });
  int64_t filled = 0, from0 = 0, to0 = 0, run = 0;
  const auto flush = [&] {
    if (run == 0) return;
    read_float_range(f, "master", from0, run, b.master + to0, path);
    if (b.exp_avg) read_float_range(f, "optimizer/exp_avg", from0, run, b.exp_avg + to0, path);
    if (b.exp_avg_sq) read_float_range(f, "optimizer/exp_avg_sq", from0, run, b.exp_avg_sq + to0, path);
    run = 0;
  };
  for (const OwnedSegment& mine : b.segments) {
    const int64_t end = mine.global + mine.numel;
    // The first of the file's segments that ends past this one's start (they do not overlap one another).
    auto t = std::partition_point(theirs.begin(), theirs.end(), [&](const OwnedSegment& x) { return x.global + x.numel <= mine.global; });
    for (; t != theirs.end() && t->global < end; ++t) {
      const int64_t lo = std::max(mine.global, t->global), hi = std::min(end, t->global + t->numel);
      if (lo >= hi) continue;
      const int64_t from = t->local + (lo - t->global), to = mine.local + (lo - mine.global), n = hi - lo;
      if (run > 0 && from == from0 + run && to == to0 + run) {
        run += n;
      } else {
        flush();
        from0 = from, to0 = to, run = n;
      }
      filled += n;
    }
  }
  flush();
  return filled;
}

int64_t dataset_length(hid_t f, const char* name) {
  hid_t d = H5Dopen2(f, name, H5P_DEFAULT);
  if (d < 0) return -1;
  hid_t space = H5Dget_space(d);
  hsize_t dims[1] = {0};
  H5Sget_simple_extent_dims(space, dims, nullptr);
  H5Sclose(space);
  H5Dclose(d);
  return static_cast<int64_t>(dims[0]);
}

// The counters a resume takes on trust, checked for what they can never be.
void check_counters(const CheckpointScalars& sc, const std::string& dir, const std::string& file) {
  const std::string at = "'" + file + "': ";
  if (sc.step < 0 || sc.applied_steps < 0 || sc.skipped_steps < 0 || sc.applied_steps > sc.step || sc.skipped_steps > sc.step)
    throw UserError(at + "its counters are impossible (step " + std::to_string(sc.step) + ", applied " + std::to_string(sc.applied_steps) +
                        ", skipped " + std::to_string(sc.skipped_steps) + "): the file is corrupt",
                    previous_checkpoint_hint(dir));
  const int64_t named = step_of_name(fs::path(dir).filename().string());
  if (named >= 0 && named != sc.step)
    throw UserError(at + "holds step " + std::to_string(sc.step) + " but its directory is named for step " + std::to_string(named),
                    "a checkpoint directory keeps the name it was saved under; " + previous_checkpoint_hint(dir));
}
}  // namespace

std::vector<OwnedSegment> segments_within(const std::vector<OwnedSegment>& owned, int64_t begin, int64_t end) {
  std::vector<OwnedSegment> out;
  for (const OwnedSegment& g : owned) {
    const int64_t lo = std::max(g.local, begin), hi = std::min(g.local + g.numel, end);
    if (lo < hi) out.push_back({g.param, g.global + (lo - g.local), lo - begin, hi - lo});
  }
  return out;
}

CheckpointScalars load_checkpoint(const std::string& dir, const CheckpointBuffers& b) {
  const std::string file = (fs::path(dir) / "state.h5").string();
  hid_t f = open_checkpoint_file(file, dir);
  CheckpointScalars sc;
  int64_t world = 1, filled = 0, wanted = 0, save_id = 0;
  bool current = false;
  for (const auto& g : b.segments) wanted += g.numel;
  try {
    const int64_t version = read_attr<int64_t>(f, "format_version", file);
    if (version < 1 || version > kCheckpointFormatVersion)
      throw UserError("'" + file + "' has checkpoint format version " + std::to_string(version) + "; this ds reads versions 1 to " +
                          std::to_string(kCheckpointFormatVersion),
                      "use the ds release that wrote it, or a newer one");
    current = version >= 3;
    sc.step = read_attr<int64_t>(f, "step", file);
    sc.applied_steps = read_attr<int64_t>(f, "applied_steps", file);
    sc.skipped_steps = read_attr<int64_t>(f, "skipped_steps", file);
    sc.seed = static_cast<uint64_t>(read_attr<int64_t>(f, "seed", file));
    sc.loss_scaler.scale = read_attr<double>(f, "loss_scale", file);
    sc.loss_scaler.iteration = read_attr<int64_t>(f, "loss_scale_iteration", file);
    sc.loss_scaler.last_overflow_iteration = read_attr<int64_t>(f, "loss_scale_last_overflow", file);
    sc.loss_scaler.hysteresis_left = static_cast<int>(read_attr<int64_t>(f, "loss_scale_hysteresis", file));
    // Version 1: one whole model, no segment table.
    const int64_t model_numel = version == 1 ? dataset_length(f, "master") : read_attr<int64_t>(f, "model_numel", file);
    if (model_numel != b.model_numel)
      throw UserError("'" + file + "' holds " + format_count(model_numel) + " parameters, but this plan has " +
                          format_count(b.model_numel),
                      "resume with the model the checkpoint was trained with (its plan_json says which)");
    if (b.verify) verify_or_point_back(f, file, dir, current);
    check_counters(sc, dir, file);
    if (H5Lexists(f, "base_json", H5P_DEFAULT) > 0) sc.base_json = read_string(f, "base_json", file);
    if (current) save_id = read_attr<int64_t>(f, "save_id", file);
    if (version == 1) {
      filled = read_overlaps(f, {OwnedSegment{0, 0, 0, model_numel}}, b, file);
    } else {
      world = read_attr<int64_t>(f, "world_size", file);
      if (world < 1 || world > (1 << 20))
        throw UserError("'" + file + "' claims " + std::to_string(world) + " ranks wrote it: the file is corrupt", previous_checkpoint_hint(dir));
      const std::vector<OwnedSegment> segs = read_segments(f, file);
      check_segments(segs, model_numel, f, file);
      filled = read_overlaps(f, segs, b, file);
    }
  } catch (...) {
    H5Fclose(f);
    throw;
  }
  H5Fclose(f);
  for (int r = 1; r < world; ++r) {
    const std::string shard = (fs::path(dir) / shard_name(r)).string();
    hid_t h = open_checkpoint_file(shard, dir);
    try {
      if (b.verify) verify_or_point_back(h, shard, dir, current);
      if (current) {
        const int64_t its_id = has_attr(h, "save_id") ? read_attr<int64_t>(h, "save_id", shard) : 0;
        const int64_t its_step = has_attr(h, "step") ? read_attr<int64_t>(h, "step", shard) : -1;
        if (its_id != save_id || its_step != sc.step)
          throw UserError("'" + shard + "' belongs to another checkpoint (" +
                              (its_step == sc.step ? "another save of step " + std::to_string(its_step) : "step " + std::to_string(its_step)) +
                              "), not to this one (step " + std::to_string(sc.step) + ")",
                          "a checkpoint's files are written together: copy the whole directory, or " + previous_checkpoint_hint(dir));
      }
      const std::vector<OwnedSegment> segs = read_segments(h, shard);
      check_segments(segs, b.model_numel, h, shard);
      filled += read_overlaps(h, segs, b, shard);
    } catch (...) {
      H5Fclose(h);
      throw;
    }
    H5Fclose(h);
  }
  if (filled != wanted)
    throw UserError("checkpoint '" + dir + "' covers " + format_count(filled) + " of the " + format_count(wanted) +
                        " elements this rank needs", "the shards do not belong together; copy the whole checkpoint directory");
  return sc;
}

std::string hdf5_version() {
  unsigned major = 0, minor = 0, release = 0;
  H5get_libversion(&major, &minor, &release);
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release);
}

std::string read_checkpoint_text(const std::string& dir, const char* which) {
  const std::string file = (fs::path(dir) / "state.h5").string();
  hid_t f = open_checkpoint_file(file, dir);
  std::string s;
  try {
    // The metadata checksum before the text is trusted: a flipped bit in plan.json is named as corruption,
    // not reported as a JSON error.
    if (has_attr(f, "meta_checksum") && static_cast<uint64_t>(read_attr<int64_t>(f, "meta_checksum", file)) != metadata_checksum(f, file))
      throw UserError("'" + file + "': its counters, plan or config do not match their checksum: the file is corrupt",
                      previous_checkpoint_hint(dir));
    s = read_string(f, which, file);
  } catch (...) {
    H5Fclose(f);
    throw;
  }
  H5Fclose(f);
  return s;
}

PlanRecord read_checkpoint_plan(const std::string& dir) {
  return read_plan_record(read_checkpoint_text(dir, "plan_json"), "checkpoint '" + dir + "'");
}

}  // namespace ds
