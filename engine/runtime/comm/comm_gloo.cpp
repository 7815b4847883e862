#include "engine/runtime/comm/comm.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <memory>
#include <map>

#include "common/error.hpp"
#include "engine/runtime/comm/comm_host.hpp"
#include "engine/runtime/comm/rendezvous.hpp"

namespace ds {

namespace {

// LibTorch 1.13's Gloo has no reduce-scatter, no bf16/fp16 reduction, and an all-gather a third as fast
// as its all-reduce: ds sends the all-gather's and the reduce-scatter's pieces point to point.
class GlooCommunicator : public Communicator {
 public:
  // The world's: rendezvous through the world's store (rendezvous.hpp).
  GlooCommunicator(const Topology& t, std::chrono::milliseconds timeout);
  // A group of the world's ranks, met through `store` (the world's, under the group's prefix); `world_ranks[r]`
  // is this group's rank r in the world, for messages.
  GlooCommunicator(int rank, std::vector<int> world_ranks, std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Store> store,
                   const std::string& name, const GlooCommunicator& world);
  std::unique_ptr<Communicator> split(const std::string& name, const std::vector<int>& members) override;
  std::unique_ptr<PendingCollective> all_reduce_sum_async(const torch::Tensor& t, CollectiveKind kind) override;
  std::unique_ptr<PendingCollective> all_gather_async(const torch::Tensor& t, const Ownership& owners, CollectiveKind kind) override;
  std::unique_ptr<PendingCollective> reduce_scatter_sum_async(const torch::Tensor& t, const Ownership& owners,
                                                              const torch::Tensor& scratch, CollectiveKind kind) override;
  CommCapabilities capabilities() const override { return comm_capabilities(CommBackend::gloo); }
  void barrier() override { group_->barrier()->wait(); }
  void mark_step(int64_t step) override;
  std::unique_ptr<PendingCollective> send_async(const torch::Tensor& t, int to, CollectiveKind kind) override;
  void recv(const torch::Tensor& t, int from, CollectiveKind kind) override;

 private:
  // "rank 1 last reported step 6 (this rank is at step 7)": read from the store after a timeout.
  std::string who_is_behind() const;
  // Gloo's process group over store_ (the constructors' common part); `where` names the rendezvous in an error.
  void join(const std::string& where);
  std::string world_rank(int r) const { return std::to_string(world_ranks_[static_cast<size_t>(r)]); }
  using Works = std::vector<c10::intrusive_ptr<c10d::Work>>;
  // The first of `count` tags for one collective's messages: every rank issues the same collectives in the
  // same order, so the tags agree, and a message never matches another collective's.
  int take_tags(int64_t count);
  // Posts a send to (or a receive from) `peer` of each non-empty span, span j under tag `tag` + j, through
  // the tensor `piece` gives for it.
  void post(Works& works, bool send, const std::vector<Span>& spans, int peer, int tag,
            const std::function<torch::Tensor(const Span&)>& piece);
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
  std::chrono::milliseconds timeout_;
  std::vector<int> world_ranks_;
  // The world's store, where every communicator of a rank (the world's and its groups') reports the step the
  // world is at, keyed by world rank, and reads the others' after a timeout.
  c10::intrusive_ptr<c10d::Store> root_store_;
  std::shared_ptr<int64_t> world_step_ = std::make_shared<int64_t>(-1);
  int64_t next_tag_ = 0;
  // Point to point: the messages sent to and received from each peer so far. A pair's n-th message goes under
  // tag kPointToPointTags + n (wrapping), above the collectives' tags: the pair's order alone matches them.
  static constexpr int64_t kPointToPointTags = int64_t{1} << 30;
  int p2p_tag(std::map<int, int64_t>& counts, int peer) {
    return static_cast<int>(kPointToPointTags + (counts[peer]++ % kPointToPointTags));
  }
  std::map<int, int64_t> sent_to_, received_from_;
};

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(const Topology& t, std::chrono::milliseconds timeout) {
  return std::make_unique<GlooCommunicator>(t, timeout);
}

GlooCommunicator::GlooCommunicator(const Topology& t, std::chrono::milliseconds timeout)
    : Communicator(t.rank, t.world_size), timeout_(timeout) {
  for (int r = 0; r < t.world_size; ++r) world_ranks_.push_back(r);
  store_ = open_world_store(t, timeout);
  root_store_ = store_;
  join("the group at " + t.master_addr + ":" + std::to_string(t.master_port));
}

GlooCommunicator::GlooCommunicator(int rank, std::vector<int> world_ranks, std::chrono::milliseconds timeout,
                                   c10::intrusive_ptr<c10d::Store> store, const std::string& name, const GlooCommunicator& world)
    : Communicator(rank, static_cast<int>(world_ranks.size())), store_(std::move(store)), timeout_(timeout),
      world_ranks_(std::move(world_ranks)), root_store_(world.root_store_), world_step_(world.world_step_) {
  join("group " + name);
}

void GlooCommunicator::join(const std::string& where) {
  try {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout_);
    // GLOO_SOCKET_IFNAME picks the network interface, as torch.distributed does; by default Gloo uses
    // the address this host's name resolves to.
    const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
    options->devices.push_back(ifname && *ifname ? c10d::ProcessGroupGloo::createDeviceForInterface(ifname)
                                                 : c10d::ProcessGroupGloo::createDefaultDevice());
    group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank_, world_, options);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw std::runtime_error("rank " + world_rank(rank_) + " could not join " + where + " within " +
                             std::to_string(timeout_.count() / 1000) + " s: " + what.substr(0, what.find('\n')));
  }
}

