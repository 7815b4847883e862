#include "engine/runtime/comm.hpp"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <functional>

#include "common/error.hpp"

namespace ds {

CommStats& Communicator::count_all_reduce(CollectiveKind kind, double payload_bytes, int64_t* event) {
  CommStats& s = ledger_[kind];
  s.op = collective_op_name(CollectiveOp::all_reduce);
  ++s.calls;
  const double wire = wire_bytes_per_rank(CollectiveOp::all_reduce, payload_bytes, world_);
  s.bytes += wire;
  *event = -1;
  if (recording_) {
    const auto now = std::chrono::steady_clock::now();
    events_.push_back({kind, now, now, wire});
    *event = static_cast<int64_t>(events_.size()) - 1;
  }
  return s;
}

namespace {

// LibTorch 1.13's Gloo has no reduce-scatter in its CPU path worth using, no bf16/fp16 reduction, and an
// all-gather a third as fast as its all-reduce.
class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(int rank, int world, std::chrono::milliseconds timeout, const std::string& host, int port);
  CommCapabilities capabilities() const override { return {}; }
  std::unique_ptr<PendingCollective> all_reduce_sum_async(const torch::Tensor& t, CollectiveKind kind) override;
  std::unique_ptr<PendingCollective> gather_by_sum_async(const torch::Tensor& t, CollectiveKind kind) override;
  void barrier() override { group_->barrier()->wait(); }
  void mark_step(int64_t step) override;

 private:
  // "rank 1 last reported step 6 (this rank is at step 7)": read from the store after a timeout.
  std::string who_is_behind() const;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
};

}  // namespace

std::unique_ptr<Communicator> Communicator::create(const Topology& t, std::chrono::milliseconds timeout) {
  if (t.master_addr.empty() || t.master_port == 0)
    throw UserError(std::string(t.master_addr.empty() ? "MASTER_ADDR" : "MASTER_PORT") + " is not set, but the world size is above 1",
                    "start ranks with `ds train --nproc-per-node N`, torchrun --no-python, or set RANK, WORLD_SIZE, "
                    "MASTER_ADDR and MASTER_PORT yourself");
  return std::make_unique<GlooCommunicator>(t.rank, t.world_size, timeout, t.master_addr, t.master_port);
}

GlooCommunicator::GlooCommunicator(int rank, int world, std::chrono::milliseconds timeout, const std::string& host, int port)
    : Communicator(rank, world) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.isServer = rank == 0;
  so.numWorkers = static_cast<size_t>(world);
  so.waitWorkers = true;
  so.timeout = timeout;
  try {
    store_ = c10::make_intrusive<c10d::TCPStore>(host, so);
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    // GLOO_SOCKET_IFNAME picks the network interface, as torch.distributed does; by default Gloo uses
    // the address this host's name resolves to.
    const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
    options->devices.push_back(ifname && *ifname ? c10d::ProcessGroupGloo::createDeviceForInterface(ifname)
                                                 : c10d::ProcessGroupGloo::createDefaultDevice());
    group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank, world, options);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw std::runtime_error("rank " + std::to_string(rank) + " could not join the group at " + host + ":" + std::to_string(port) +
                             " within " + std::to_string(timeout.count() / 1000) + " s: " + what.substr(0, what.find('\n')));
  }
}

