#include "engine/runtime/comm/comm.hpp"

#include "common/error.hpp"

namespace ds {

std::unique_ptr<Communicator> make_gloo_communicator(const Topology& t, std::chrono::milliseconds timeout);  // comm_gloo.cpp
std::unique_ptr<Communicator> make_nccl_communicator(const Topology& t, std::chrono::milliseconds timeout);  // comm_nccl.cpp

std::unique_ptr<Communicator> Communicator::create(CommBackend backend, const Topology& t, std::chrono::milliseconds timeout) {
  if (t.master_addr.empty() || t.master_port == 0)
    throw UserError(std::string(t.master_addr.empty() ? "MASTER_ADDR" : "MASTER_PORT") + " is not set, but the world size is above 1",
                    "start ranks with `ds train --nproc-per-node N`, torchrun --no-python, or set RANK, WORLD_SIZE, "
                    "MASTER_ADDR and MASTER_PORT yourself");
  std::unique_ptr<Communicator> c;
  switch (backend) {
    case CommBackend::gloo: c = make_gloo_communicator(t, timeout); break;
    case CommBackend::nccl:
#ifdef DS_WITH_NCCL_COMMUNICATOR
      c = make_nccl_communicator(t, timeout);
#endif
      break;
  }
  if (c) {
    DS_CHECK(c->capabilities() == comm_capabilities(backend), "the ", comm_backend_name(backend), " communicator does not do what the plan assumed of it");
    return c;
  }
  throw UserError(std::string("this build of ds has no ") + comm_backend_name(backend) + " communicator",
                  "GPU ranks need the CUDA build (see the README); CPU ranks use gloo");
}

CommStats& Communicator::count_received(CollectiveKind kind, int64_t* event) {
  CommStats& s = ledger_[kind];
  if (s.op.empty()) s.op = collective_op_name(CollectiveOp::send);
  *event = -1;
  if (recording_) {
    const auto now = std::chrono::steady_clock::now();
    *event = next_event_++;
    events_.emplace(*event, Event{kind, now, now, 0.0, true});
  }
  return s;
}

int Communicator::place_in(const std::string& name, const std::vector<int>& members) {
  int place = -1;
  std::vector<bool> seen(static_cast<size_t>(world_), false);
  for (size_t i = 0; i < members.size(); ++i) {
    const int r = members[i];
    DS_CHECK(r >= 0 && r < world_ && !seen[static_cast<size_t>(r)], "group ", name, ": rank ", r,
             " is out of the world's ", world_, " ranks or listed twice");
    seen[static_cast<size_t>(r)] = true;
    if (r == rank_) place = static_cast<int>(i);
  }
  DS_CHECK(place >= 0, "group ", name, ": rank ", rank_, " is not among its members");
  // A group's rendezvous keys stay in the store (the threads' meeting in memory): a second group of the same name
  // would meet the first one's.
  DS_CHECK(group_names_.insert(name).second, "group ", name, " was formed already: each group needs a name of its own");
  return place;
}

std::vector<Communicator::Event> Communicator::take_events() {
  stamp_timed_events();
  std::vector<Event> out;
  for (auto it = events_.begin(); it != events_.end();)
    if (it->second.finished) {
      out.push_back(it->second);
      it = events_.erase(it);
    } else {
      ++it;
    }
  return out;
}

CommStats& Communicator::count(CollectiveKind kind, CollectiveOp op, double payload_bytes, int64_t* event) {
  CommStats& s = ledger_[kind];
  s.op = collective_op_name(op);
  ++s.calls;
  const double wire = wire_bytes_per_rank(op, payload_bytes, world_);
  s.bytes += wire;
  *event = -1;
  if (recording_) {
    const auto now = std::chrono::steady_clock::now();
    *event = next_event_++;
    events_.emplace(*event, Event{kind, now, now, wire});
  }
  return s;
}

double Communicator::payload_bytes(const torch::Tensor& t, const Ownership& owners) {
  int64_t n = 0;
  for (const auto& spans : owners) n += span_elements(spans);
  return static_cast<double>(n * static_cast<int64_t>(t.element_size()));
}

}  // namespace ds
