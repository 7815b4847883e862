#include "engine/runtime/comm/comm_local.hpp"

#include <condition_variable>
#include <deque>
#include <map>
#include <functional>
#include <mutex>
#include <string>
#include <stdexcept>
#include <vector>

#include "common/error.hpp"
#include "engine/runtime/comm/comm_host.hpp"

namespace ds {

// Reusable meetings. all_reduce: ranks arrive with their tensors; the last one sums them in rank order;
// every rank copies the sum out; the last to leave opens the next meeting. exchange: once all have
// arrived, each rank reads the others' tensors as it needs (writing only its own), and none leaves
// before all have read.
struct LocalGroup::Shared {
  int world = 1;
  CommBackend speaks = CommBackend::gloo;
  std::chrono::milliseconds timeout{0};
  std::mutex m;
  std::condition_variable cv;
  std::vector<torch::Tensor> inputs;
  torch::Tensor sum;
  int arrived = 0, left = 0, read = 0;
  bool leaving = false;
  // Point to point: per (sender, receiver), the copies sent and not yet received, in order.
  std::map<std::pair<int, int>, std::deque<torch::Tensor>> mail;
  // split()'s groups, by name: the first member to arrive makes one, the others join it.
  std::vector<int> members;  // a group's ranks in its parent (empty for the whole group)
  std::vector<bool> joined;  // a group's: which members have joined it (each once)
  std::map<std::string, std::shared_ptr<Shared>> groups;
  // Set once a member failed (Communicator::abort): every wait here throws it from then on.
  std::string ended;

  void end(const std::string& why) {
    std::lock_guard<std::mutex> lock(m);
    if (ended.empty()) ended = why;  // (the first failure is the cause; later ones follow from it)
    cv.notify_all();
  }

  // The group `name` of `ranks`, joined by its member `place`.
  std::shared_ptr<Shared> group(const std::string& name, const std::vector<int>& ranks, int place) {
    std::lock_guard<std::mutex> lock(m);
    std::shared_ptr<Shared>& g = groups[name];
    if (!g) {
      g = std::make_shared<Shared>();
      g->world = static_cast<int>(ranks.size());
      g->speaks = speaks;
      g->timeout = timeout;
      g->inputs.resize(ranks.size());
      g->members = ranks;
      g->joined.assign(ranks.size(), false);
    }
    DS_CHECK(g->members == ranks, "the group ", name, " was formed with other members");
    // (a rank joining the LocalGroup again would otherwise meet the first run's group, its mail and meetings)
    DS_CHECK(!g->joined[static_cast<size_t>(place)], "the group ", name, " was joined by its member ", place, " already");
    g->joined[static_cast<size_t>(place)] = true;
    return g;
  }

  void post(int from, int to, const torch::Tensor& t) {
    std::lock_guard<std::mutex> lock(m);
    if (!ended.empty()) throw std::runtime_error(ended);
    mail[{from, to}].push_back(t.clone());
    cv.notify_all();
  }
  void take(int from, int to, const torch::Tensor& t) {
    std::unique_lock<std::mutex> lock(m);
    std::deque<torch::Tensor>& box = mail[{from, to}];
    wait(lock, "a message from another rank", [&] { return !box.empty(); });
    DS_CHECK(box.front().numel() == t.numel() && box.front().scalar_type() == t.scalar_type(), "a message of another size or dtype");
    t.copy_(box.front().view(t.sizes()));
    box.pop_front();
  }

  void wait(std::unique_lock<std::mutex>& lock, const char* what, const std::function<bool()>& ready) {
    if (!cv.wait_for(lock, timeout, [&] { return !ended.empty() || ready(); }))
      throw std::runtime_error(std::string("a local collective timed out waiting for ") + what);
    if (!ended.empty()) throw std::runtime_error(ended);
  }

  // Every rank calls it with a tensor of the same shape and dtype; returns with the sum written into it.
  void all_reduce(int rank, const torch::Tensor& t) {
    std::unique_lock<std::mutex> lock(m);
    wait(lock, "the previous collective to finish", [&] { return !leaving; });
    inputs[static_cast<size_t>(rank)] = t;
    if (++arrived == world) {
      torch::Tensor s = inputs[0].clone();
      for (int r = 1; r < world; ++r) {
        DS_CHECK(inputs[static_cast<size_t>(r)].numel() == s.numel(), "ranks disagree on a collective's size");
        s.add_(inputs[static_cast<size_t>(r)]);
      }
      sum = s;
      leaving = true;
      cv.notify_all();
    } else {
      wait(lock, "the other ranks", [&] { return leaving; });
    }
    t.copy_(sum);
    if (++left == world) {
      arrived = left = 0;
      leaving = false;
      sum = torch::Tensor();
      for (auto& in : inputs) in = torch::Tensor();
      cv.notify_all();
    }
  }