std::unique_ptr<Communicator> GlooCommunicator::split(const std::string& name, const std::vector<int>& members) {
  const int place = place_in(name, members);
  std::vector<int> world_ranks;
  for (const int m : members) world_ranks.push_back(world_ranks_[static_cast<size_t>(m)]);
  // The group meets under its name's keys in the world's store: its sockets are its own, its rendezvous the world's.
  auto store = c10::make_intrusive<c10d::PrefixStore>("ds/group/" + name, store_);
  return std::make_unique<GlooCommunicator>(place, std::move(world_ranks), timeout_, std::move(store), name, *this);
}

namespace {
class GlooWork : public PendingCollective {
 public:
  // `then` runs once the collective is done (an fp32 copy written back into a 16-bit tensor). The
  // ledger's seconds are the time this rank was held up: issuing (from `start`) and waiting, not the
  // time the collective ran beside compute. `explain` says who is missing when the wait fails.
  // `works`: the collective, or a point-to-point collective's sends and receives.
  GlooWork(std::vector<c10::intrusive_ptr<c10d::Work>> works, CommStats& stats, std::chrono::steady_clock::time_point start,
           std::function<std::string()> explain, std::function<void()> then = {}, std::function<void()> finished = {})
      : works_(std::move(works)), stats_(stats), explain_(std::move(explain)), then_(std::move(then)), finished_(std::move(finished)) {
    stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  // Never leaves Gloo reading or writing freed memory: each piece is waited for, except that after one
  // fails the rest are aborted rather than waited for a timeout each.
  ~GlooWork() override {
    bool failed = false;
    for (auto& w : works_) {
      if (failed) {
        abort_quietly(*w);
        continue;
      }
      try {
        w->wait();
      } catch (...) {
        failed = true;
      }
    }
  }
  void wait() override {
    if (done_) return;
    done_ = true;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      while (!works_.empty()) {
        works_.back()->wait();
        works_.pop_back();
      }
    } catch (const std::exception& e) {
      for (auto& w : works_) abort_quietly(*w);
      works_.clear();
      const std::string what = e.what();
      throw std::runtime_error("a collective failed: " + explain_() + " (" + what.substr(0, what.find('\n')) + ")");
    }
    if (then_) then_();
    then_ = nullptr;  // what it held (an fp32 copy) goes now, not when the caller drops this
    stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (finished_) finished_();
  }

