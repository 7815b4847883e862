#include "engine/runtime/run/zero.hpp"

#include <algorithm>

#include "common/error.hpp"
#include "engine/runtime/device/kernel_route.hpp"

namespace ds {

struct ZeroExchange::Gather {
  const Partitioned* from = nullptr;
  std::unique_ptr<PendingCollective> work;
  torch::Tensor out;  // staged: every rank's partitions packed, one rank after another; else the destination
  Ownership owners;   // each rank's spans of `out`
  std::vector<int> params;
  CollectiveKind what = CollectiveKind::parameters_forward;
  torch::Tensor dest;
  const std::vector<int64_t>* offsets = nullptr;
  int64_t n = 0;  // elements each rank sends
  int64_t layer = -1;  // the block it gathers, or -1
  bool reading = false;  // NVMe: this rank's partitions are still being read; the collective waits for them
  // One rank's partitions copied from host memory ahead (Device::copy_ahead): the compute stream waits for the last
  // copy as the gather finishes, so a GPU runs the current block beside the next block's copies.
  std::shared_ptr<Event> arrived;
};

struct ZeroExchange::Reduce {
  std::vector<std::unique_ptr<PendingCollective>> pieces;
  const ParamGroup* group = nullptr;
  torch::Tensor buf;
  // One rank whose gradients leave for the host: the compute stream just after the group's backward, which its copy
  // out waits for (not for the blocks' backward queued since, which it runs beside).
  std::shared_ptr<Event> written;
  // A block's gradients landing a block late or more (gradient_lag): the arrival buffer they land in whole, and the
  // event the copy stream to the host recorded after their copy.
  torch::Tensor landing;
  std::shared_ptr<Event> landed;
  bool released = false;  // buf zeroed for the next block that writes it
};

ZeroExchange::ZeroExchange(const Plan& plan, FlatParams& flat, Communicator* comm, ParamSwapper* param_swap)
    : plan_(plan),
      flat_(flat),
      comm_(comm),
      param_swap_(param_swap),
      stage3_(plan.execution.gathers),
      native_scatter_(comm_capabilities(plan.execution.backend).native_reduce_scatter),
      scatter_shards_(plan.execution.sharded && plan.execution.scatter && !plan.execution.grouped) {
  DS_CHECK(!param_swap || stage3_, "parameters on NVMe outside stage 3");
  // (a block's arrival buffer is taken again only once the reduce that used it has been summed)
  DS_CHECK(flat.block_arrivals.empty() || static_cast<int64_t>(flat.block_arrivals.size()) > plan.execution.gradient_lag,
           flat.block_arrivals.size(), " block arrival buffers for a gradient lag of ", plan.execution.gradient_lag);
  DS_CHECK(!comm || comm->capabilities() == comm_capabilities(plan.execution.backend), "a communicator that does not do what the plan (",
           comm_backend_name(plan.execution.backend), ") assumed of it");
  const FlatLayout& L = plan.layout;
  groups_ = parameter_groups(L);
  owned_of_param_.assign(L.params.size(), -1);
  for (size_t i = 0; i < flat.owned.size(); ++i) owned_of_param_[static_cast<size_t>(flat.owned[i].param)] = static_cast<int>(i);
  summed_.assign(flat.owned.size(), 0);
  if (plan.execution.grouped && plan.execution.scatter) group_owners_ = group_ownerships(L, groups_, flat.group_offset);
  for (const ShardRange& r : L.shards) shard_owners_.push_back({{r.begin, r.numel()}});
  if (comm_ && plan.execution.overlap && !plan.execution.grouped) block_ranges_ = block_ranges(L);
  group_of_block_.assign(static_cast<size_t>(std::max<int64_t>(0, plan.model.hp.num_layers)), -1);
  range_of_block_ = group_of_block_;
  int ranges = 0;  // block_ranges lists the blocks that have parameters, in order
  for (size_t k = 0; k < groups_.size(); ++k)
    if (const int layer = groups_[k].layer; layer >= 0 && layer < static_cast<int>(group_of_block_.size())) {
      group_of_block_[static_cast<size_t>(layer)] = static_cast<int>(k);
      range_of_block_[static_cast<size_t>(layer)] = ranges++;
    }
  gather_ahead_ = plan.execution.gather_ahead;
  DS_CHECK(!gather_ahead_ || (comm_ && hooks_blocks()), "the plan gathers the updated parameters ahead without the ranks or the block hooks that wait for them");
  if (gather_ahead_) {
    const std::vector<std::pair<int64_t, int64_t>> ranges = block_ranges(L);
    front_end_ = ranges.front().first;
    block_end_.assign(group_of_block_.size(), 0);
    for (size_t l = 0; l < block_end_.size(); ++l)
      if (const int k = range_of_block_[l]; k >= 0) block_end_[l] = ranges[static_cast<size_t>(k)].second;
  }
  if (!stage3_) return;
  const auto layers = static_cast<size_t>(plan.model.hp.num_layers);
  trained_.layout = &L;
  trained_.partitions = flat.params;
  trained_.on_nvme = param_swap != nullptr;
  const auto place_of = [&](BufferRole role) {
    const ZeroBuffer* b = plan.execution.find_anywhere(role);
    return b ? b->place : Place::device;
  };
  trained_.place = place_of(BufferRole::params);
  trained_.staged = plan.execution.gather_staged;
  trained_.block_offset = &flat.group_offset;
  trained_.per_block.resize(layers);
  for (int i = 0; i < 2; ++i) {
    trained_.staging[i] = flat.gather_staging[i];
    trained_.blocks[i] = flat.block_params[i];
  }
  for (const ParamGroup& g : groups_) {
    std::vector<int> gathered;
    for (int i : g.params)
      if (flat.whole_offset[static_cast<size_t>(i)] < 0)
        gathered.push_back(i);
      else
        whole_.push_back(i);
    if (g.layer >= 0)
      trained_.per_block[static_cast<size_t>(g.layer)] = std::move(gathered);
    else if (&g == &groups_.back())  // groups of blocks with nothing that trains (model.freeze) have layer -1 too
      outer_ = std::move(gathered);
  }
  const ZeroExecution& z = plan.execution;
  frozen_.layout = &z.frozen_layout;
  frozen_.partitions = flat.frozen_partitions;
  frozen_.place = place_of(BufferRole::frozen_partitions);
  frozen_.staged = z.frozen_staged;
  frozen_.block_offset = &z.frozen_group_offset;
  frozen_.per_block.resize(layers);
  for (int i = 0; i < 2; ++i) {
    frozen_.staging[i] = flat.frozen_staging[i];
    frozen_.blocks[i] = flat.frozen_block_params[i];
  }
  for (size_t k = 0; k < z.frozen_layout.params.size(); ++k)
    frozen_.per_block[static_cast<size_t>(z.frozen_layout.params[k].layer)].push_back(static_cast<int>(k));
}

// A reduce or gather still in flight is waited for by its PendingCollective; a block's copy to the host (left after an
// error) by its event, before the buffers it reads and writes are freed.
ZeroExchange::~ZeroExchange() {
  for (const auto& r : reducing_) {
    try {
      if (r->landed) r->landed->wait();
    } catch (...) {  // (the device's error was reported where it happened)
    }
  }
}

namespace {
// A gradient piece reduced in communication_data_type's dtype: `wire` (the piece cast to it) is what the
// collective sums; waiting writes this rank's sums back into the piece, in the gradients' dtype (the rest of
// the piece, summed by other ranks, is left as a reduce-scatter leaves it).
class ReducedInWireDtype final : public PendingCollective {
 public:
  ReducedInWireDtype(torch::Tensor piece, torch::Tensor wire, std::vector<Span> mine)
      : piece_(std::move(piece)), wire_(std::move(wire)), mine_(std::move(mine)) {}
  const torch::Tensor& wire() const { return wire_; }
  void start(std::unique_ptr<PendingCollective> work) { work_ = std::move(work); }
  // Frees the cast once its sums are back, so a caller keeping waited pieces holds no more than the plan's reduce_cast
  // (on a GPU the compute stream already waits for the collective: the copy back and the free are ordered after it).
  void wait() override {
    if (!work_) return;
    const std::unique_ptr<PendingCollective> work = std::move(work_);  // a failed wait is not waited on again
    work->wait();
    for (const Span& s : mine_) piece_.narrow(0, s.offset, s.numel).copy_(wire_.narrow(0, s.offset, s.numel));
    wire_ = piece_ = torch::Tensor();
  }