namespace {
class GlooWork : public PendingCollective {
 public:
  // `then` runs once the collective is done (an fp32 copy written back into a 16-bit tensor). The
  // ledger's seconds are the time this rank was held up: issuing (from `start`) and waiting, not the
  // time the collective ran beside compute. `explain` says who is missing when the wait fails.
  GlooWork(c10::intrusive_ptr<c10d::Work> work, CommStats& stats, std::chrono::steady_clock::time_point start,
           std::function<std::string()> explain, std::function<void()> then = {}, std::function<void()> finished = {})
      : work_(std::move(work)), stats_(stats), explain_(std::move(explain)), then_(std::move(then)), finished_(std::move(finished)) {
    stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  ~GlooWork() override {
    if (work_) try { work_->wait(); } catch (...) {}  // never leave Gloo writing into freed memory
  }
  void wait() override {
    if (!work_) return;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      work_->wait();
    } catch (const std::exception& e) {
      work_.reset();
      const std::string what = e.what();
      throw std::runtime_error("a collective failed: " + explain_() + " (" + what.substr(0, what.find('\n')) + ")");
    }
    work_.reset();
    if (then_) then_();
    stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (finished_) finished_();
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  CommStats& stats_;
  std::function<std::string()> explain_;
  std::function<void()> then_;
  std::function<void()> finished_;
};
}  // namespace

std::unique_ptr<PendingCollective> GlooCommunicator::all_reduce_sum_async(const torch::Tensor& t, CollectiveKind kind) {
  const auto t0 = std::chrono::steady_clock::now();
  DS_CHECK(t.is_contiguous(), "all-reduce of a non-contiguous tensor");
  const bool narrow = t.scalar_type() != torch::kFloat32 && t.scalar_type() != torch::kFloat64;
  std::vector<torch::Tensor> buf{narrow ? t.to(torch::kFloat32) : t};
  auto work = group_->allreduce(buf);
  int64_t event = -1;
  CommStats& s = count_all_reduce(kind, static_cast<double>(buf[0].nbytes()), &event);
  std::function<void()> then;
  if (narrow) then = [t, wide = buf[0]] { t.copy_(wide); };
  return std::make_unique<GlooWork>(std::move(work), s, t0, [this] { return who_is_behind(); }, std::move(then),
                                    [this, event] { finish_event(event); });
}

std::unique_ptr<PendingCollective> GlooCommunicator::gather_by_sum_async(const torch::Tensor& t, CollectiveKind kind) {
  const auto t0 = std::chrono::steady_clock::now();
  DS_CHECK(t.is_contiguous(), "gather of a non-contiguous tensor");
  const int64_t bytes = static_cast<int64_t>(t.nbytes());
  // Integer lanes: int32 where the size allows, else bytes. Lanes never carry into each other.
  std::vector<torch::Tensor> bits{bytes % 4 == 0 ? torch::from_blob(t.data_ptr(), {bytes / 4}, torch::kInt32)
                                                 : torch::from_blob(t.data_ptr(), {bytes}, torch::kInt8)};
  auto work = group_->allreduce(bits);
  int64_t event = -1;
  CommStats& s = count_all_reduce(kind, static_cast<double>(bytes), &event);
  return std::make_unique<GlooWork>(std::move(work), s, t0, [this] { return who_is_behind(); }, std::function<void()>(),
                                    [this, event] { finish_event(event); });
}

namespace {
std::string step_key(int rank) { return "ds/step/" + std::to_string(rank); }
}  // namespace

void GlooCommunicator::mark_step(int64_t step) {
  step_ = step;
  const std::string v = std::to_string(step);
  try {
    store_->set(step_key(rank_), std::vector<uint8_t>(v.begin(), v.end()));
  } catch (const std::exception&) {
    // The store's host is gone: the next collective fails and says so.
  }
}

std::string GlooCommunicator::who_is_behind() const {
  std::string behind, same;
  try {
    store_->setTimeout(std::chrono::seconds(3));  // a diagnosis, not another long wait
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      if (!store_->check({step_key(r)})) {
        behind += (behind.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " never reported a step";
        continue;
      }
      const std::vector<uint8_t> v = store_->get(step_key(r));
      const int64_t step = std::stoll(std::string(v.begin(), v.end()));
      if (step < step_)
        behind += (behind.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " last reported step " +
                  std::to_string(step + 1);
      else
        same += (same.empty() ? "" : ", ") + std::to_string(r);
    }
  } catch (const std::exception&) {
    return "rank " + std::to_string(rank_) + " waited in vain, and rank 0 (which hosts the rendezvous store) did not answer either";
  }
  if (!behind.empty())
    return behind + " while rank " + std::to_string(rank_) + " waited at step " + std::to_string(step_ + 1);
  const bool one = same.find(',') == std::string::npos;
  return "rank " + std::to_string(rank_) + " waited in vain at step " + std::to_string(step_ + 1) +
         (same.empty() ? std::string()
                       : one ? "; rank " + same + " reached that step too and stopped within it"
                             : "; ranks " + same + " reached that step too, so one of them stopped within it");
}

}  // namespace ds