 private:
  static void abort_quietly(c10d::Work& w) {
    try {
      w.abort();
    } catch (...) {
    }
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  bool done_ = false;
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
  Works works{group_->allreduce(buf)};
  int64_t event = -1;
  CommStats& s = count(kind, CollectiveOp::all_reduce, static_cast<double>(buf[0].nbytes()), &event);
  std::function<void()> then;
  if (narrow) then = [t, wide = buf[0]] { t.copy_(wide); };
  return std::make_unique<GlooWork>(std::move(works), s, t0, [this] { return who_is_behind(); }, std::move(then),
                                    [this, event] { finish_event(event); });
}

int GlooCommunicator::take_tags(int64_t count) {
  if (next_tag_ + count > (int64_t{1} << 30)) next_tag_ = 0;  // Gloo's tags are non-negative ints
  const int first = static_cast<int>(next_tag_);
  next_tag_ += std::max<int64_t>(1, count);
  return first;
}

void GlooCommunicator::post(Works& works, bool send, const std::vector<Span>& spans, int peer, int tag,
                             const std::function<torch::Tensor(const Span&)>& piece) {
  for (size_t j = 0; j < spans.size(); ++j) {
    if (spans[j].numel == 0) continue;
    std::vector<torch::Tensor> one{piece(spans[j])};
    works.push_back(send ? group_->send(one, peer, tag + static_cast<int>(j)) : group_->recv(one, peer, tag + static_cast<int>(j)));
  }
}

namespace {
int64_t most_spans(const Ownership& owners) {
  size_t n = 0;
  for (const auto& spans : owners) n = std::max(n, spans.size());
  return static_cast<int64_t>(n);
}
}  // namespace

std::unique_ptr<PendingCollective> GlooCommunicator::all_gather_async(const torch::Tensor& t, const Ownership& owners,
                                                                      CollectiveKind kind) {
  const auto t0 = std::chrono::steady_clock::now();
  DS_CHECK(t.is_contiguous() && t.dim() == 1 && owners.size() == static_cast<size_t>(world_), "an all-gather's buffer or owners");
  const int tag = take_tags(most_spans(owners));
  // Bytes as they are: any dtype travels, no sum.
  const torch::Tensor bytes = torch::from_blob(t.data_ptr(), {static_cast<int64_t>(t.nbytes())}, torch::kUInt8);
  const int64_t width = t.element_size();
  const auto piece = [&](const Span& s) { return bytes.narrow(0, s.offset * width, s.numel * width); };
  Works works;
  for (int q = 0; q < world_; ++q) {
    if (q == rank_) continue;
    post(works, /*send=*/true, owners[static_cast<size_t>(rank_)], q, tag, piece);
    post(works, /*send=*/false, owners[static_cast<size_t>(q)], q, tag, piece);
  }
  int64_t event = -1;
  CommStats& s = count(kind, CollectiveOp::all_gather, payload_bytes(t, owners), &event);
  return std::make_unique<GlooWork>(std::move(works), s, t0, [this] { return who_is_behind(); }, std::function<void()>(),
                                    [this, event] { finish_event(event); });
}

std::unique_ptr<PendingCollective> GlooCommunicator::reduce_scatter_sum_async(const torch::Tensor& t, const Ownership& owners,
                                                                              const torch::Tensor& scratch, CollectiveKind kind) {
  const auto t0 = std::chrono::steady_clock::now();
  DS_CHECK(t.is_contiguous() && t.dim() == 1 && owners.size() == static_cast<size_t>(world_), "a reduce-scatter's buffer or owners");
  const auto& mine = owners[static_cast<size_t>(rank_)];
  const int64_t total = span_elements(mine);
  DS_CHECK(scratch.is_contiguous() && scratch.scalar_type() == t.scalar_type() && scratch.numel() >= total * (world_ - 1),
           "a reduce-scatter's scratch is too small");
  const int tag = take_tags(most_spans(owners));
  Works works;
  int64_t at = 0;  // the scratch, peer after peer
  for (int q = 0; q < world_; ++q) {
    if (q == rank_) continue;
    // Rank q's elements of this rank's contribution go to q; q's contribution to this rank's elements
    // lands in the scratch.
    post(works, /*send=*/true, owners[static_cast<size_t>(q)], q, tag, [&](const Span& sp) { return t.narrow(0, sp.offset, sp.numel); });
    post(works, /*send=*/false, mine, q, tag, [&](const Span& sp) {
      const torch::Tensor into = scratch.narrow(0, at, sp.numel);
      at += sp.numel;
      return into;
    });
  }
  int64_t event = -1;
  CommStats& s = count(kind, CollectiveOp::reduce_scatter, payload_bytes(t, owners), &event);
  return std::make_unique<GlooWork>(std::move(works), s, t0, [this] { return who_is_behind(); },
                                    [this, t, owners, scratch] { add_received_on_host(t, owners[static_cast<size_t>(rank_)], world_ - 1, scratch); },
                                    [this, event] { finish_event(event); });
}

std::unique_ptr<PendingCollective> GlooCommunicator::send_async(const torch::Tensor& t, int to, CollectiveKind kind) {
  const auto t0 = std::chrono::steady_clock::now();
  DS_CHECK(t.is_contiguous() && to >= 0 && to < world_ && to != rank_, "a send of a non-contiguous tensor, or to rank ", to);
  std::vector<torch::Tensor> one{t};
  Works works{group_->send(one, to, p2p_tag(sent_to_, to))};
  int64_t event = -1;
  CommStats& s = count(kind, CollectiveOp::send, static_cast<double>(t.nbytes()), &event);
  return std::make_unique<GlooWork>(std::move(works), s, t0, [this] { return who_is_behind(); }, std::function<void()>(),
                                    [this, event] { finish_event(event); });
}

void GlooCommunicator::recv(const torch::Tensor& t, int from, CollectiveKind kind) {
  const auto t0 = std::chrono::steady_clock::now();
  DS_CHECK(t.is_contiguous() && from >= 0 && from < world_ && from != rank_, "a receive into a non-contiguous tensor, or from rank ", from);
  std::vector<torch::Tensor> one{t};
  int64_t event = -1;
  CommStats& s = count_received(kind, &event);
  GlooWork work({group_->recv(one, from, p2p_tag(received_from_, from))}, s, t0, [this] { return who_is_behind(); },
                std::function<void()>(), [this, event] { finish_event(event); });
  work.wait();
}

namespace {
std::string step_key(int rank) { return "ds/step/" + std::to_string(rank); }
}  // namespace

void GlooCommunicator::mark_step(int64_t step) {
  step_ = step;
  *world_step_ = step;
  const std::string v = std::to_string(step);
  try {
    root_store_->set(step_key(world_ranks_[static_cast<size_t>(rank_)]), std::vector<uint8_t>(v.begin(), v.end()));
  } catch (const std::exception&) {
    // The store's host is gone: the next collective fails and says so.
  }
}

std::string GlooCommunicator::who_is_behind() const {
  // The step the world is at (a group's own collectives never mark one) and each peer's report, by world rank.
  const int64_t at = *world_step_;
  std::string behind, same;
  const std::chrono::milliseconds saved = root_store_->getTimeout();
  try {
    root_store_->setTimeout(std::chrono::seconds(3));  // a diagnosis, not another long wait
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      const std::string key = step_key(world_ranks_[static_cast<size_t>(r)]);
      if (!root_store_->check({key})) {
        behind += (behind.empty() ? "" : ", ") + std::string("rank ") + world_rank(r) + " never reported a step";
        continue;
      }
      const std::vector<uint8_t> v = root_store_->get(key);
      const int64_t step = std::stoll(std::string(v.begin(), v.end()));
      if (step < at)
        behind += (behind.empty() ? "" : ", ") + std::string("rank ") + world_rank(r) + " last reported step " +
                  std::to_string(step + 1);
      else
        same += (same.empty() ? "" : ", ") + world_rank(r);
    }
    root_store_->setTimeout(saved);
  } catch (const std::exception&) {
    return "rank " + world_rank(rank_) + " waited in vain, and rank 0 (which hosts the rendezvous store) did not answer either";
  }
  if (!behind.empty()) return behind + " while rank " + world_rank(rank_) + " waited at step " + std::to_string(at + 1);
  const bool one = same.find(',') == std::string::npos;
  return "rank " + world_rank(rank_) + " waited in vain at step " + std::to_string(at + 1) +
         (same.empty() ? std::string()
                       : one ? "; rank " + same + " reached that step too and stopped within it"
                             : "; ranks " + same + " reached that step too, so one of them stopped within it");
}

}  // namespace ds
