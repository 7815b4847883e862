#include "engine/runtime/run/optimizer_step.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/hash.hpp"
#include "engine/runtime/device/kernel_route.hpp"
#include "engine/runtime/device/resident_memory.hpp"

namespace ds {
namespace {

// More skipped steps in a row than this (inf/NaN gradients) ends the run. fp16's dynamic scaler needs
// room to halve its way down from 2^16 or more (with hysteresis); bf16 has no scale to lower, so a streak
// means the weights are past saving.
constexpr int64_t kMaxConsecutiveSkipsFp16 = 64, kMaxConsecutiveSkipsBf16 = 8;

// Runs `f`, adding its seconds on the host's clock to *s.
template <class F>
void timed(double* s, const F& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  *s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A chunk's fp32 states in step_backup's order (undefined where the optimizer keeps no such state).
std::array<torch::Tensor, 3> fp32_states(const StateChunk& c) { return {c.master, c.exp_avg, c.exp_avg_sq}; }

// Parameters in host memory that a device reads through copies (stage 3's gathers copy them ahead, waited for by the
// compute stream only): every such copy has ended before the host writes them.
void settle_parameter_copies(const FlatParams& flat, Device& device) {
  if (flat.params_place == Place::host && !device.host_addresses_device()) device.copy_stream().synchronize();
}

}  // namespace

// The forward's block hooks of ZeRO-Offload's step during the next forward: the pending tiles a block's forward reads
// are stepped (their weights copied over) before it, the last ones after the last block's (before the head).
class OptimizerStep::ForwardHooks final : public BlockHooks {
 public:
  ForwardHooks(OptimizerStep& step, BlockHooks* inner) : step_(step), inner_(inner) {}
  void before_forward(int64_t layer) override {
    step_.step_pending(2 * layer);
    if (inner_) inner_->before_forward(layer);
  }
  void after_forward(int64_t layer) override {
    step_.step_pending(2 * layer + 1);
    if (inner_) inner_->after_forward(layer);
  }
  void before_backward(int64_t layer) override {
    if (inner_) inner_->before_backward(layer);
  }
  void after_backward(int64_t layer) override {
    if (inner_) inner_->after_backward(layer);
  }

