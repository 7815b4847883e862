#include "engine/runtime/checkpoint.hpp"

#include <fcntl.h>
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "common/error.hpp"
#include "common/format.hpp"
#include "engine/runtime/hdf5_quiet.hpp"

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

void write_floats(hid_t loc, const char* name, const float* data, int64_t n, const std::string& path) {
  hsize_t dims[1] = {static_cast<hsize_t>(n)};
  hid_t space = H5Screate_simple(1, dims, nullptr);
  hid_t d = H5Dcreate2(loc, name, H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  if (d < 0 || H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
    io_fail(std::string("writing ") + name + " (is the disk full?)", path);
  H5Dclose(d);
  H5Sclose(space);
}

void read_floats(hid_t loc, const char* name, float* data, int64_t n, const std::string& path) {
  hid_t d = H5Dopen2(loc, name, H5P_DEFAULT);
  if (d < 0) throw UserError("'" + path + "' has no dataset '" + name + "': not a ds checkpoint", "");
  hid_t space = H5Dget_space(d);
  hsize_t dims[1] = {0};
  H5Sget_simple_extent_dims(space, dims, nullptr);
  H5Sclose(space);
  if (static_cast<int64_t>(dims[0]) != n) {
    H5Dclose(d);
    throw UserError("'" + path + "' holds " + format_count(static_cast<int64_t>(dims[0])) + " parameters in '" + name +
                        "', but this plan has " + format_count(n),
                    "resume with the model the checkpoint was trained with (its plan_json says which)");
  }
  if (H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0) io_fail(std::string("reading ") + name, path);
  H5Dclose(d);
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

bool complete(const fs::path& dir) { return fs::exists(dir / "DONE") && fs::exists(dir / "state.h5"); }

std::vector<std::pair<int64_t, fs::path>> complete_checkpoints(const fs::path& ckpt_root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  if (!fs::is_directory(ckpt_root)) return out;
  for (const auto& e : fs::directory_iterator(ckpt_root)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("step_", 0) != 0 || !e.is_directory() || !complete(e.path())) continue;
    out.emplace_back(std::stoll(n.substr(5)), e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

SavedCheckpoint save_checkpoint(const std::string& run_dir, const CheckpointScalars& sc, const CheckpointBuffers& b,
                                const std::string& plan_json, const std::string& config_json, int64_t keep_last) {
  quiet_hdf5();
  const fs::path root = fs::path(run_dir) / "checkpoints";
  const std::string name = step_name(sc.step);
  const fs::path partial = root / ("." + name + ".partial"), final_dir = root / name;
  std::error_code ec;
  fs::create_directories(root, ec);
  fs::remove_all(partial, ec);
  if (!fs::create_directories(partial, ec)) io_fail("creating the directory", partial.string());
  const fs::path file = partial / "state.h5";
  hid_t f = H5Fcreate(file.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (f < 0) io_fail("creating the file", file.string());
  write_attr<int64_t>(f, "format_version", int64_t{kCheckpointFormatVersion}, file.string());
  write_attr<int64_t>(f, "step", sc.step, file.string());
  write_attr<int64_t>(f, "applied_steps", sc.applied_steps, file.string());
  write_attr<int64_t>(f, "skipped_steps", sc.skipped_steps, file.string());
  write_attr<int64_t>(f, "seed", static_cast<int64_t>(sc.seed), file.string());
  write_attr<double>(f, "loss_scale", sc.loss_scaler.scale, file.string());
  write_attr<int64_t>(f, "loss_scale_iteration", sc.loss_scaler.iteration, file.string());
  write_attr<int64_t>(f, "loss_scale_last_overflow", sc.loss_scaler.last_overflow_iteration, file.string());
  write_attr<int64_t>(f, "loss_scale_hysteresis", sc.loss_scaler.hysteresis_left, file.string());
  write_floats(f, "master", b.master, b.numel, file.string());
  hid_t g = H5Gcreate2(f, "optimizer", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  if (b.exp_avg) write_floats(g, "exp_avg", b.exp_avg, b.numel, file.string());
  if (b.exp_avg_sq) write_floats(g, "exp_avg_sq", b.exp_avg_sq, b.numel, file.string());
  H5Gclose(g);
  write_string(f, "plan_json", plan_json, file.string());
  write_string(f, "config_json", config_json, file.string());
  if (H5Fclose(f) < 0) io_fail("closing the file (is the disk full?)", file.string());
  fsync_path(file);
  std::ofstream(partial / "DONE") << "step " << sc.step << "\n";
  fsync_path(partial / "DONE");
  if (fs::exists(final_dir)) fs::remove_all(final_dir, ec);  // re-saving a step, e.g. after a resume
  fs::rename(partial, final_dir, ec);
  if (ec) io_fail("renaming into place: " + ec.message(), final_dir.string());
  fsync_path(root);
  const fs::path latest_tmp = root / ".latest.tmp";
  std::ofstream(latest_tmp) << name;
  fsync_path(latest_tmp);
  fs::rename(latest_tmp, root / "latest", ec);
  if (ec) io_fail("updating latest: " + ec.message(), (root / "latest").string());

  // Prune the oldest beyond keep_last, never the one just written: a fresh run in a directory that
  // holds later steps from an earlier run must not delete its own checkpoint (and leave `latest` dangling).
  if (keep_last > 0) {
    auto all = complete_checkpoints(root);
    for (size_t i = 0; i + static_cast<size_t>(keep_last) < all.size(); ++i)
      if (all[i].second != final_dir) fs::remove_all(all[i].second, ec);
  }
  return {final_dir.string(), static_cast<uint64_t>(fs::file_size(final_dir / "state.h5"))};
}

std::string find_latest_checkpoint(const std::string& run_dir) {
  auto all = complete_checkpoints(fs::path(run_dir) / "checkpoints");
  return all.empty() ? std::string() : all.back().second.string();
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

CheckpointScalars load_checkpoint(const std::string& dir, const CheckpointBuffers& b) {
  quiet_hdf5();
  const std::string file = (fs::path(dir) / "state.h5").string();
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) throw UserError("cannot open checkpoint '" + file + "' (missing or not HDF5)", "");
  CheckpointScalars sc;
  try {
    const int64_t version = read_attr<int64_t>(f, "format_version", file);
    if (version != kCheckpointFormatVersion)
      throw UserError("'" + file + "' has checkpoint format version " + std::to_string(version) + "; this ds reads version " +
                          std::to_string(kCheckpointFormatVersion),
                      "use the ds release that wrote it, or a newer one");
    sc.step = read_attr<int64_t>(f, "step", file);
    sc.applied_steps = read_attr<int64_t>(f, "applied_steps", file);
    sc.skipped_steps = read_attr<int64_t>(f, "skipped_steps", file);
    sc.seed = static_cast<uint64_t>(read_attr<int64_t>(f, "seed", file));
    sc.loss_scaler.scale = read_attr<double>(f, "loss_scale", file);
    sc.loss_scaler.iteration = read_attr<int64_t>(f, "loss_scale_iteration", file);
    sc.loss_scaler.last_overflow_iteration = read_attr<int64_t>(f, "loss_scale_last_overflow", file);
    sc.loss_scaler.hysteresis_left = static_cast<int>(read_attr<int64_t>(f, "loss_scale_hysteresis", file));
    read_floats(f, "master", b.master, b.numel, file);
    if (b.exp_avg) read_floats(f, "optimizer/exp_avg", b.exp_avg, b.numel, file);
    if (b.exp_avg_sq) read_floats(f, "optimizer/exp_avg_sq", b.exp_avg_sq, b.numel, file);
  } catch (...) {
    H5Fclose(f);
    throw;
  }
  H5Fclose(f);
  return sc;
}

std::string hdf5_version() {
  unsigned major = 0, minor = 0, release = 0;
  H5get_libversion(&major, &minor, &release);
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release);
}

std::string read_checkpoint_text(const std::string& dir, const char* which) {
  quiet_hdf5();
  const std::string file = (fs::path(dir) / "state.h5").string();
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) throw UserError("cannot open checkpoint '" + file + "'", "");
  std::string s;
  try {
    s = read_string(f, which, file);
  } catch (...) {
    H5Fclose(f);
    throw;
  }
  H5Fclose(f);
  return s;
}

}  // namespace ds