 private:
  torch::Tensor piece_, wire_;  // declared before work_: a collective dropped unwaited finishes before wire_ goes
  std::vector<Span> mine_;
  std::unique_ptr<PendingCollective> work_;
};
}  // namespace

std::vector<std::unique_ptr<PendingCollective>> ZeroExchange::reduce_in_pieces(const torch::Tensor& t, const Ownership* owners,
                                                                              bool wait_each) {
  std::vector<std::unique_ptr<PendingCollective>> pieces;
  if (!comm_) return pieces;  // one rank: the sum over ranks is the gradient itself
  const torch::ScalarType wire = to_torch(plan_.execution.wire_dtype);
  int64_t received = 0;  // scratch elements the pieces in flight take
  for (const auto& [at, end] : bucket_pieces(t.numel(), plan_.zero.reduce_bucket_size)) {
    const int64_t n = end - at;
    const torch::Tensor held = t.narrow(0, at, n);
    const Ownership part = owners ? clip(*owners, at, n) : Ownership{};
    // communication_data_type: the piece crosses ranks cast to it (the plan's reduce_cast).
    std::unique_ptr<ReducedInWireDtype> cast;
    if (plan_.execution.wire_dtype != plan_.execution.reduced_dtype) {
      DS_CHECK(held.scalar_type() == to_torch(plan_.execution.reduced_dtype), "gradients held in ", held.scalar_type(), ", not the plan's ",
               dtype_name(plan_.execution.reduced_dtype));
      std::vector<Span> mine = owners ? part[static_cast<size_t>(flat_.rank)] : std::vector<Span>{{0, n}};
      cast = std::make_unique<ReducedInWireDtype>(held, held.to(wire), std::move(mine));
    }
    const torch::Tensor& sent = cast ? cast->wire() : held;
    std::unique_ptr<PendingCollective> work;
    if (owners) {
      // A library's own reduce-scatter (NCCL) needs no room for the others' contributions (the plan allots none).
      const int64_t need = native_scatter_ ? 0 : span_elements(part[static_cast<size_t>(flat_.rank)]) * (comm_->world_size() - 1);
      if (wait_each) received = 0;
      work = comm_->reduce_scatter_sum_async(sent, part, native_scatter_ ? torch::Tensor() : flat_.reduce_scratch.narrow(0, received, need),
                                             CollectiveKind::gradients);
      received += need;
    } else {
      work = comm_->all_reduce_sum_async(sent, CollectiveKind::gradients);
    }
    if (cast) {
      cast->start(std::move(work));
      work = std::move(cast);
    }
    pieces.push_back(std::move(work));
    if (wait_each) pieces.back()->wait();  // one piece (and its fp32 copy, cast or scratch) at a time
  }
  return pieces;
}

std::vector<std::unique_ptr<PendingCollective>> ZeroExchange::reduce_range(int64_t at, int64_t n, bool wait_each) {
  const torch::Tensor range = flat_.compute_grads.narrow(0, at, n);
  if (!scatter_shards_) return reduce_in_pieces(range, nullptr, wait_each);
  const Ownership owners = clip(shard_owners_, at, n);
  return reduce_in_pieces(range, &owners, wait_each);
}

void ZeroExchange::add_micro_gradients(int64_t at, int64_t n) {
  if (n <= 0) return;
  torch::NoGradGuard ng;
  const torch::Tensor micro = flat_.micro_grads.narrow(0, at, n);
  flat_.compute_grads.narrow(0, at, n).add_(micro);
  micro.zero_();
}

void ZeroExchange::reduce_gradients() {
  if (flat_.grouped) return finish_reduces(0);
  if (!comm_) return;
  // Stage 0 reduces what the model has (the real elements); stage 1 the padded buffer its shards divide.
  const torch::Tensor& all = flat_.compute_grads;
  if (!reducing_blocks_) {
    reduce_range(0, all.numel(), /*wait_each=*/true);
    return;
  }
  // The blocks' ranges are in flight since their backward ended: the parameters before and after them follow.
  reducing_blocks_ = false;
  const int64_t head = block_ranges_.front().first, tail = block_ranges_.back().second;
  for (auto& p : reduce_range(0, head, /*wait_each=*/false)) block_reduces_.push_back(std::move(p));
  for (auto& p : reduce_range(tail, all.numel() - tail, /*wait_each=*/false)) block_reduces_.push_back(std::move(p));
  for (auto& p : block_reduces_) p->wait();
  block_reduces_.clear();
}

bool ZeroExchange::sums_on_host() const { return flat_.grouped && flat_.grads_place != Place::device; }

void ZeroExchange::begin_gradient_sums() {
  torch::NoGradGuard ng;
  if (!sums_on_host()) {
    flat_.compute_grads.zero_();  // grouped stages: this rank's part (the group buffers are zeroed as reduced)
    return;
  }
  summed_.assign(flat_.owned.size(), 0);
}

void ZeroExchange::end_gradient_sums() {
  if (!sums_on_host()) return;
  torch::NoGradGuard ng;
  const torch::Tensor& all = flat_.compute_grads;
  // Owned segments in local order; zero what lies between the summed ones, and after the last.
  int64_t at = 0;
  for (size_t k = 0; k < flat_.owned.size(); ++k) {
    const OwnedSegment& s = flat_.owned[k];
    if (!summed_[k]) continue;
    DS_CHECK(s.local >= at, "owned segments out of local order at ", s.local);
    if (s.local > at) all.narrow(0, at, s.local - at).zero_();
    at = s.local + s.numel;
  }
  if (all.numel() > at) all.narrow(0, at, all.numel() - at).zero_();
}

double ZeroExchange::grad_sum_of_squares(bool* partial) const {
  *partial = comm_ && plan_.execution.sharded;
  const torch::Tensor& g = flat_.local_grads;
  return flat_.device->kernels(flat_.grads_place).sum_of_squares(g.data_ptr(), grad_elements_of(g), g.numel());
}

void ZeroExchange::grad_sum_of_squares_to(double* out, bool* partial) const {
  *partial = comm_ && plan_.execution.sharded;
  const torch::Tensor& g = flat_.local_grads;
  flat_.device->kernels(flat_.grads_place).sum_of_squares_to(g.data_ptr(), grad_elements_of(g), g.numel(), out);
}

double ZeroExchange::grad_sum_of_squares_of(const std::vector<uint8_t>& counted) const {
  const KernelTable& k = flat_.device->kernels(flat_.grads_place);
  const torch::Tensor& g = flat_.local_grads;
  const GradElements e = grad_elements_of(g);
  double sum = 0;
  for (const OwnedSegment& s : flat_.owned)
    if (counted[static_cast<size_t>(s.param)] && s.numel > 0) sum += k.sum_of_squares(element_at(g.data_ptr(), e, s.local), e, s.numel);
  return sum;
}

void ZeroExchange::sum_over_partitions(double* values, size_t n) const {
  if (!comm_ || !plan_.execution.sharded) return;
  comm_->all_reduce_sum(torch::from_blob(values, {static_cast<int64_t>(n)}, torch::kFloat64), CollectiveKind::lamb_norms);
}

void ZeroExchange::start_reduce(const ParamGroup& g, const torch::Tensor& buf) {
  // (recorded first: the group's gradients are queued now, whatever finishing earlier reduces waits for)
  std::shared_ptr<Event> written = !comm_ && flat_.grads_place != Place::device ? flat_.device->compute_stream().record() : nullptr;
  // A block's gradients landing late (gradient_lag): those of the block `lag` + 1 above it are summed now, which frees
  // their arrival buffer for this block's to start for the host at once (on the copy stream to the host, behind no
  // weights coming in), and only then does that block's hook step its tiles. Else one reduce at a time: Gloo runs them
  // in order anyway, and the previous buffer is free again.
  const bool lands = written && g.layer >= 0 && !flat_.block_arrivals.empty();
  std::vector<std::unique_ptr<Reduce>> summed;
  for (; lands && reducing_.size() > static_cast<size_t>(plan_.execution.gradient_lag); reducing_.pop_front()) {
    sum_reduce(*reducing_.front());
    summed.push_back(std::move(reducing_.front()));
  }
  if (!lands) finish_reduces(0);
  auto r = std::make_unique<Reduce>();
  r->written = std::move(written);
  r->group = &g;
  r->buf = buf;
  if (lands) {
    r->landing = flat_.block_arrivals[next_arrival_++ % flat_.block_arrivals.size()].narrow(0, 0, buf.numel());
    r->landed = flat_.device->copy_ahead(r->landing, flat_.grads_place, buf, Place::device, *r->written);
  }
  const Ownership* owners = group_owners_.empty() ? nullptr : &group_owners_[static_cast<size_t>(&g - groups_.data())];
  r->pieces = reduce_in_pieces(buf, owners, /*wait_each=*/!flat_.overlap);
  reducing_.push_back(std::move(r));
  // The block below writes the buffer the block above this one used: its copy must have left it.
  for (size_t i = 0; i + 1 < reducing_.size(); ++i) release(*reducing_[i]);
  for (const auto& s : summed) final_hook(*s);
  if (!flat_.overlap) finish_reduces(0);
}

void ZeroExchange::finish_reduces(size_t keep) {
  while (reducing_.size() > keep) {
    const std::unique_ptr<Reduce> r = std::move(reducing_.front());
    reducing_.pop_front();
    sum_reduce(*r);
    final_hook(*r);
  }
}

void ZeroExchange::release(Reduce& r) {
  if (r.released) return;
  if (r.landed) flat_.device->compute_stream().wait_for(*r.landed);
  torch::NoGradGuard ng;
  r.buf.zero_();
  r.released = true;
}

void ZeroExchange::sum_reduce(Reduce& r) {
  const auto arrive = [&] {
    for (auto& p : r.pieces) p->wait();
    if (r.landed) r.landed->wait();  // (the host reads what landed next)
  };
  if (flat_.grads_place == Place::device || !host_work_.on) {  // (no clock read unless a profile keeps the spans)
    arrive();
    add_reduced(r);
  } else {
    // The host's offload work, each part under its row: its wait for a copy that left ahead (the collectives' waits
    // are communication), then the sum, less the copies it makes itself where none left ahead (one row's span after
    // the other's, their times measured apart).
    const int64_t block = r.group->layer;
    if (r.landed) host_work_.time("gradients to the host", block, arrive);
    else arrive();
    std::optional<HostWorkLog::Clock::duration> copying;  // (set where it copied)
    const HostWorkLog::Clock::time_point begin = HostWorkLog::Clock::now();
    add_reduced(r, &copying);
    const HostWorkLog::Clock::time_point end = HostWorkLog::Clock::now();
    if (copying) host_work_.add("gradients to the host", block, begin, begin + *copying);
    host_work_.add("gradients summed on the host", block, begin + copying.value_or(HostWorkLog::Clock::duration{}), end);
  }
  release(r);
}

void ZeroExchange::add_reduced(Reduce& r, std::optional<HostWorkLog::Clock::duration>* copying) {
  const ParamGroup& g = *r.group;
  torch::NoGradGuard ng;
  // This rank's part, summed over the ranks, into its reduced gradients (after an all-reduce: its part of the
  // whole); where those live on the host, the part leaves the device through a counted copy first (or has landed).
  for (int i : g.params) {
    const int k = owned_of_param_[static_cast<size_t>(i)];
    if (k < 0) continue;
    const OwnedSegment& s = flat_.owned[static_cast<size_t>(k)];
    const ParamSlot& p = plan_.layout.params[static_cast<size_t>(i)];
    const int64_t at = flat_.group_offset[static_cast<size_t>(i)] + (s.global - p.offset);
    const torch::Tensor into = flat_.local_grads.narrow(0, s.local, s.numel);
    if (flat_.grads_place == Place::device) {
      into.add_(r.buf.narrow(0, at, s.numel));
      continue;
    }
    torch::Tensor arrived;
    if (r.landing.defined()) {
      arrived = r.landing.narrow(0, at, s.numel);
    } else {
      DS_CHECK(flat_.grads_arrival.defined() && flat_.grads_arrival.numel() >= s.numel, "no arrival buffer for ", s.numel, " gradients");
      arrived = flat_.grads_arrival.narrow(0, 0, s.numel);  // (page-locked; the copy ends before the add)
      // (one rank: after the group's backward only, so a GPU runs the next block's beside it; else after the collective)
      const HostWorkLog::Clock::time_point t0 = copying ? HostWorkLog::Clock::now() : HostWorkLog::Clock::time_point{};
      if (r.written)
        flat_.device->copy(arrived, flat_.grads_place, r.buf.narrow(0, at, s.numel), Place::device, *r.written);
      else
        flat_.device->copy(arrived, flat_.grads_place, r.buf.narrow(0, at, s.numel), Place::device);
      if (copying) *copying = copying->value_or(HostWorkLog::Clock::duration{}) + (HostWorkLog::Clock::now() - t0);
    }
    uint8_t& summed = summed_[static_cast<size_t>(k)];
    if (summed) into.add_(arrived);
    else into.copy_(arrived);  // the step's first: 0 + x is x (widened exactly; a -0 stays -0), without zeroing the sum first
    summed = 1;
  }
}

void ZeroExchange::final_hook(const Reduce& r) {
  if (last_backward_ && on_final_ && r.group->layer >= 0 && sums_on_host())
    on_final_(r.group->layer, r.written ? *r.written : *flat_.device->compute_stream().record());
}

std::unique_ptr<ZeroExchange::Gather> ZeroExchange::start_gather(Partitioned& from, const std::vector<int>& params, torch::Tensor dest,
                                                                 const std::vector<int64_t>& offsets, CollectiveKind what,
                                                                 bool prefetch) {
  const FlatLayout& L = *from.layout;
  const int W = L.world_size;
  auto g = std::make_unique<Gather>();
  g->from = &from;
  g->params = params;
  g->dest = std::move(dest);
  g->offsets = &offsets;
  g->what = what;
  for (int i : params) g->n += L.params[static_cast<size_t>(i)].partition_numel;
  torch::NoGradGuard ng;
  if (!from.staged) {
    // Every rank's partitions straight into the destination, through an alias with a version counter of
    // its own: the forward's saved views of these weights stay valid because the block is gathered again
    // (same bits) before its backward reads them.
    g->out = torch::from_blob(g->dest.data_ptr(), {g->dest.numel()}, g->dest.options());
    g->owners.resize(static_cast<size_t>(W));
    for (int i : params) {
      const ParamSlot& p = L.params[static_cast<size_t>(i)];
      const int64_t at = offsets[static_cast<size_t>(i)];
      for (int r = 0; r < W; ++r) {
        const ShardRange own = stage3_owned(p, r);
        if (own.real > 0) g->owners[static_cast<size_t>(r)].push_back({at + own.begin, own.real});
        if (r == flat_.rank && own.real > 0)
          take_partitions(from, g->out.narrow(0, at + own.begin, own.real), from.partitions.narrow(0, p.partition_offset, own.real), g.get());
      }
    }
    issue(*g);
    return g;
  }
  // Staged: this rank packs its partitions into its place; the all-gather fills the others'.
  g->out = from.staging[prefetch ? 1 : 0].narrow(0, 0, g->n * W);
  for (int r = 0; r < W; ++r) g->owners.push_back({{r * g->n, g->n}});
  int64_t at = flat_.rank * g->n;
  std::vector<ParamSwapper::Piece> pieces;
  for (int i : params) {
    const ParamSlot& p = L.params[static_cast<size_t>(i)];
    if (from.on_nvme)
      pieces.push_back({p.partition_offset, p.partition_numel, static_cast<char*>(g->out.data_ptr()) + at * g->out.element_size()});
    else
      take_partitions(from, g->out.narrow(0, at, p.partition_numel), from.partitions.narrow(0, p.partition_offset, p.partition_numel), g.get());
    at += p.partition_numel;
  }
  if (from.on_nvme) {
    param_swap_->start_read(std::move(pieces));
    g->reading = true;
  } else {
    issue(*g);
  }
  return g;
}

void ZeroExchange::take_partitions(const Partitioned& from, const torch::Tensor& dst, const torch::Tensor& src, Gather* ahead) {
  if (from.place == Place::device)
    dst.copy_(src);
  else if (ahead && !comm_)  // (several ranks: the collective reads dst, queued after what the compute stream waits for)
    ahead->arrived = flat_.device->copy_ahead(dst, Place::device, src, from.place);
  else
    flat_.device->copy(dst, Place::device, src, from.place);
}

void ZeroExchange::issue(Gather& g) {
  if (g.reading) {
    // The file's bytes arrive in the swapper's host buffers and cross to the device's staging through
    // counted copies; each is finished before its buffer is refilled.
    Device& device = *flat_.device;
    const torch::TensorOptions bytes_at_device = g.out.options().dtype(torch::kUInt8);
    param_swap_->finish_read([&](void* dest, const char* host, int64_t bytes) {
      device.copy(torch::from_blob(dest, {bytes}, bytes_at_device), Place::device,
                  torch::from_blob(const_cast<char*>(host), {bytes}, torch::kUInt8), Place::host);
      device.copy_stream().synchronize();
    });
    g.reading = false;
  }
  if (comm_ && !g.work) g.work = comm_->all_gather_async(g.out, g.owners, g.what);  // one rank: its partitions are the whole
}

void ZeroExchange::finish(Gather& g) {
  if (g.arrived) flat_.device->compute_stream().wait_for(*g.arrived), g.arrived.reset();  // (the copy stream's, in order)
  issue(g);
  if (g.work) g.work->wait();
  if (!g.from->staged) return;  // already in place
  const FlatLayout& L = *g.from->layout;
  torch::NoGradGuard ng;
  // Unpacked through an alias of the destination, as above.
  const torch::Tensor dest = torch::from_blob(g.dest.data_ptr(), {g.dest.numel()}, g.dest.options());
  for (int r = 0; r < L.world_size; ++r) {
    int64_t at = 0;
    for (int i : g.params) {
      const ParamSlot& p = L.params[static_cast<size_t>(i)];
      const ShardRange own = stage3_owned(p, r);
      if (own.real > 0)
        dest.narrow(0, (*g.offsets)[static_cast<size_t>(i)] + own.begin, own.real).copy_(g.out.narrow(0, r * g.n + at, own.real));
      at += p.partition_numel;
    }
  }
}

void ZeroExchange::gather_block(int64_t layer, CollectiveKind what, int64_t prefetch) {
  gather_block(trained_, layer, what, prefetch);
  gather_block(frozen_, layer, evaluating_ ? CollectiveKind::parameters_validation : CollectiveKind::frozen_parameters, prefetch);
}

void ZeroExchange::gather_block(Partitioned& from, int64_t layer, CollectiveKind what, int64_t prefetch) {
  // A block whose parameters are all kept whole has nothing to gather (the plan counts no call for it).
  const auto has_partitions = [&](int64_t l) { return !from.per_block[static_cast<size_t>(l)].empty(); };
  if (from.prefetch && from.prefetch->layer == layer) {
    finish(*from.prefetch);
  } else if (has_partitions(layer)) {
    if (from.prefetch) {  // not the one needed (cannot happen in forward/backward order): settle it, as every rank does
      issue(*from.prefetch);
      if (from.prefetch->work) from.prefetch->work->wait();
      if (from.prefetch->arrived) flat_.device->compute_stream().wait_for(*from.prefetch->arrived);
    }
    auto g = start_gather(from, from.per_block[static_cast<size_t>(layer)], from.blocks[layer % 2], *from.block_offset, what, false);
    finish(*g);
  }
  from.prefetch.reset();
  // The next block's gather runs while this one computes; it writes the other buffer, which no block
  // in use reads.
  if (prefetch >= 0 && prefetch < static_cast<int64_t>(from.per_block.size()) && has_partitions(prefetch)) {
    from.prefetch = start_gather(from, from.per_block[static_cast<size_t>(prefetch)], from.blocks[prefetch % 2], *from.block_offset,
                                 what, true);
    from.prefetch->layer = prefetch;
  }
}

void ZeroExchange::before_forward(int64_t layer) {
  if (stage3_)
    gather_block(layer, evaluating_ ? CollectiveKind::parameters_validation : CollectiveKind::parameters_forward, layer + 1);
  if (!published_.empty() && static_cast<size_t>(layer) < block_end_.size()) finish_published(block_end_[static_cast<size_t>(layer)]);
}

void ZeroExchange::after_forward(int64_t layer) {
  if (layer != plan_.model.hp.num_layers - 1) return;
  finish_published();  // the head and the final norm read what follows the blocks
  if (flat_.grouped) finish_reduces(0);
}

void ZeroExchange::finish_published(int64_t before) {
  while (!published_.empty() && published_.front().first < before) {
    published_.front().second->wait();
    published_.pop_front();
  }
}

void ZeroExchange::before_backward(int64_t layer) {
  // The block below runs backward next, unless it ran forward only (below every trained tensor). (Stage 3 runs
  // without pipeline stages: the blocks are numbered as the model's.)
  if (stage3_) gather_block(layer, CollectiveKind::parameters_backward, layer - 1 >= plan_.backward_from ? layer - 1 : -1);
}

void ZeroExchange::after_backward(int64_t layer) {
  host_work_.hook = layer;  // (what the host does until this hook returns is this block's hook's)
  struct Leave {
    HostWorkLog& log;
    ~Leave() { log.hook = -1; }
  } leave{host_work_};
  if (reducing_blocks_) {  // this block's gradients are final for the step
    const int k = range_of_block_[static_cast<size_t>(layer)];
    if (k < 0) return;  // nothing in it trains
    const auto& [begin, end] = block_ranges_[static_cast<size_t>(k)];
    if (flat_.micro_grads.defined()) add_micro_gradients(begin, end - begin);
    for (auto& p : reduce_range(begin, end - begin, /*wait_each=*/false)) block_reduces_.push_back(std::move(p));
    return;
  }
  const int k = group_of_block_[static_cast<size_t>(layer)];
  if (!flat_.grouped) return;
  // A block that trains nothing (frozen, or without adapters): the block below writes the buffer of the same parity
  // as the block above (the buffers follow the blocks' numbers). Gradients landing late need only their copies to
  // have left the buffers (the compute stream waits for them; the host's sums stay late); a collective in flight
  // still reads its buffer: it finishes now.
  if (k < 0 && !comm_ && !flat_.block_arrivals.empty()) {
    for (const auto& r : reducing_) release(*r);
    return;
  }
  if (k < 0) return finish_reduces(0);
  const ParamGroup& g = groups_[static_cast<size_t>(k)];
  start_reduce(g, flat_.block_grads[flat_.overlap ? layer % 2 : 0].narrow(0, 0, g.numel));
}

void ZeroExchange::begin_micro_step(bool evaluation) {
  evaluating_ = evaluation;
  last_backward_ = false;
  finish_published(evaluation ? std::numeric_limits<int64_t>::max() : front_end_);  // (the embeddings come before the blocks)
  if (!stage3_ || outer_.empty()) return;
  // The outer parameters' buffer is theirs alone and they change only in the optimizer: a step's later
  // micro steps find them gathered. (Validation gathers them anyway, counted apart from training.)
  if (!evaluation && outer_gathered_) return;
  auto g = start_gather(trained_, outer_, flat_.outer_params, flat_.group_offset,
                        evaluation ? CollectiveKind::parameters_validation : CollectiveKind::parameters_outer, false);
  finish(*g);
  if (!evaluation) outer_gathered_ = true;
}

void ZeroExchange::begin_backward(bool last) {
  finish_published();  // (the forward waited for every piece; the optimizer must not write a part still being sent)
  if (flat_.grouped) finish_reduces(0);  // the outer gradients are written again (done after the blocks' forward)
  reducing_blocks_ = last && !block_ranges_.empty() && !evaluating_;
  last_backward_ = last && !evaluating_;
}

void ZeroExchange::end_micro_step() {
  if (flat_.micro_grads.defined() && !evaluating_) {
    // The blocks' ranges were added as their backward ended (their reduces are in flight): the rest now.
    const int64_t all = flat_.micro_grads.numel();
    if (reducing_blocks_) {
      add_micro_gradients(0, block_ranges_.front().first);
      add_micro_gradients(block_ranges_.back().second, all - block_ranges_.back().second);
    } else {
      add_micro_gradients(0, all);
    }
  }
  if (!flat_.grouped) return;
  if (groups_.back().layer < 0)
    start_reduce(groups_.back(), flat_.outer_grads);
  else
    finish_reduces(0);
}

void ZeroExchange::publish_parameters() {
  torch::NoGradGuard ng;
  outer_gathered_ = false;  // new weights (or the first): the next micro step gathers the outer ones
  if (stage3_) {  // on one rank too (parameter offload): the whole-kept parameters from the partitions
    if (whole_.empty()) return;
    auto g = start_gather(trained_, whole_, flat_.whole_params, flat_.whole_offset, CollectiveKind::parameters_whole, false);
    finish(*g);
    return;
  }
  if (!comm_ || !plan_.execution.sharded) return;
  // Stages 1-2: every rank's updated part of the padded buffer, gathered in place in pieces (in flight until the next
  // forward needs them when gathering ahead).
  finish_published();
  DS_CHECK(plan_.execution.full_numel == plan_.layout.padded_numel, "the updated parameters' pieces cover ", plan_.execution.full_numel,
           " elements, not the padded buffer's ", plan_.layout.padded_numel);
  for (const auto& [at, end] : updated_parameter_pieces(plan_.layout, plan_.execution, plan_.zero.allgather_bucket_size))
    published_.emplace_back(at, comm_->all_gather_async(flat_.params.narrow(0, at, end - at), clip(shard_owners_, at, end - at),
                                                        CollectiveKind::updated_parameters));
  if (!gather_ahead_) finish_published();
}

}  // namespace ds
