#include "engine/runtime/comm.hpp"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>

#include "common/error.hpp"

namespace ds {

struct Communicator::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
};

namespace {
std::string env_or_throw(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v)
    throw UserError(std::string(name) + " is not set, but the world size is above 1",
                    "start ranks with `ds train --nproc-per-node N`, torchrun --no-python, or set RANK, WORLD_SIZE, "
                    "MASTER_ADDR and MASTER_PORT yourself");
  return v;
}
int env_int(const char* name) {
  const std::string v = env_or_throw(name);
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (*end != '\0' || x < 0) throw UserError(std::string(name) + "='" + v + "' is not a non-negative integer", "");
  return static_cast<int>(x);
}
}  // namespace

std::unique_ptr<Communicator> Communicator::from_environment(std::chrono::milliseconds timeout) {
  const int rank = env_int("RANK"), world = env_int("WORLD_SIZE"), port = env_int("MASTER_PORT");
  if (rank >= world) throw UserError("RANK=" + std::to_string(rank) + " is not below WORLD_SIZE=" + std::to_string(world), "");
  return std::unique_ptr<Communicator>(new Communicator(rank, world, timeout, env_or_throw("MASTER_ADDR"), port));
}

Communicator::Communicator(int rank, int world, std::chrono::milliseconds timeout, const std::string& host, int port)
    : impl_(std::make_unique<Impl>()), rank_(rank), world_(world) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.isServer = rank == 0;
  so.numWorkers = static_cast<size_t>(world);
  so.waitWorkers = true;
  so.timeout = timeout;
  try {
    impl_->store = c10::make_intrusive<c10d::TCPStore>(host, so);
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    impl_->group = c10::make_intrusive<c10d::ProcessGroupGloo>(impl_->store, rank, world, options);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw std::runtime_error("rank " + std::to_string(rank) + " could not join the group at " + host + ":" + std::to_string(port) +
                             " within " + std::to_string(timeout.count() / 1000) + " s: " + what.substr(0, what.find('\n')));
  }
}

Communicator::~Communicator() = default;

void Communicator::all_reduce_sum(const torch::Tensor& t) {
  const auto t0 = std::chrono::steady_clock::now();
  const bool narrow = t.scalar_type() != torch::kFloat32 && t.scalar_type() != torch::kFloat64;
  std::vector<torch::Tensor> buf{narrow ? t.to(torch::kFloat32) : t};
  impl_->group->allreduce(buf)->wait();
  if (narrow) t.copy_(buf[0]);
  CommStats& s = stats_[narrow ? "all_reduce (via fp32)" : "all_reduce"];
  ++s.calls;
  // A ring all-reduce sends 2 (W-1)/W of the buffer from each rank.
  s.bytes += 2.0 * (world_ - 1) / world_ * static_cast<double>(buf[0].nbytes());
  s.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Communicator::barrier() { impl_->group->barrier()->wait(); }

}  // namespace ds