  void exchange(int rank, const torch::Tensor& t, const std::function<void(const std::vector<torch::Tensor>&)>& read_others) {
    std::unique_lock<std::mutex> lock(m);
    wait(lock, "the previous collective to finish", [&] { return !leaving; });
    inputs[static_cast<size_t>(rank)] = t;
    if (++arrived == world) {
      leaving = true;
      cv.notify_all();
    } else {
      wait(lock, "the other ranks", [&] { return leaving; });
    }
    lock.unlock();
    read_others(inputs);  // the vector is stable until every rank has read
    lock.lock();
    if (++read == world) cv.notify_all();
    wait(lock, "the other ranks to read", [&] { return read == world; });
    if (++left == world) {
      arrived = left = read = 0;
      leaving = false;
      for (auto& in : inputs) in = torch::Tensor();
      cv.notify_all();
    }
  }
};

namespace {

class Done : public PendingCollective {
 public:
  void wait() override {}
};

class LocalCommunicator : public Communicator {
 public:
  // `world_rank`: the rank's place among all the threads (a split group's messages name it). `messages_only`: a
  // group split for messages (split_for_messages), whose collectives are refused as NCCL's are.
  LocalCommunicator(int rank, int world_rank, std::shared_ptr<LocalGroup::Shared> shared, bool messages_only = false)
      : Communicator(rank, shared->world), world_rank_(world_rank), messages_only_(messages_only), shared_(std::move(shared)) {}

  std::unique_ptr<PendingCollective> all_reduce_sum_async(const torch::Tensor& t, CollectiveKind kind) override {
    DS_CHECK(t.is_contiguous(), "all-reduce of a non-contiguous tensor");
    require_collectives("an all-reduce");
    // As over Gloo: 16-bit floats are summed through an fp32 copy; as NCCL: in their own dtype.
    const bool narrow = !capabilities().sums_16bit && t.scalar_type() != torch::kFloat32 && t.scalar_type() != torch::kFloat64;
    const torch::Tensor buf = narrow ? t.to(torch::kFloat32) : t;
    int64_t event = -1;
    count(kind, CollectiveOp::all_reduce, static_cast<double>(buf.nbytes()), &event);
    shared_->all_reduce(rank_, buf);
    if (narrow) t.copy_(buf);
    finish_event(event);
    return std::make_unique<Done>();
  }

  std::unique_ptr<PendingCollective> all_gather_async(const torch::Tensor& t, const Ownership& owners, CollectiveKind kind) override {
    DS_CHECK(t.is_contiguous() && owners.size() == static_cast<size_t>(world_), "an all-gather's buffer or owners");
    require_collectives("an all-gather");
    int64_t event = -1;
    count(kind, CollectiveOp::all_gather, payload_bytes(t, owners), &event);
    shared_->exchange(rank_, t, [&](const std::vector<torch::Tensor>& all) {
      for (int q = 0; q < world_; ++q)
        if (q != rank_)
          for (const Span& s : owners[static_cast<size_t>(q)])
            t.narrow(0, s.offset, s.numel).copy_(all[static_cast<size_t>(q)].narrow(0, s.offset, s.numel));
    });
    finish_event(event);
    return std::make_unique<Done>();
  }