 private:
  OptimizerStep& step_;
  BlockHooks* inner_;
};

// The step's phases timed back to back (consecutive laps tile the step) on the compute stream's clock: on a GPU,
// when the GPU reached each lap's end, not when the host queued it, so each lap is settled once the step's work
// has run. The time waited on the parameters' NVMe I/O is taken out of the phase it happens in and counted as
// offload; with sample_memory, the peak resident memory within each phase (and a GPU's memory in use at its end).
struct OptimizerStep::Clock {
  Clock(StepOutcome& out, Device& device, bool sample_memory, std::function<double()> param_wait)
      : phases(out.phases),
        rss(out.phase_rss_bytes),
        device_bytes(out.phase_device_bytes),
        device(device),
        sample_memory(sample_memory),
        param_wait(std::move(param_wait)),
        at(device.compute_stream().record_timed()) {
    waited = this->param_wait();
    if (sample_memory) restart_peak_resident();
  }
  // Adds the time since the last lap to `into` (when settled), less `less` seconds the host measured and counts
  // in another phase (a wait the lap spans).
  void lap(double& into, double less = 0) {
    std::shared_ptr<Event> now = device.compute_stream().record_timed();
    laps.push_back({&into, at, now, less});
    at = std::move(now);
  }
  // The step's work has run (a GPU's stream waited for): every lap's seconds into its phase.
  void settle() {
    if (laps.empty()) return;
    device.compute_stream().synchronize();
    // (at least 0: a GPU still busy while the host waited spans less than the wait)
    for (const Lap& l : laps) *l.into += std::max(0.0, l.end->seconds_since(*l.begin) - l.less);
    laps.clear();
  }
  // Seconds waited on parameter I/O since the last call, moved to the offload phase.
  double param_io() {
    const double now = param_wait(), s = now - waited;
    waited = now;
    phases.offload += s;
    return s;
  }
  // The end of phase `phase` (StepOutcome::phase_rss_bytes' index).
  void mark(size_t phase) { mark_together(phase, phase); }
  // The end of two phases run interleaved (the state walk's copies and updates): each gets their peak.
  void mark_together(size_t a, size_t b) {
    if (!sample_memory) return;
    const double peak = peak_resident_since_restart(), in_use = device.memory_in_use();
    for (const size_t k : {a, b}) {
      rss[k] = std::max(rss[k], peak);
      device_bytes[k] = std::max(device_bytes[k], in_use);
    }
    restart_peak_resident();
  }
  struct Lap {
    double* into;
    std::shared_ptr<Event> begin, end;
    double less;
  };
  StepPhases& phases;
  std::array<double, 8>&rss, &device_bytes;
  Device& device;
  bool sample_memory;
  std::function<double()> param_wait;
  double waited = 0;
  std::shared_ptr<Event> at;  // the last lap's end
  std::vector<Lap> laps;
};

bool OptimizerStep::finite(const torch::Tensor& master, Place place) const {
  return std::isfinite(device_.kernels(place).sum_of_squares_f32(master.data_ptr<float>(), master.numel()));
}

bool OptimizerStep::master_finite() const {
  for (size_t i = 0; i < states_.spans().size(); ++i) {
    const StateSpan& span = states_.spans()[i];
    // (on NVMe: checked as each sub-group was last stepped or loaded, so no file is read)
    if (span.place == Place::nvme ? !swapped_finite_ : !finite(flat_.states[i].master, span.place)) return false;
  }
  return true;
}

void OptimizerStep::weights_home(const torch::Tensor& master, Place at, int64_t begin, WeightsBack how, const Event* read_before) {
  const torch::Tensor to = flat_.local_params.narrow(0, begin, master.numel());
  const Place home = flat_.params_place;
  if (how == WeightsBack::in_place) {
    if (at != home) device_.count_direct_write(at, home, static_cast<double>(to.nbytes()));
  } else if (how == WeightsBack::staged) {  // the tile the kernel just wrote: its turn's buffer, copied on the copy stream
    const torch::Tensor staged = staging_now().narrow(0, 0, master.numel());
    if (copies_ahead_after_)  // (a speculated tile's, during the backward: the compute stream needs them only for the next forward)
      ahead_arrived_ = device_.copy_ahead(to, home, staged, Place::host, *copies_ahead_after_);
    else if (read_before)
      device_.copy(to, home, staged, Place::host, *read_before);
    else
      device_.copy(to, home, staged, Place::host);
    staging_copied_[staging_turn_] = device_.copy_stream_for(Place::host, home).record();
    if (flat_.weights_staging[1].defined()) staging_turn_ ^= 1;
  } else if (at != home) {
    device_.copy(to, home, master, at);
  } else if (to.data_ptr() != master.data_ptr()) {
    to.copy_(master);
  }
}

double OptimizerStep::bytes_moved() const {
  double b = device_.transferred_bytes();
  b += states_.io_bytes();
  if (param_swap_) b += param_swap_->io().bytes_read() + param_swap_->io().bytes_written();
  return b;
}

void OptimizerStep::put_weights(const StateChunk& c, WeightsBack how, const Event* read_before) {
  if (states_.spans()[c.span].place == Place::nvme) swapped_finite_ = swapped_finite_ && finite(c.master, c.at);
  if (param_swap_) {
    store_params(c.master, c.at, c.begin);
    return;
  }
  weights_home(c.master, c.at, c.begin, how, read_before);
  // An NVMe sub-group's buffers are read into again for a later sub-group: a copy still reading this one's master
  // to the device ends first. (Today those buffers are pageable, which CUDA stages before cudaMemcpyAsync returns,
  // so this wait is free; page-locked, the copy would still be reading. The test device's copy stream refuses a
  // host kernel that writes memory a pending copy reads, and found this path.)
  if (how == WeightsBack::copied && states_.spans()[c.span].place == Place::nvme && c.at != flat_.params_place)
    device_.copy_stream_for(c.at, flat_.params_place).synchronize();
}

torch::Tensor OptimizerStep::gradients_at(const StateChunk& c) {
  const torch::Tensor grads = flat_.local_grads.narrow(0, c.begin, c.numel);
  // Already in the memory the states are stepped in (on the device, or left for the host block by block): the
  // kernel reads them in their own dtype.
  if (flat_.grads_place == c.at) {
    return grads;  // (grad_elements_of names a dtype no kernel reads)
  }
  const StateSpan& span = states_.spans()[c.span];
  if (span.place == Place::nvme) {  // one chunk's (a sub-group's, or a window of one), beside its states
    const torch::Tensor wide = flat_.offload_grads.narrow(0, 0, c.numel);
    device_.copy(wide, Place::host, grads, flat_.grads_place);
    return wide;
  }
  // A span in memory: the whole span's at its first chunk (one copy, before any tile's weights are on their way
  // back, so the host's steps of the next tiles never wait for those copies), then read there tile by tile.
  if (c.begin == span.begin)
    device_.copy(flat_.offload_grads.narrow(0, 0, span.numel()), Place::host, flat_.local_grads.narrow(0, span.begin, span.numel()), flat_.grads_place);
  return flat_.offload_grads.narrow(0, c.begin - span.begin, c.numel);
}

torch::Tensor& OptimizerStep::staging_now() {
  if (const std::shared_ptr<Event>& copied = staging_copied_[staging_turn_]) copied->wait();
  return flat_.weights_staging[staging_turn_];
}

void OptimizerStep::settle_staging() {
  for (std::shared_ptr<Event>& copied : staging_copied_)
    if (copied) copied->wait(), copied.reset();
  staging_turn_ = 0;
}

void OptimizerStep::step_chunk(const StateChunk& c, const torch::Tensor& grads, const OptimizerStepInputs& si, double* crossing_s,
                               const Event* read_before, int64_t tile) {
  const WeightsBack how = states_.spans()[c.span].weights;
  // (the host's own work, for a profile: its step, and its waits for and copies of the weights, apart)
  const bool on_host = states_.spans()[c.span].place != Place::device;
  const auto as = [&](const char* row, auto&& work) {
    if (on_host) zero_.host_work().time(row, tile, work);
    else work();
  };
  OptimizerBuffers b;
  if (how == WeightsBack::staged)  // (it may wait for a staging buffer's last copy)
    as("updated weights to the device", [&] { timed(crossing_s, [&] { b = buffers_of(c, grads); }); });
  else
    b = buffers_of(c, grads);
  as("optimizer step on the host", [&] {
    if (states_.whole_in_memory())
      optimizer_.step(b, si, sum_over_ranks_);
    else
      optimizer_.step_window(b, si, c.begin, c.begin + c.numel);
  });
  if (param_swap_ || c.at == flat_.params_place)  // (the parameter file's waits are its I/O: Clock::param_io)
    put_weights(c, how, read_before);
  else
    as("updated weights to the device", [&] { timed(crossing_s, [&] { put_weights(c, how, read_before); }); });
}

BlockHooks* OptimizerStep::forward_hooks(BlockHooks* inner) {
  DS_CHECK(plan_.execution.step_in_forward, "the forward's hooks of a step the plan does not leave to the next forward");
  forward_hooks_ = std::make_unique<ForwardHooks>(*this, inner);
  return forward_hooks_.get();
}

void OptimizerStep::step_pending(int64_t hook) {
  torch::NoGradGuard ng;
  while (!pending_.empty() && pending_.front().hook <= hook) {
    // (taken off the list first: a tile whose step threw is never stepped twice)
    const PendingTile p = std::move(pending_.front());
    pending_.pop_front();
    const double moved0 = bytes_moved();
    double crossing_s = 0;  // (on the forward's timeline: its phase holds what the compute waited)
    double host_s = 0;
    timed(&host_s, [&] { step_chunk(p.chunk, p.grads, pending_inputs_, &crossing_s, p.read_before.get(), p.tile); });
    if (hook < std::numeric_limits<int64_t>::max()) carried_seconds_ += host_s;  // (finish_update's: in no step)
    const double moved = bytes_moved() - moved0;
    // (the bytes the update counted for it in its step: a mismatch would misreport every step's offload bytes)
    DS_CHECK(moved == p.bytes, "a pending tile's weights moved ", moved, " bytes, its update counted ", p.bytes);
    carried_bytes_ += moved;
    if (hook < std::numeric_limits<int64_t>::max()) ++stepped_in_forward_;
  }
}

void OptimizerStep::finish_update() { step_pending(std::numeric_limits<int64_t>::max()); }

OptimizerBuffers OptimizerStep::buffers_of(const StateChunk& c, const torch::Tensor& grads) {
  OptimizerBuffers b;
  b.master = c.master.data_ptr<float>();
  b.moment1 = FlatParams::data_or_null(c.exp_avg);
  b.moment2 = FlatParams::data_or_null(c.exp_avg_sq);
  switch (states_.spans()[c.span].weights) {
    case WeightsBack::in_place: b.params_bf16 = reinterpret_cast<uint16_t*>(flat_.local_params.data_ptr()) + c.begin; break;
    case WeightsBack::staged: b.params_bf16 = reinterpret_cast<uint16_t*>(staging_now().data_ptr()); break;
    case WeightsBack::copied: b.params_bf16 = nullptr; break;
  }
  b.grads = grads.data_ptr();
  b.grad_elements = grad_elements_of(grads);
  b.kernels = &device_.kernels(c.at);
  return b;
}

torch::Tensor to_long_tensor(const std::vector<int32_t>& v, int64_t B, int64_t T) {
  return torch::from_blob(const_cast<int32_t*>(v.data()), {B, T}, torch::kInt32).to(torch::kLong);
}

OptimizerStep::OptimizerStep(const Plan& plan, FlatParams& flat, ZeroExchange& zero, LanguageModel& model, BatchSampler& sampler,
                             const MeshGroups& groups, LossScaler& scaler, OptimizerSwapper* swapper, ParamSwapper* param_swap)
    : plan_(plan),
      flat_(flat),
      device_(*flat.device),
      zero_(zero),
      model_(model),
      sampler_(sampler),
      comm_(groups.world),
      groups_(groups),
      scaler_(scaler),
      schedule_(plan.scheduler, plan.optimizer.lr, plan.optimizer.betas[0]),
      optimizer_(plan.optimizer, plan.layout, flat.rank),
      states_(flat, swapper),
      param_swap_(param_swap) {
  if (plan.execution.step_in_forward) {
    const std::vector<StateSpan>& spans = states_.spans();
    DS_CHECK(!param_swap && !flat.widened && spans[0].place == Place::host &&
                 std::all_of(spans.begin() + 1, spans.end(), [](const StateSpan& s) { return s.place == Place::device; }),
             "the plan steps tiles during the next forward that are not the first span, in host memory, the rest on the device");
  }
  if (plan.execution.step_in_backward) {
    const std::vector<StateSpan>& spans = states_.spans();
    const std::vector<int64_t>& after = plan.execution.weight_tile_final_after;
    DS_CHECK(!param_swap && !flat.widened && spans[0].place == Place::host && spans[0].weights == WeightsBack::staged &&
                 flat.grads_place == Place::host && zero.sums_on_host() && after.size() == flat.weight_tiles.size(),
             "the plan speculates tiles that are not the host's staged span's, with the gradients summed there");
    int64_t at = 0;
    for (size_t t = 0; t < after.size(); ++t) {
      backup_at_.push_back(after[t] >= 0 ? at : -1);
      at += after[t] >= 0 ? flat.weight_tiles[t].numel() : 0;
    }
    DS_CHECK(at == plan.execution.speculated_numel, "the speculated tiles hold ", at, " elements, the plan says ", plan.execution.speculated_numel);
    const StateChunk first = states_.tile_chunk(0);
    const std::array<torch::Tensor, 3> states = fp32_states(first);
    for (size_t k = 0; k < states.size(); ++k)
      DS_CHECK(!plan.execution.speculation_backed_up || !states[k].defined() || (flat.step_backup[k].defined() && flat.step_backup[k].numel() >= at),
               "no backup of ", at, " elements for the speculated tiles' state ", k);
    speculated_.assign(after.size(), 0);
    zero.on_final_gradients([this](int64_t layer, const Event& written) { speculate(layer, written); });
  }
  if (plan.mesh.shape.splits_the_model() && !plan.mesh.stages.empty()) {
    const int tensor_rank = comm_ ? mesh_coord(plan.mesh.shape, comm_->rank()).tensor : 0;
    // Per parameter of the rank's layout (its stage's trained tensors, or adapters).
    for (const StageTensor& t : plan.own.trained) {
      // (the whole run's trained tensor: the model's, or an adapter's A or B, which split with their base)
      const TensorSpec& whole = plan.trained().tensors[static_cast<size_t>(t.whole)];
      const bool whole_on_each = plan.mesh.shape.tensor > 1 && tensor_split_of(plan.model, whole) == TensorSplit::whole;
      counted_params_.push_back(!t.tied_copy && (!whole_on_each || tensor_rank == 0) ? 1 : 0);
      held_whole_elsewhere_.push_back(whole_on_each && tensor_rank != 0 ? 1 : 0);
    }
  }
  DS_CHECK(flat.params_swapped == (param_swap != nullptr), "NVMe parameters without a swapper, or a swapper without them");
  for (const StateSpan& span : states_.spans()) {  // the plan's word on where the kernel writes the weights, held to
    DS_CHECK(span.weights != WeightsBack::in_place ||
                 (!param_swap && (memory_of(span) == flat.params_place || device_.host_addresses_device())),
             "the plan has the optimizer write weights at ", place_name(flat.params_place), " while stepping states at ",
             place_name(span.place), " on ", device_.name());
    DS_CHECK(span.weights != WeightsBack::staged || (flat.weights_staging[0].defined() && flat.weights_staging[0].numel() >= states_.largest_chunk(span)),
             "the weights' staging buffer holds ", flat.weights_staging[0].defined() ? flat.weights_staging[0].numel() : 0,
             " elements, a chunk ", states_.largest_chunk(span));
  }
  // Lamb: each tensor's norms summed over the ranks that hold its parts: the data group's partitions under ZeRO,
  // then a tensor group's slices (a tensor every tensor rank holds whole counts once: tensor rank 0's). A
  // pipeline stage holds its tensors whole.
  if (plan.optimizer.per_tensor_update())
    sum_over_ranks_ = [this, &zero, tensor = groups.tensor.get()](double* v, size_t n) {
      zero.sum_over_partitions(v, n);
      if (!tensor) return;
      DS_CHECK(2 * held_whole_elsewhere_.size() == n, "Lamb's norms are two a parameter of the rank's layout");
      for (size_t p = 0; p < held_whole_elsewhere_.size(); ++p)
        if (held_whole_elsewhere_[p]) v[2 * p] = v[2 * p + 1] = 0;
      tensor->all_reduce_sum(torch::from_blob(v, {static_cast<int64_t>(n)}, torch::kFloat64), CollectiveKind::lamb_norms_tensor);
    };
}

OptimizerStep::~OptimizerStep() = default;

void OptimizerStep::store_params(const torch::Tensor& master, Place place, int64_t begin) {
  const torch::ScalarType stored = to_torch(plan_.precision.param_dtype);
  for (int64_t done = 0, n = master.numel(); done < n;) {
    const auto [dest, k] = param_swap_->span(begin + done, n - done);
    const torch::Tensor to = torch::from_blob(dest, {k}, stored), from = master.narrow(0, done, k);
    if (place == Place::host)
      to.copy_(from);  // round to nearest even, as the optimizer's kernel does
    else
      device_.copy(to, Place::host, from, place);  // rounded the same way on the way
    // Landed before the next span() may write this buffer out.
    if (place != Place::host) device_.copy_stream_for(place, Place::host).synchronize();
    done += k;
  }
}

void OptimizerStep::weights_from_master() {
  torch::NoGradGuard ng;
  DS_CHECK(pending_.empty(), "the weights drawn from the master while ", pending_.size(), " tiles wait for their step");
  if (param_swap_) param_swap_->begin_write();  // (the file is written front to back: the spans are in order)
  settle_parameter_copies(flat_, device_);
  swapped_finite_ = true;
  states_.for_each([&](const StateChunk& c) { put_weights(c, WeightsBack::copied); }, /*read=*/true, /*write=*/false);
  if (param_swap_) param_swap_->end_write();
}

void OptimizerStep::refresh_weights(bool rounded) {
  torch::NoGradGuard ng;
  if (!rounded) weights_from_master();
  zero_.publish_parameters();
  if (flat_.widened && flat_.compute.defined()) flat_.compute.copy_(flat_.params);
}

void OptimizerStep::set_pipeline(PipelineStageRunner* stage, Communicator* tied) {
  pipeline_ = stage;
  tied_ = tied;
  if (!tied) return;
  tied->connect(1 - tied->rank());  // the first and the last stage (after the pipeline's neighbours met)
  // The token table on the first stage, its copy on the last: the one this stage holds.
  const std::vector<int>& tensors = plan_.trained_model_tensors();
  for (size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i] >= 0 && is_token_table(plan_.model.tensors[static_cast<size_t>(tensors[i])])) tied_param_ = static_cast<int>(i);
  DS_CHECK(tied_param_ >= 0 && plan_.zero_stage() <= 1, "the tied table's gradient: not on this stage, or partitioned");
}

void OptimizerStep::tied_gradient_in() {
  if (!tied_) return;
  torch::NoGradGuard ng;
  const ParamSlot& p = plan_.layout.params[static_cast<size_t>(tied_param_)];
  const torch::Tensor slice = flat_.compute_grads.narrow(0, p.offset, p.numel);
  if (tied_->rank() == 1) {  // the last stage's copy: its gradient to the table (its own step is overwritten)
    tied_->send_async(slice.contiguous(), 0, CollectiveKind::tied_embedding)->wait();
    return;
  }
  const torch::Tensor head = torch::empty_like(slice);
  tied_->recv(head, 1, CollectiveKind::tied_embedding);
  slice.add_(head);
}

void OptimizerStep::tied_weights_back() {
  if (!tied_) return;
  torch::NoGradGuard ng;
  const ParamSlot& p = plan_.layout.params[static_cast<size_t>(tied_param_)];
  const torch::Tensor slice = flat_.params.narrow(0, p.offset, p.numel);
  if (tied_->rank() == 0) {  // the table, stepped: its weights to the copy
    tied_->send_async(slice.contiguous(), 1, CollectiveKind::tied_embedding)->wait();
    return;
  }
  const torch::Tensor table = torch::empty_like(slice);
  tied_->recv(table, 0, CollectiveKind::tied_embedding);
  slice.copy_(table);
  if (flat_.widened && flat_.compute.defined()) flat_.compute.narrow(0, p.offset, p.numel).copy_(table);
}

void OptimizerStep::draw_micro_batch(int64_t step, int64_t m) {
  sampler_.train_batch(step, m, in_, tgt_, &segments_);
  model_.set_segments(&segments_);
  // (the data rank's key: the tensor ranks and stages of one batch drop alike, as one rank would)
  model_.set_dropout(splitmix64(plan_.run.seed ^ splitmix64((static_cast<uint64_t>(step) * static_cast<uint64_t>(plan_.batch.grad_accum) + m) * 4099 +
                                                            static_cast<uint64_t>(flat_.rank))),
                     true);
}

std::pair<double, double> OptimizerStep::loss_gradient_of(int64_t step, int64_t m, double loss_scale, int64_t step_counted) const {
  const int64_t GAS = plan_.batch.grad_accum;
  const int W = plan_.batch.world_size;  // the data-parallel ranks (the world, unless the mesh splits the model)
  // The sum over ranks is the mean, unless gradient_allreduce_op is "sum". Masked rows (fine-tuning data):
  // each micro batch's mean weighs its share of the step's counted targets (`share` = 1 / (GAS x W) unmasked).
  if (!sampler_.masked()) return {loss_scale / static_cast<double>(GAS * (plan_.gradient_sum_over_ranks ? 1 : W)), 1.0};
  const double share = step_counted > 0 ? static_cast<double>(sampler_.counted_targets(step, m)) / static_cast<double>(step_counted) : 0;
  return {loss_scale * share * (plan_.gradient_sum_over_ranks ? W : 1),
          share * static_cast<double>(GAS * W)};  // agree() divides the summed losses by GAS x W
}

torch::Tensor OptimizerStep::pipeline_micro_steps(int64_t step, StepOutcome& out, Clock& clock) {
  const int64_t B = plan_.batch.micro_batch, T = plan_.seq_len, GAS = plan_.batch.grad_accum;
  StepPhases& t = out.phases;
  const int64_t step_counted = sampler_.masked() ? sampler_.step_counted_targets(step) : 0;
  std::vector<std::pair<double, double>> gradient(static_cast<size_t>(GAS));  // per micro batch: its loss's gradient and weight
  // The time since the last op began (its wait for a neighbour's message included) is that op's.
  bool after_forward = true;
  const auto lap_op = [&] { clock.lap(after_forward ? t.forward : t.backward); };
  HostWorkLog& log = zero_.host_work();
  const auto prepare = [&](int m, bool forward) {
    lap_op();
    after_forward = forward;
    log.micro_step = m, log.during = forward ? HostWorkSpan::During::forward : HostWorkSpan::During::backward;
    draw_micro_batch(step, m);
    PipelineStageRunner::Batch batch;
    if (forward) {
      batch = {to_long_tensor(in_, B, T), to_long_tensor(tgt_, B, T)};
      gradient[static_cast<size_t>(m)] = loss_gradient_of(step, m, out.loss_scale, step_counted);
      model_.set_loss_gradient(gradient[static_cast<size_t>(m)].first);
      zero_.begin_micro_step(false);
    } else {
      zero_.begin_backward(/*last=*/m == GAS - 1);
    }
    clock.lap(t.data);
    return batch;
  };
  const auto backward_from = [&](const torch::Tensor& loss, int m) { return loss * gradient[static_cast<size_t>(m)].first; };
  const auto finished = [&](int) { zero_.end_micro_step(); };
  const std::vector<torch::Tensor> losses = pipeline_->run(prepare, backward_from, finished);
  log.micro_step = -1, log.during = HostWorkSpan::During::after;
  lap_op();  // the last backward, and the wait for the last sends
  clock.mark(2);
  groups_.settle();  // the host reads the losses: the stages' messages they follow end first, or time out
  double loss_sum = 0;
  for (size_t m = 0; m < losses.size(); ++m) loss_sum += losses[m].item<double>() * gradient[m].second;
  return torch::tensor(loss_sum, torch::kFloat64);
}

torch::Tensor OptimizerStep::micro_steps(int64_t step, StepOutcome& out, Clock& clock) {
  const int64_t B = plan_.batch.micro_batch, T = plan_.seq_len, GAS = plan_.batch.grad_accum;
  StepPhases& t = out.phases;
  torch::Tensor loss_sum;  // where the losses are (a GPU's stay there until the step's end: one read, not one per micro step)
  const int64_t step_counted = sampler_.masked() ? sampler_.step_counted_targets(step) : 0;
  if (sampler_.masked()) out.trained_tokens = out.counted_targets = step_counted;
  if (sampler_.packed()) out.attention_squares = sampler_.step_attention_squares(step);
  if (pipeline_) return pipeline_micro_steps(step, out, clock);
  for (int64_t m = 0; m < GAS; ++m) {
    draw_micro_batch(step, m);
    const torch::Tensor input = to_long_tensor(in_, B, T), target = to_long_tensor(tgt_, B, T);
    clock.lap(t.data);
    clock.mark(0);
    zero_.begin_micro_step(false);
    const auto [loss_gradient, loss_weight] = loss_gradient_of(step, m, out.loss_scale, step_counted);
    model_.set_loss_gradient(loss_gradient);
    HostWorkLog& log = zero_.host_work();
    log.micro_step = m, log.during = HostWorkSpan::During::forward;
    torch::Tensor loss = model_.loss(input, target);
    // The last update's tiles were stepped during this forward, the host's work overlapping the device's: the phases
    // are the device's timeline, so the forward holds what its blocks waited for their weights, and nothing else.
    DS_CHECK(pending_.empty(), pending_.size(), " tiles of the last update were not reached by the forward's block hooks");
    clock.lap(t.forward, clock.param_io());
    clock.mark(1);
    zero_.begin_backward(/*last=*/m == GAS - 1);
    log.during = HostWorkSpan::During::backward;
    (loss * loss_gradient).backward();
    log.during = HostWorkSpan::During::after;  // (what ZeRO finishes now follows the backward: the last blocks' sums)
    zero_.end_micro_step();
    log.micro_step = -1;
    const torch::Tensor wide = loss_weight == 1 ? loss.detach().to(torch::kFloat64) : loss.detach().to(torch::kFloat64) * loss_weight;
    loss_sum = loss_sum.defined() ? loss_sum + wide : wide;
    clock.lap(t.backward, clock.param_io());
    clock.mark(2);
  }
  return loss_sum.defined() ? loss_sum : torch::zeros({}, torch::kFloat64);
}

double OptimizerStep::agree(StepOutcome& out, const torch::Tensor& losses, int stop_signal) {
  bool partial = false;
  groups_.settle();  // the losses' and the gradients' last collectives, before the host reads them
  double loss_sum = losses.item<double>();
  double sum_of_squares = zero_.grad_sum_of_squares(&partial);
  if (plan_.mesh.shape.splits_the_model() && comm_) {
    // A split model: every rank holds a part, summed over the world (a stage training nothing adds 0); a tensor
    // every tensor rank holds whole counts once (tensor rank 0's), the tied head's copy not at all (the table
    // does), and a stage-0 replica of the whole share once (data rank 0's).
    const MeshCoord at = mesh_coord(plan_.mesh.shape, comm_->rank());
    if (!plan_.execution.sharded && at.data != 0) sum_of_squares = 0;
    else sum_of_squares = zero_.grad_sum_of_squares_of(counted_params_);
    partial = true;
  }
  bool stop = stop_signal != 0;
  if (comm_) {
    // The mean loss, the gradient norm over the ranks' parts and whether any rank was interrupted,
    // agreed in one small collective, so every rank takes the same step and stops after the same one.
    torch::Tensor agreed =
        torch::tensor({loss_sum, static_cast<double>(stop_signal), partial ? sum_of_squares : 0.0}, torch::kFloat64);
    comm_->all_reduce_sum(agreed, CollectiveKind::control);
    loss_sum = agreed[0].item<double>();
    stop = agreed[1].item<double>() > 0;
    if (partial) sum_of_squares = agreed[2].item<double>();
  }
  take_figures(out, loss_sum, stop, sum_of_squares);
  return sum_of_squares;
}

void OptimizerStep::take_figures(StepOutcome& out, double loss_sum, bool stop, double sum_of_squares) const {
  // Every rank of the last stage holds the loss (each tensor rank the same): the world's sum is over them.
  const int holders = comm_ ? plan_.topology.world_size / plan_.mesh.shape.pipeline : 1;
  out.loss = loss_sum / static_cast<double>(plan_.batch.grad_accum * holders);
  out.stop_requested = stop;
  out.norm = std::sqrt(sum_of_squares) / out.loss_scale;
}

bool OptimizerStep::figures_stay_on_device() const {
  // (Lamb's trust ratios, a split model's counted parts, the pipeline's losses and offloaded states are the host's)
  if (device_.host_addresses_device() || pipeline_ || plan_.mesh.shape.splits_the_model() || plan_.optimizer.per_tensor_update() ||
      param_swap_ || !states_.whole_in_memory())
    return false;
  return states_.spans()[0].place == Place::device && flat_.grads_place == Place::device && flat_.params_place == Place::device;
}

OptimizerStep::DeviceFigures OptimizerStep::agree_on_device(const StepOutcome& out, const torch::Tensor& loss_sum, int stop_signal) {
  torch::NoGradGuard ng;
  const auto f64 = flat_.local_grads.options().dtype(torch::kFloat64);
  DeviceFigures f;
  f.values = torch::zeros({4}, f64);
  f.values[0].copy_(loss_sum);
  if (stop_signal != 0) f.values[1].fill_(stop_signal);
  zero_.grad_sum_of_squares_to(f.values.data_ptr<double>() + 3, &f.partial);
  if (f.partial) f.values[2].copy_(f.values[3]);
  if (comm_) comm_->all_reduce_sum(f.values.narrow(0, 0, 3), CollectiveKind::control);  // (as agree(), on the device)
  // step_inputs' clipping and check_overflow's skip, in the same double operations (divisors as tensors: on CUDA,
  // LibTorch multiplies by the reciprocal of a scalar divisor, which rounds differently from the host's division).
  const auto scalar = [&](double x) { return torch::full({}, x, f64); };
  const torch::Tensor root = (f.partial ? f.values[2] : f.values[3]).sqrt();
  const torch::Tensor loss_scale = scalar(out.loss_scale), norm = root / loss_scale;
  torch::Tensor coefficient = scalar(1.0);
  if (plan_.gradient_clipping > 0) {
    const torch::Tensor c = (norm + 1e-6) / scalar(plan_.gradient_clipping);
    coefficient = torch::where(c > 1, c.reciprocal(), coefficient);
  }
  const torch::Tensor overflow = root.isfinite().logical_not();
  torch::Tensor skip = torch::zeros({}, f64.dtype(torch::kBool));
  if (scaler_.enabled() || plan_.precision.check_overflow) skip = overflow;
  if (!scaler_.enabled()) {  // the run ends at the step's end (check_overflow): nothing is written either
    skip = skip.logical_or(f.values[0].isfinite().logical_not());
    if (plan_.precision.overflow_is_fatal) skip = skip.logical_or(overflow);
  }
  f.control = torch::stack({(coefficient / loss_scale).to(torch::kFloat32), skip.logical_not().to(torch::kFloat32)});
  return f;
}

OptimizerStep::DeviceControl OptimizerStep::read_figures(StepOutcome& out, const DeviceFigures& f, double* sum_of_squares) const {
  torch::Tensor host = torch::empty({6}, torch::kFloat64);  // (host memory)
  host.copy_(torch::cat({f.values, f.control.to(torch::kFloat64)}));  // the step's one wait for the device
  const double* v = host.data_ptr<double>();
  *sum_of_squares = f.partial ? v[2] : v[3];
  take_figures(out, v[0], v[1] > 0, *sum_of_squares);
  return {static_cast<float>(v[4]), v[5] != 0};
}

void OptimizerStep::check_overflow(int64_t step, StepOutcome& out, bool overflow) {
  // fp32 and bf16: a non-finite loss means the weights are gone; fp32 has no overflow to skip either.
  if (!scaler_.enabled() && (!std::isfinite(out.loss) || (overflow && plan_.precision.overflow_is_fatal)))
    throw std::runtime_error("the loss or gradient became " + std::string(std::isnan(out.loss) ? "NaN" : "infinite") + " at step " +
                             std::to_string(step + 1) + ": lower the learning rate or keep gradient_clipping on");
  out.skipped = overflow && plan_.precision.check_overflow;
  if (scaler_.enabled()) {
    std::string event;
    out.skipped = scaler_.update(overflow, &event);
    if (!event.empty()) out.notes.push_back("ds train: step " + std::to_string(step + 1) + ": " + event);
  }
  consecutive_skips_ = out.skipped ? consecutive_skips_ + 1 : 0;
  // A static loss scale never changes, so a streak of overflows will not end by itself either.
  const bool scale_adapts = scaler_.enabled() && plan_.precision.loss_scaling.dynamic;
  if (consecutive_skips_ > (scale_adapts ? kMaxConsecutiveSkipsFp16 : kMaxConsecutiveSkipsBf16))
    throw std::runtime_error(std::to_string(consecutive_skips_) + " optimizer steps in a row were skipped for inf/NaN gradients "
                             "(up to step " + std::to_string(step + 1) + "): the run is not recovering; " +
                             (scaler_.enabled() && !scale_adapts ? "the static fp16.loss_scale " + format_double(scaler_.scale()) +
                                                                       " overflows: lower it, or set 0 for DeepSpeed's dynamic scaling"
                                                                 : std::string("lower the learning rate")));
  if (out.skipped && !scaler_.enabled()) out.notes.push_back("ds train: step " + std::to_string(step + 1) + ": inf/NaN gradient, step skipped");
}

void OptimizerStep::decide_skip(int64_t step, StepOutcome& out, double sum_of_squares) {
  check_overflow(step, out, !std::isfinite(std::sqrt(sum_of_squares)));
  if (out.trained_tokens == 0 && !out.skipped) {
    // Fine-tuning data whose step counts no target (every sample cut inside its prompt): no gradient to
    // follow, so no update either; AdamW would still move every weight by its momentum and decay.
    out.skipped = true;
    out.notes.push_back("ds train: step " + std::to_string(step + 1) +
                        ": its samples hold no trained token within data.seq_len (prompts cut before their answers): step skipped, no update");
  }
  if (out.skipped && out.trained_tokens > 0) out.trained_tokens = 0;  // skipped for overflow: nothing was trained
}

OptimizerStepInputs OptimizerStep::step_inputs(const StepOutcome& out) const {
  // DeepSpeed's clipping: coefficient ((norm + 1e-6) / clip), applied when above 1; the loss scale comes
  // off in the same multiply.
  double clip = 1.0;
  if (plan_.gradient_clipping > 0) {
    const double c = (out.norm + 1e-6) / plan_.gradient_clipping;
    if (c > 1) clip = 1.0 / c;
  }
  return inputs_at(out.lr, clip / out.loss_scale);
}

OptimizerStepInputs OptimizerStep::inputs_at(double lr, double grad_scale) const {
  OptimizerStepInputs si;
  si.lr = lr;
  si.beta1 = schedule_.beta1_at(applied_ - 1);
  si.beta2 = schedule_.beta2_override().value_or(plan_.optimizer.betas[1]);
  si.grad_scale = grad_scale;
  si.step = applied_ + 1;
  return si;
}

void OptimizerStep::speculate(int64_t layer, const Event& written) {
  if (!speculating_) return;
  torch::NoGradGuard ng;
  const std::vector<int64_t>& after = plan_.execution.weight_tile_final_after;
  const double moved0 = bytes_moved();
  double crossing_s = 0;  // (inside the backward's phase: the host's time there)
  copies_ahead_after_ = &written;
  try {
    for (size_t t = 0; t < after.size(); ++t) {
      if (after[t] < layer || speculated_[t]) continue;  // (-1: never; a block below `layer`: not final yet)
      const StateChunk c = states_.tile_chunk(t);
      const std::array<torch::Tensor, 3> states = fp32_states(c);
      if (plan_.execution.speculation_backed_up)
        zero_.host_work().time("speculated states backed up", static_cast<int64_t>(t), [&] {
          for (size_t k = 0; k < states.size(); ++k)
            if (states[k].defined()) flat_.step_backup[k].narrow(0, backup_at_[t], c.numel).copy_(states[k]);
        });
      speculated_[t] = 1;  // (before its step: a step that threw is restored with the rest)
      ++speculated_count_;
      step_chunk(c, gradients_at(c), speculated_inputs_, &crossing_s, nullptr, static_cast<int64_t>(t));
    }
  } catch (...) {
    copies_ahead_after_ = nullptr;
    throw;
  }
  copies_ahead_after_ = nullptr;
  speculated_bytes_ += bytes_moved() - moved0;
}

void OptimizerStep::settle_speculation(const OptimizerStepInputs* si, StepOutcome& out, bool failing) {
  speculating_ = false;
  // The speculated tiles' weights reach the device before anything after this reads them (the next forward).
  if (ahead_arrived_) device_.compute_stream().wait_for(*ahead_arrived_), ahead_arrived_.reset();
  out.speculated_tiles = speculated_count_;
  if (speculated_count_ == 0) return;
  const OptimizerStepInputs& s = speculated_inputs_;
  if (si && si->lr == s.lr && si->beta1 == s.beta1 && si->beta2 == s.beta2 && si->grad_scale == s.grad_scale && si->step == s.step &&
      !si->control)
    return;  // the update would step them with these very inputs: they stand
  if (!plan_.execution.speculation_backed_up) {  // (the plan saw nothing that could undo the step)
    DS_CHECK(failing, "step ", applied_ + 1, ": the speculated tiles do not stand, and the plan kept no backup of them");
    return;  // the run ends with the error that stopped the step
  }
  torch::NoGradGuard ng;
  const double moved0 = bytes_moved();
  for (size_t t = 0; t < speculated_.size(); ++t) {
    if (!speculated_[t]) continue;
    const StateChunk c = states_.tile_chunk(t);
    const std::array<torch::Tensor, 3> states = fp32_states(c);
    for (size_t k = 0; k < states.size(); ++k)
      if (states[k].defined()) states[k].copy_(flat_.step_backup[k].narrow(0, backup_at_[t], c.numel));
    if (!si) put_weights(c, WeightsBack::copied);  // no update: the weights the master rounds to, as before
    speculated_[t] = 0;                            // (else the update steps it again)
    ++out.restored_tiles;
  }
  speculated_count_ = 0;
  // The speculated copies of tiles that did not stand, and the weights put back: beyond the plan's bytes.
  out.speculation_bytes = speculated_bytes_ + (bytes_moved() - moved0);
}

void OptimizerStep::update(const OptimizerStepInputs& si, Clock& clock) {
  torch::NoGradGuard ng;
  StepPhases& t = clock.phases;
  const double io0 = states_.io_wait();
  double crossing_s = 0;  // the gradients' and weights' copies between places
  if (param_swap_) param_swap_->begin_write();  // (the file is written front to back: the spans are in order)
  settle_parameter_copies(flat_, device_);
  swapped_finite_ = true;
  DS_CHECK(pending_.empty(), "an update while ", pending_.size(), " tiles of the last wait for their step");
  pending_bytes_ = 0;
  pending_inputs_ = si;
  // (the backward's reads of the weights are queued before the update: the pending tiles' copies wait for those only)
  const std::shared_ptr<Event> read_before = plan_.execution.step_in_forward ? device_.compute_stream().record() : nullptr;
  size_t tile = 0;
  states_.for_each([&](const StateChunk& c) {
    // (the host's span is walked in its tiles where the plan steps them in the forward or the backward)
    const bool tiled = c.span == 0 && (plan_.execution.step_in_forward || plan_.execution.step_in_backward);
    const size_t t = tiled ? tile++ : 0;
    if (tiled) DS_CHECK(t < flat_.weight_tiles.size() && flat_.weight_tiles[t].begin == c.begin, "a chunk at ", c.begin, " that is not tile ", t);
    if (tiled && plan_.execution.step_in_backward && speculated_[t]) return;  // stepped during the backward, and it stands
    torch::Tensor grads;  // (copied where the states are now, while they are the step's: a pending tile reads them later)
    if (states_.spans()[c.span].place == Place::device)
      grads = gradients_at(c);
    else
      timed(&crossing_s, [&] { grads = gradients_at(c); });
    if (plan_.execution.step_in_forward && c.span == 0) {  // (the host's span, walked in its tiles; the device's at once)
      const int64_t hook = plan_.execution.weight_tile_hooks.at(t);
      if (hook >= 0) {
        // (read during the next forward: not from a gradient buffer the next step zeroes as it begins)
        DS_CHECK(zero_.sums_on_host() || !grads.is_alias_of(flat_.compute_grads), "a pending tile's gradients in the buffer the next step zeroes first");
        const double bytes = c.at != flat_.params_place ? static_cast<double>(c.numel * flat_.local_params.element_size()) : 0.0;
        pending_.push_back({c, grads, hook, bytes, read_before, static_cast<int64_t>(t)});
        pending_bytes_ += bytes;
        return;
      }
    }
    step_chunk(c, grads, si, &crossing_s, nullptr, tiled ? static_cast<int64_t>(t) : -1);
  });
  if (flat_.weights_staging[0].defined())
    timed(&crossing_s, [&] { settle_staging(); });  // the last tiles' copies have left: the step's offload is done
  if (param_swap_) param_swap_->end_write();
  const double io_wait = states_.io_wait() - io0, param_wait_s = clock.param_io();
  clock.lap(t.optimizer, io_wait + crossing_s + param_wait_s);
  t.offload += io_wait + crossing_s;
  if (io_wait + crossing_s + param_wait_s > 0)  // states or weights crossed places
    clock.mark_together(5, 6);
  else
    clock.mark(6);
  // Every chunk's weights are home (or will be, each before the next forward reads it: one rank's part, which
  // publishing leaves where it is): published.
  refresh_weights(/*rounded=*/true);
}

void OptimizerStep::end_gradients() {
  tied_gradient_in();
  zero_.reduce_gradients();
  zero_.end_gradient_sums();
  if (flat_.widened) {  // round the gradients to their stored dtype (fp16 overflows to inf here), then back
    torch::NoGradGuard ng;
    flat_.grads.copy_(flat_.compute_grads);
    flat_.compute_grads.copy_(flat_.grads);
  }
}

StepOutcome OptimizerStep::run(int64_t step, int stop_signal) {
  StepOutcome out;
  zero_.begin_gradient_sums();
  out.loss_scale = scaler_.enabled() ? scaler_.scale() : 1.0;
  const double moved0 = bytes_moved();
  carried_bytes_ = 0;
  carried_seconds_ = 0;
  pending_bytes_ = 0;  // (a step that updates nothing leaves no tile)
  Clock clock(out, device_, sample_memory_, [this] { return param_wait(); });
  StepPhases& t = out.phases;
  out.lr = schedule_.lr_at(applied_ - 1);
  if (plan_.execution.step_in_backward) {  // (the update's inputs as they will be unless the step is clipped or skipped)
    std::fill(speculated_.begin(), speculated_.end(), 0);
    speculated_count_ = 0;
    speculated_bytes_ = 0;
    speculated_inputs_ = inputs_at(out.lr, 1.0 / out.loss_scale);
    // (not a step the data says trains nothing: it is skipped)
    speculating_ = !sampler_.masked() || sampler_.step_counted_targets(step) > 0;
  }
  // A device with memory of its own keeps the step's figures there: the norm, the clipping and the skip decided
  // on the device, read by the host once, at the step's end, where it waits for the step anyway. Elsewhere the
  // host reads them now and decides.
  const bool on_device = figures_stay_on_device();
  DeviceFigures figures;
  try {
    const torch::Tensor loss_sum = micro_steps(step, out, clock);
    end_gradients();
    clock.lap(t.reduce);
    clock.mark(3);
    if (on_device)
      figures = agree_on_device(out, loss_sum, stop_signal);
    else
      decide_skip(step, out, agree(out, loss_sum, stop_signal));
  } catch (...) {
    if (speculating_) settle_speculation(nullptr, out, /*failing=*/true);  // (the states as they were, where kept)
    throw;
  }
  OptimizerStepInputs si = step_inputs(out);  // (on the device: the schedule's values; its grad_scale gives way to the control's)
  if (on_device) si.control = figures.control.data_ptr<float>();
  // On the device, a step the host knows trains nothing is not run; one the device skips runs its update, which writes
  // nothing, and republishes the same weights (its time and collectives show in the step's figures, as a run's would).
  const bool updated = !out.skipped && out.trained_tokens != 0;
  if (speculating_) {
    DS_CHECK(!on_device, "a speculative step with the step's figures on the device");
    settle_speculation(updated ? &si : nullptr, out);
  }
  clock.lap(t.norm);
  clock.mark(4);  // a step the host skips ends at its overflow check
  if (updated) {
    update(si, clock);
    tied_weights_back();
    clock.lap(t.gather, clock.param_io());
    clock.mark(7);
  }
  // Gradients out, weights back, the swap files' reads and writes: this step's, the tiles it leaves to the next forward
  // included and the last step's stepped in this one's forward not.
  out.offload_bytes = bytes_moved() - moved0 - carried_bytes_ + pending_bytes_ - out.speculation_bytes;
  out.deferred_step_s = carried_seconds_;
  // The step's last collectives (stage 3's gathers, which the compute stream waits for) end first, or time out
  // naming the rank: the clock's wait for the stream has no bound of its own.
  groups_.settle();
  if (on_device) {
    double sum_of_squares = 0;
    const DeviceControl there = read_figures(out, figures, &sum_of_squares);
    decide_skip(step, out, sum_of_squares);
    // What the host would have handed the kernels: the device's decision, to the bit.
    DS_CHECK(!updated || there.apply == !out.skipped, "step ", step + 1, ": the device ", there.apply ? "applied" : "skipped",
             " the update the host ", out.skipped ? "skips" : "applies");
    const float host_scale = static_cast<float>(step_inputs(out).grad_scale);
    DS_CHECK(!there.apply || there.grad_scale == host_scale, "step ", step + 1, ": the device scaled the gradients by ", there.grad_scale,
             ", the host's clipping and loss scale give ", host_scale);
  }
  if (updated && !out.skipped) ++applied_;
  clock.settle();
  return out;
}

}  // namespace ds
