// libFuzzer target: what ds reads from a checkpoint's metadata. The input's bytes become the values
// of a well-formed HDF5 checkpoint (format version, step counters, world size, model size, the segment
// table, the data sets' lengths), written with HDF5 and loaded back: HDF5's own parser is not the
// subject, ds's checks of what a file claims are.
#include <hdf5.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "engine/runtime/io/checkpoint.hpp"
#include "engine/runtime/io/hdf5_quiet.hpp"

namespace {

struct Input {
  const uint8_t* p;
  size_t n;
  int64_t take() {
    int64_t v = 0;
    const size_t k = n < 8 ? n : 8;
    std::memcpy(&v, p, k);
    p += k;
    n -= k;
    return v;
  }
  int64_t small(int64_t mod) { return mod > 0 ? static_cast<int64_t>(static_cast<uint64_t>(take()) % static_cast<uint64_t>(mod)) : 0; }
};

void attr(hid_t f, const char* name, int64_t v) {
  hid_t s = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(f, name, H5T_STD_I64LE, s, H5P_DEFAULT, H5P_DEFAULT);
  H5Awrite(a, H5T_NATIVE_INT64, &v);
  H5Aclose(a);
  H5Sclose(s);
}

void floats(hid_t loc, const char* name, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n), 1.0f);
  hsize_t dims[1] = {static_cast<hsize_t>(n)};
  hid_t s = H5Screate_simple(1, dims, nullptr);
  hid_t d = H5Dcreate2(loc, name, H5T_IEEE_F32LE, s, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  if (n > 0) H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
  H5Dclose(d);
  H5Sclose(s);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ds::quiet_hdf5();
  Input in{data, size};
  const std::string dir = "/tmp/ds_fuzz_ckpt_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  hid_t f = H5Fcreate((dir + "/state.h5").c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  const int64_t version = in.small(4), model_numel = in.small(1 << 12) - 8, world = in.small(3) + 1;
  attr(f, "format_version", version);
  for (const char* name : {"step", "applied_steps", "skipped_steps", "seed", "loss_scale_iteration", "loss_scale_last_overflow",
                           "loss_scale_hysteresis"})
    attr(f, name, in.take());
  hid_t s = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(f, "loss_scale", H5T_IEEE_F64LE, s, H5P_DEFAULT, H5P_DEFAULT);
  const double scale = static_cast<double>(in.take());
  H5Awrite(a, H5T_NATIVE_DOUBLE, &scale);
  H5Aclose(a);
  H5Sclose(s);
  attr(f, "world_size", world);
  attr(f, "model_numel", model_numel);
  // The segment table: rows of [global, local, numel] straight from the input.
  const int64_t rows = in.small(5);
  std::vector<int64_t> segs;
  for (int64_t r = 0; r < rows * 3; ++r) segs.push_back(in.small(1 << 13) - 16);
  hsize_t dims[2] = {static_cast<hsize_t>(rows), 3};
  hid_t ss = H5Screate_simple(2, dims, nullptr);
  hid_t d = H5Dcreate2(f, "segments", H5T_STD_I64LE, ss, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  if (rows > 0) H5Dwrite(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, segs.data());
  H5Dclose(d);
  H5Sclose(ss);
  floats(f, "master", in.small(1 << 12));
  hid_t g = H5Gcreate2(f, "optimizer", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  floats(g, "exp_avg", in.small(1 << 12));
  H5Gclose(g);
  H5Fclose(f);
  std::filesystem::remove(dir + "/shard_00001.h5");
  std::ofstream(dir + "/DONE") << "fuzz\n";

  // The loader's side: a model of 1,000 elements, this rank owning all of it.
  std::vector<float> master(1000), m1(1000);
  ds::CheckpointBuffers b{master.data(), m1.data(), nullptr, 1000, {{0, 0, 0, 1000}}, 1000};
  try {
    ds::load_checkpoint(dir, b);
  } catch (const ds::UserError&) {
  } catch (const std::runtime_error&) {  // checkpoint I/O failed: an answer too
  }
  return 0;
}