  std::unique_ptr<PendingCollective> reduce_scatter_sum_async(const torch::Tensor& t, const Ownership& owners,
                                                              const torch::Tensor& scratch, CollectiveKind kind) override {
    DS_CHECK(t.is_contiguous() && owners.size() == static_cast<size_t>(world_), "a reduce-scatter's buffer or owners");
    require_collectives("a reduce-scatter");
    int64_t event = -1;
    count(kind, CollectiveOp::reduce_scatter, payload_bytes(t, owners), &event);
    const std::vector<Span>& mine = owners[static_cast<size_t>(rank_)];
    if (capabilities().native_reduce_scatter) {  // as NCCL: no scratch; every rank's contribution summed in rank order
      std::vector<torch::Tensor> sums;
      shared_->exchange(rank_, t, [&](const std::vector<torch::Tensor>& all) {
        for (const Span& s : mine) {
          torch::Tensor sum = all[0].narrow(0, s.offset, s.numel).clone();
          for (int q = 1; q < world_; ++q) sum.add_(all[static_cast<size_t>(q)].narrow(0, s.offset, s.numel));
          sums.push_back(sum);
        }
      });
      for (size_t i = 0; i < mine.size(); ++i) t.narrow(0, mine[i].offset, mine[i].numel).copy_(sums[i]);  // once every rank has read t
      finish_event(event);
      return std::make_unique<Done>();
    }
    // As over Gloo: the others' contributions to this rank's spans land in the scratch, rank after rank.
    shared_->exchange(rank_, t, [&](const std::vector<torch::Tensor>& all) {
      int64_t at = 0;
      for (int q = 0; q < world_; ++q)
        if (q != rank_)
          for (const Span& s : mine) {
            scratch.narrow(0, at, s.numel).copy_(all[static_cast<size_t>(q)].narrow(0, s.offset, s.numel));
            at += s.numel;
          }
    });
    add_received_on_host(t, owners[static_cast<size_t>(rank_)], world_ - 1, scratch);
    finish_event(event);
    return std::make_unique<Done>();
  }

  std::unique_ptr<PendingCollective> send_async(const torch::Tensor& t, int to, CollectiveKind kind) override {
    DS_CHECK(t.is_contiguous() && to >= 0 && to < world_ && to != rank_, "a send of a non-contiguous tensor, or to rank ", to);
    int64_t event = -1;
    count(kind, CollectiveOp::send, static_cast<double>(t.nbytes()), &event);
    shared_->post(rank_, to, t);
    finish_event(event);
    return std::make_unique<Done>();
  }
  void recv(const torch::Tensor& t, int from, CollectiveKind kind) override {
    DS_CHECK(t.is_contiguous() && from >= 0 && from < world_ && from != rank_, "a receive into a non-contiguous tensor, or from rank ", from);
    int64_t event = -1;
    count_received(kind, &event);
    shared_->take(from, rank_, t);
    finish_event(event);
  }

  // The group of some of the thread ranks: its collectives meet in a shared state of their own.
  std::unique_ptr<Communicator> split(const std::string& name, const std::vector<int>& members) override {
    const int place = place_in(name, members);
    return std::make_unique<LocalCommunicator>(place, world_rank_, shared_->group(name, members, place));
  }
  std::unique_ptr<Communicator> split_for_messages(const std::string& name, const std::vector<int>& members) override {
    const int place = place_in(name, members);
    return std::make_unique<LocalCommunicator>(place, world_rank_, shared_->group(name, members, place), /*messages_only=*/true);
  }

  // (a failure that follows another rank's passes its message on as it is: the first failure is the cause)
  void abort(const std::string& reason) override {
    shared_->end(reason.rfind("thread rank ", 0) == 0 ? reason : "thread rank " + std::to_string(world_rank_) + " failed: " + reason);
  }

  CommCapabilities capabilities() const override { return comm_capabilities(shared_->speaks); }
  void barrier() override {
    require_collectives("a barrier");
    shared_->all_reduce(rank_, torch::zeros({1}, torch::kInt32));
  }

 private:
  void require_collectives(const char* what) const {
    DS_CHECK(!messages_only_, "thread rank ", world_rank_, ": ", what, " in a group split for messages only");
  }
  int world_rank_;
  bool messages_only_;
  std::shared_ptr<LocalGroup::Shared> shared_;
};

}  // namespace

LocalGroup::LocalGroup(int world_size, std::chrono::milliseconds timeout, CommBackend speaks) : shared_(std::make_shared<Shared>()) {
  DS_CHECK(world_size >= 1, "world size ", world_size);
  shared_->world = world_size;
  shared_->speaks = speaks;
  shared_->timeout = timeout;
  shared_->inputs.resize(static_cast<size_t>(world_size));
}

LocalGroup::~LocalGroup() = default;

std::unique_ptr<Communicator> LocalGroup::join(int rank) {
  DS_CHECK(rank >= 0 && rank < shared_->world, "rank ", rank, " of ", shared_->world);
  return std::make_unique<LocalCommunicator>(rank, rank, shared_);
}

}  // namespace ds
