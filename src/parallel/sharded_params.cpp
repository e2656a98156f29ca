#include "core/weights_generation.h"
#include "parallel/sharded_params.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "ops/cast.h"
#include "ops/grad_norm.h"
#include "ops/known_zero.h"
#include "ops/muon.h"

#if MARROW_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#endif

namespace marrow {

namespace {

// Which unit a tensor belongs to: the norms of one pipeline chunk together, else its stage's dense
// or expert tensors.
struct UnitKey {
  bool norms;
  int64_t stage;
  bool expert;
  bool operator==(const UnitKey&) const = default;
};

UnitKey unit_key(const TensorSpec& s, const std::vector<int64_t>& stage_chunk) {
  return s.is_norm ? UnitKey{true, -1 - stage_chunk[size_t(s.layer + 1)], false} : UnitKey{false, s.layer, s.is_expert};
}

}  // namespace

void ShardedParameters::add_undecayed(Unit& u, const TensorSpec& s) {
  if (s.decayed) return;
  const int64_t begin = s.offset - u.begin, end = begin + s.numel;
  if (!u.undecayed.empty() && u.undecayed.back().second == begin) u.undecayed.back().second = end;
  else u.undecayed.emplace_back(begin, end);
}

void ShardedParameters::add_matrices(Unit& u, const TensorSpec& s) {
  if (!s.orthogonalized) return;
  const int64_t rows = s.shape[s.shape.size() - 2], cols = s.shape.back(), begin = s.offset - u.begin;
  Unit::MatrixRun& last = u.matrices.empty() ? u.matrices.emplace_back(Unit::MatrixRun{begin, 0, rows, cols}) : u.matrices.back();
  if (last.end() == begin && last.rows == rows && last.cols == cols) last.count += s.numel / (rows * cols);
  else u.matrices.push_back({begin, s.numel / (rows * cols), rows, cols});
}

std::vector<ShardedParameters::Unit> ShardedParameters::cut_units(const std::vector<TensorSpec>& specs, int64_t num_layers,
                                                                  const std::vector<int64_t>& stage_chunk, const Mesh& mesh,
                                                                  bool keep_gathered, bool keep_whole_grads, bool cast_on_use) {
  std::vector<Unit> units;
  std::vector<UnitKey> seen;
  for (const TensorSpec& s : specs) {
    if (stage_chunk[size_t(s.layer + 1)] < 0) continue;  // another pipeline rank's
    const UnitKey key = unit_key(s, stage_chunk);
    if (!units.empty() && seen.back() == key && units.back().begin + units.back().numel == s.offset) {
      add_undecayed(units.back(), s);
      add_matrices(units.back(), s);
      units.back().numel += s.numel;
      continue;
    }
    MARROW_CHECK(std::find(seen.begin(), seen.end(), key) == seen.end(),
                 "internal: the tensors of one shard unit are not contiguous in the parameter table ({})", s.name);
    seen.push_back(key);
    Unit u;
    u.stage = key.norms ? s.layer : key.stage;  // norms: waited for and reduced with their chunk's first layer
    u.expert = key.expert;
    u.norms = key.norms;
    u.begin = s.offset;
    u.numel = s.numel;
    u.group = u.expert ? &mesh.expert_shard : &mesh.shard;
    u.n = u.group->size();
    const bool whole_anyway = u.norms || u.stage < 0 || u.stage >= num_layers;
    u.weights_kept = keep_gathered || whole_anyway || (u.n == 1 && !cast_on_use);
    u.grads_kept = keep_whole_grads || whole_anyway || u.n == 1;
    u.cast = u.n == 1 && !u.weights_kept;
    add_undecayed(u, s);
    add_matrices(u, s);
    units.push_back(u);
  }
  int64_t offset = 0;
  for (Unit& u : units) {
    u.chunk = (u.numel + u.n - 1) / u.n;
    u.offset = offset;
    offset += u.chunk;
  }
  return units;
}

int64_t ShardedParameters::shard_elements(const std::vector<Unit>& units) {
  int64_t total = 0;
  for (const Unit& u : units) total += u.chunk;
  return total;
}

ShardedParameters::ShardedParameters(const std::vector<TensorSpec>& specs, int64_t num_layers, const std::vector<int64_t>& stage_chunk,
                                     const Mesh& mesh, bool keep_gathered, bool keep_whole_grads, bool cast_on_use, Device device,
                                     DType compute, DType moments, bool split_master)
    : specs_(specs),
      num_layers_(num_layers),
      device_(device),
      mesh_(mesh),
      units_(cut_units(specs, num_layers, stage_chunk, mesh, keep_gathered, keep_whole_grads, cast_on_use && compute != DType::f32)),
      params_(split_master && compute == DType::bf16 ? "parameters (fp32 low halves)" : "parameters",
              split_master && compute == DType::bf16 ? DType::u16 : DType::f32, device, shard_elements(units_)),
      grads_("gradients", DType::f32, device, shard_elements(units_)),
      exp_avg_(moments == DType::f32 ? "adam exp_avg" : "adam exp_avg (bf16)", moments, device, shard_elements(units_)),
      exp_avg_sq_(moments == DType::f32 ? "adam exp_avg_sq" : "adam exp_avg_sq (bf16)", moments, device, shard_elements(units_)) {
  by_stage_.resize(size_t(num_layers + 2));
  for (size_t i = 0; i < units_.size(); ++i) by_stage_[size_t(units_[i].stage + 1)].push_back(i);
  for (const std::vector<size_t>& stage : by_stage_)
    for (size_t i : stage)
      if (units_[i].norms) update_order_.insert(update_order_.begin(), i);
      else update_order_.push_back(i);
  saves_ = mesh.replica_rank == 0;
  split_ = split_master && compute == DType::bf16;
  MARROW_CHECK(!split_ || !cast_on_use, "internal: split master weights keep the compute copy, so cast_on_use cannot apply");
  allocate(compute);
  place(specs);
  place_absent(specs, stage_chunk, compute);
  fill_zero(grads_.all());
  if (gathered_) fill_zero(gathered_->all());
  if (whole_grads_) fill_zero(whole_grads_->all());
#if MARROW_CUDA
  if (device == Device::cuda && std::any_of(units_.begin(), units_.end(), [](const Unit& u) { return u.cast; })) {
    cudaStream_t stream = nullptr;
    MARROW_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cast_stream_ = std::shared_ptr<void>(stream, [](void* p) { cudaStreamDestroy(static_cast<cudaStream_t>(p)); });
  }
#endif
}

// Compute-dtype shards of slotted units, whole copies and whole gradients of kept units (the shard
// itself when n = 1), and two weight and gradient slots per kind of decoder-layer unit.
void ShardedParameters::allocate(DType compute) {
  const bool separate_working = compute != DType::f32;  // the CPU computes on the fp32 master shard
  int64_t shards = 0, gathered = 0, whole = 0;
  std::array<int64_t, 2> weight_slot{0, 0}, grad_slot{0, 0};
  for (const Unit& u : units_) {
    const size_t kind = u.expert ? 1 : 0;
    if (!u.weights_kept) weight_slot[kind] = std::max(weight_slot[kind], u.n * u.chunk);
    else if (separate_working || u.n > 1) gathered += u.n * u.chunk;
    if (!u.weights_kept && separate_working && !u.cast) shards += u.chunk;
    if (!u.grads_kept) grad_slot[kind] = std::max(grad_slot[kind], u.n * u.chunk);
    else if (u.n > 1) whole += u.n * u.chunk;
  }
  gathered += 2 * (weight_slot[0] + weight_slot[1]);
  whole += 2 * (grad_slot[0] + grad_slot[1]);
  if (shards > 0) shards_.emplace("bf16 weight shards", compute, device_, shards);
  if (gathered > 0) gathered_.emplace(separate_working ? "bf16 gathered weights" : "gathered weights", compute, device_, gathered);
  if (whole > 0) whole_grads_.emplace("whole gradients", DType::f32, device_, whole);
  int64_t at_shard = 0, at_gathered = 0, at_whole = 0;
  auto take = [](const std::optional<Arena>& a, int64_t& at, int64_t n) {
    at += n;
    return a->slice(at - n, {n});
  };
  for (Unit& u : units_) {
    if (u.weights_kept && (separate_working || u.n > 1)) {
      u.gathered = take(gathered_, at_gathered, u.n * u.chunk);
      u.working = separate_working ? u.gathered.rows(u.group->rank() * u.chunk, (u.group->rank() + 1) * u.chunk) : u.shard(params_);
    } else if (u.weights_kept) {
      u.gathered = u.working = u.shard(params_);
    } else if (!u.cast) {
      u.working = separate_working ? take(shards_, at_shard, u.chunk) : u.shard(params_);
    }
    if (u.grads_kept) u.whole_grad = u.n > 1 ? take(whole_grads_, at_whole, u.n * u.chunk) : u.shard(grads_);
  }
  for (size_t kind = 0; kind < 2; ++kind)
    for (Slot& s : slots_[kind]) {
      if (weight_slot[kind] > 0) s.weights = take(gathered_, at_gathered, weight_slot[kind]);
      if (grad_slot[kind] > 0) s.grad = take(whole_grads_, at_whole, grad_slot[kind]);
    }
}

// The model's views (weights_, gradients_), the gradient ranges zeroed before use, the checkpoint
// pieces.
void ShardedParameters::place(const std::vector<TensorSpec>& specs) {
  for (Unit& u : units_) {
    const Tensor weights = u.weights_kept ? u.gathered : slot(u, u.stage).weights;
    const Tensor grad = u.grads_kept ? u.whole_grad : slot(u, u.stage).grad;
    weights_.place(u.begin, weights.rows(0, u.numel));
    gradients_.place(u.begin, grad.rows(0, u.numel));
    const int64_t own_first = u.begin + u.group->rank() * u.chunk, own_end = std::min(u.begin + u.numel, own_first + u.chunk);
    for (size_t i = 0; i < specs.size(); ++i) {
      const TensorSpec& s = specs[i];
      if (s.offset < u.begin || s.offset >= u.begin + u.numel) continue;
      const bool decoder = !u.norms && u.stage >= 0 && u.stage < num_layers_;
      if (!s.first_backward_writes) u.zeroed.push_back(grad.rows(s.offset - u.begin, s.offset - u.begin + s.numel));
      else if (decoder) first_writes_slotted_ = first_writes_slotted_ || !u.grads_kept;
      else MARROW_CHECK(u.grads_kept, "internal: {} is marked first_backward_writes outside the decoder layers but not kept whole", s.name);
      const int64_t first = std::max(s.offset, own_first), end = std::min(s.offset + s.numel, own_end);
      if (first < end) pieces_.push_back({i, first - s.offset, end - first, u.offset + first - own_first});
    }
  }
  for (const Unit& u : units_)
    for (const TensorSpec& s : specs)
      MARROW_CHECK(!s.first_backward_writes || u.norms || u.stage < 0 || u.stage >= num_layers_ || s.offset < u.begin ||
                       s.offset >= u.begin + u.numel || u.grads_kept != first_writes_slotted_,
                   "internal: decoder-layer gradients marked first_backward_writes are in kept and slotted units alike");
}

// Other pipeline ranks' tensors, each run of consecutive ones as one range (a model view may span
// several tensors, as the fused expert weights do).
void ShardedParameters::place_absent(const std::vector<TensorSpec>& specs, const std::vector<int64_t>& stage_chunk, DType compute) {
  for (size_t i = 0; i < specs.size();) {
    size_t end = i;
    while (end < specs.size() && stage_chunk[size_t(specs[end].layer + 1)] < 0) ++end;
    if (end > i) {
      const int64_t begin = specs[i].offset, numel = specs[end - 1].offset + specs[end - 1].numel - begin;
      weights_.place_absent(begin, numel, compute, device_);
      gradients_.place_absent(begin, numel, DType::f32, device_);
    }
    i = std::max(end, i + 1);
  }
}

std::vector<const Arena*> ShardedParameters::arenas() const {
  std::vector<const Arena*> all{&params_, &grads_, &exp_avg_, &exp_avg_sq_};
  for (const std::optional<Arena>* a : {&shards_, &gathered_, &whole_grads_})
    if (*a) all.push_back(&**a);
  return all;
}

void ShardedParameters::initialize(const std::function<void(Tensor, const TensorSpec&, int64_t)>& init) const {
  const Arena& master = master_staging();
  fill_zero(master.all());  // the padding of each unit's last chunk
  for (const TensorPiece& p : pieces_) init(master.slice(p.offset, {p.count}), specs_[p.spec], p.first);
}

void ShardedParameters::master_changed() {
  ++weights_generation();
  forget_slots();
  for (size_t i : update_order_) {
    Unit& u = units_[i];
    if (split_) split_f32(u.working, u.shard(params_), u.shard(grads_));
    else if (u.working.data != nullptr && u.working.data != u.shard(params_).data) cast(u.working, u.shard(params_));
    gather_kept(u);
  }
  release_master_staging();
}

void ShardedParameters::unpack_master() const {
  if (!split_) return;
  for (const Unit& u : units_) join_f32(u.shard(grads_), u.working, u.shard(params_));
}

// The gradients' zeros again, which the step's start and the known-zero flags count on.
void ShardedParameters::release_master_staging() const {
  if (split_) fill_zero(grads_.all());
}

void ShardedParameters::forget_slots() {
  for (int kind = 0; kind < 2; ++kind)
    for (Slot& s : slots_[size_t(kind)]) s.holds = -1;
}

void ShardedParameters::gather_kept(Unit& u) {
  if (!u.weights_kept || u.n == 1) return;
  u.group->all_gather(u.gathered, u.working, "weights all_gather (kept)", false);
  u.gathered_at = u.group->queued();
}

namespace {

// Appends t to ranges, or extends the last range when t follows it in memory: the gradients a step
// zeroes lie mostly side by side, and one memset a run leaves the same zeros with fewer launches.
void add_range(std::vector<Tensor>& ranges, const Tensor& t) {
  if (!ranges.empty()) {
    const Tensor& last = ranges.back();
    if (last.dtype == t.dtype && last.device == t.device && static_cast<const char*>(last.data) + last.bytes() == t.data) {
      ranges.back() = Tensor(last.data, last.dtype, last.device, {last.numel() + t.numel()});
      return;
    }
  }
  ranges.push_back(t.reshape({t.numel()}));
}

}  // namespace

void ShardedParameters::start_step(std::span<const KnownZeroGrads> known) {
  std::vector<Tensor> zero_ranges;
  for (const Unit& u : units_) {
    if (!u.grads_kept) continue;
    for (const Tensor& t : u.zeroed) {
      const auto k = std::find_if(known.begin(), known.end(), [&](const KnownZeroGrads& g) { return g.grad.data == t.data; });
      if (k == known.end()) {
        add_range(zero_ranges, t);
        continue;
      }
      MARROW_CHECK(k->grad.numel() == t.numel() && final_after_backward(u),
                   "internal: known-zero gradient of {} elements at stage {} is not one whole final gradient", k->grad.numel(), u.stage);
      restart_known_zero(t, k->flags);
    }
  }
  for (const Tensor& t : zero_ranges) fill_zero(t);
}

void ShardedParameters::gather_slot(const Unit& u, int64_t layer) {
  Slot& s = slot(u, layer);
  if (s.holds == layer) return;
  s.holds = layer;
  if (u.cast) {
    s.gathered_at = cast_into_slot(s.weights.rows(0, u.numel), u.shard(params_));
    return;
  }
  u.group->all_gather(s.weights.rows(0, u.n * u.chunk), u.working, "weights all_gather (layer)", false);
  s.gathered_at = u.group->queued();
}

// The cast starts after everything the compute stream has queued so far, which includes the last
// use of the slot's previous layer.
Comm::Point ShardedParameters::cast_into_slot(Tensor weights, Tensor master) {
#if MARROW_CUDA
  if (cast_stream_) {
    auto stream = static_cast<cudaStream_t>(cast_stream_.get());
    auto event = [] {
      cudaEvent_t e = nullptr;
      MARROW_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      return std::shared_ptr<void>(e, [](void* p) { cudaEventDestroy(static_cast<cudaEvent_t>(p)); });
    };
    const std::shared_ptr<void> queued = event(), done = event();
    MARROW_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(queued.get()), nullptr));
    MARROW_CUDA_CHECK(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(queued.get()), 0));
    cast(weights, master, Stream{stream});
    MARROW_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(done.get()), stream));
    return {done};
  }
#endif
  cast(weights, master);  // on the compute stream, which uses it next: nothing to wait for
  return {};
}

void ShardedParameters::wait_for_weights(int64_t stage, bool backward) {
  for (size_t i : by_stage_[size_t(stage + 1)]) {
    const Unit& u = units_[i];
    if (u.weights_kept) {
      u.group->wait_for(u.gathered_at);
    } else {
      gather_slot(u, stage);
      u.group->wait_for(slot(u, stage).gathered_at);
    }
    if (!backward || u.grads_kept) continue;
    u.group->wait_for(slot(u, stage).reduced_at);  // the slot's previous gradient is scattered
    for (const Tensor& t : u.zeroed) fill_zero(t);
  }
}

// The next layer's gather runs while this stage computes.
void ShardedParameters::prefetch(int64_t layer) {
  if (layer < 0 || layer >= num_layers_) return;
  for (size_t i : by_stage_[size_t(layer + 1)])
    if (!units_[i].weights_kept) gather_slot(units_[i], layer);
}

void ShardedParameters::before_forward(int64_t stage) {
  wait_for_weights(stage, false);
  prefetch(stage + 1);
}

void ShardedParameters::before_backward(int64_t stage) {
  wait_for_weights(stage, true);
  prefetch(stage - 1);
}

void ShardedParameters::reduce_kept(const Unit& u) {
  if (u.n > 1) u.group->reduce_scatter_sum(u.shard(grads_), u.whole_grad, "gradient reduce_scatter (kept)", false, false);
  else mesh_.replicas.all_reduce_sum(u.shard(grads_), "gradient all_reduce (replicas)", false);
}

void ShardedParameters::after_backward(int64_t stage, int64_t micro, bool last, bool overlap) {
  for (size_t i : by_stage_[size_t(stage + 1)]) {
    const Unit& u = units_[i];
    if (!u.grads_kept) {
      Slot& s = slot(u, stage);
      u.group->reduce_scatter_sum(u.shard(grads_), s.grad.rows(0, u.n * u.chunk), "gradient reduce_scatter (layer)", micro > 0, false);
      s.reduced_at = u.group->queued();
    } else if (last && overlap) {
      reduce_kept(u);
    }
  }
}

void ShardedParameters::finish_gradients(bool overlapped) {
  if (!overlapped)
    for (int64_t stage = num_layers_; stage >= -1; --stage)
      for (size_t i : by_stage_[size_t(stage + 1)])
        if (units_[i].grads_kept) reduce_kept(units_[i]);
  mesh_.shard.join();
  mesh_.expert_shard.join();
  // Sharded units' replica sums wait for their scatters (another stream), so they start here.
  for (const Unit& u : units_)
    if (u.n > 1) mesh_.replicas.all_reduce_sum(u.shard(grads_), "gradient all_reduce (replicas)", false);
  mesh_.replicas.join();
}

bool ShardedParameters::grads_final(int64_t stage) const {
  bool any = false;
  for (const Unit& u : units_) {
    if (u.expert || u.stage != stage) continue;
    if (!final_after_backward(u)) return false;
    any = true;
  }
  return any;
}

bool ShardedParameters::expert_grads_final() const {
  if (mesh_.replicas.size() > 1) return false;
  for (const Unit& u : units_)
    if (u.expert && (u.n > 1 || !u.grads_kept)) return false;
  return true;
}

double ShardedParameters::local_squares(std::span<const Tensor> expert_squares, std::span<const KnownZeroGrads> known) const {
  auto fused = [&](const Unit& u) {
    return u.expert && u.stage >= 0 && size_t(u.stage) < expert_squares.size() && expert_squares[size_t(u.stage)].data != nullptr;
  };
  int64_t pieces = 1;  // runs of unfused units, and the fused units between them
  for (size_t i = 0; i < units_.size(); ++i)
    if (fused(units_[i]) || (i > 0 && fused(units_[i - 1]))) ++pieces;
  Buffer parts(DType::f64, device_, {pieces * kSumParts});
  int64_t piece = 0, run_begin = 0, run_end = 0;
  auto part = [&] { return parts.view().rows(piece * kSumParts, (piece + 1) * kSumParts); };
  // The known gradient inside the run [run_begin, run_end) of the arena, if any.
  auto known_rows = [&]() -> std::optional<KnownZeroRows> {
    std::optional<KnownZeroRows> rows;
    for (const KnownZeroGrads& k : known) {
      const int64_t at = (static_cast<const char*>(k.grad.data) - static_cast<const char*>(grads_.all().data)) / 4;
      if (at < run_begin || at >= run_end) continue;
      MARROW_CHECK(!rows, "internal: two known-zero gradients in one run of the gradient norm (elements {}..{})", run_begin, run_end);
      rows = KnownZeroRows{k.flags, at - run_begin, k.grad.numel() / k.flags.numel()};
    }
    return rows;
  };
  auto end_run = [&] {
    if (run_end == run_begin) return;
    const Tensor run = grads_.slice(run_begin, {run_end - run_begin});
    if (const auto rows = known_rows()) sum_squares_parts(part(), run, *rows);
    else sum_squares_parts(part(), run);
    ++piece;
  };
  for (const Unit& u : units_) {
    if (!fused(u)) {
      run_end = u.offset + u.chunk;  // units lie one after another in the arena
      continue;
    }
    MARROW_CHECK(u.n == 1 && u.grads_kept && mesh_.replicas.size() == 1,
                 "internal: layer {}'s expert gradients are reduced after the backward, so their sums of squares cannot come from it", u.stage);
    end_run();
    sum_values_parts(part(), expert_squares[size_t(u.stage)]);
    ++piece;
    run_begin = run_end = u.offset + u.chunk;
  }
  end_run();
  return sum_parts_on_host(parts.view().rows(0, piece * kSumParts));
}

double ShardedParameters::gradient_norm(std::span<const Tensor> expert_squares, std::span<const KnownZeroGrads> known) const {
  const double squares = expert_squares.empty() ? std::pow(l2_norm(grads_.all()), 2) : local_squares(expert_squares, known);
  const double stage_squares = mesh_.shard.sum(squares, "gradient norm (sum of squares)");
  return std::sqrt(mesh_.pipeline.sum(stage_squares, "gradient norm over the pipeline (sum of squares)"));
}

std::vector<ShardedParameters::AdamWRun> ShardedParameters::adamw_runs(const Unit& u, std::span<const KnownZeroGrads> known,
                                                                       bool muon) const {
  const Tensor grad = u.shard(grads_);
  const auto* base = static_cast<const char*>(grad.data);
  std::vector<AdamWRun> inside;  // the known-zero gradients in the shard
  for (const KnownZeroGrads& k : known) {
    const auto* at = static_cast<const char*>(k.grad.data);
    if (at >= base && at < base + grad.bytes())
      inside.push_back({.begin = int64_t(at - base) / int64_t(dtype_size(grad.dtype)), .count = k.grad.numel(), .known = &k});
  }
  MARROW_CHECK(inside.empty() || (u.n == 1 && u.grads_kept), "internal: known-zero gradients in a sharded unit of stage {}", u.stage);
  const int64_t own = u.group->rank() * u.chunk;  // the shard's first element in the unit
  std::vector<int64_t> cuts{0, u.chunk};
  for (const auto& [begin, end] : u.undecayed)
    for (const int64_t at : {begin - own, end - own}) cuts.push_back(std::clamp<int64_t>(at, 0, u.chunk));
  for (const AdamWRun& k : inside) cuts.insert(cuts.end(), {k.begin, k.begin + k.count});
  if (muon)
    for (const Unit::MatrixRun& m : u.matrices)
      for (const int64_t at : {m.begin - own, m.end() - own}) cuts.push_back(std::clamp<int64_t>(at, 0, u.chunk));
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<AdamWRun> runs;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    AdamWRun r{cuts[i], cuts[i + 1] - cuts[i]};
    for (const auto& [begin, end] : u.undecayed) r.decayed = r.decayed && !(own + r.begin >= begin && own + r.begin < end);
    for (const Unit::MatrixRun& m : u.matrices)
      r.orthogonalized = r.orthogonalized || (muon && own + r.begin >= m.begin && own + r.begin < m.end());
    for (const AdamWRun& k : inside)
      if (!r.orthogonalized && k.begin <= r.begin && r.begin < k.begin + k.count) {
        MARROW_CHECK(k.begin == r.begin && k.count == r.count,
                     "internal: a known-zero gradient of stage {} spans tensors with and without weight decay", u.stage);
        r.known = k.known;
      }
    runs.push_back(r);
  }
  return runs;
}

void ShardedParameters::adamw_unit(const Unit& u, const AdamWHyper& hyper, std::span<const KnownZeroGrads> known, bool muon) {
  const bool separate = u.working.data != nullptr && u.working.data != u.shard(params_).data;
  auto part = [&](const Arena& a, int64_t begin, int64_t count) { return a.slice(u.offset + begin, {count}); };
  AdamWHyper undecayed = hyper;
  undecayed.weight_decay = 0;
  for (const AdamWRun& r : adamw_runs(u, known, muon)) {
    if (r.orthogonalized) continue;
    const Tensor working = separate ? u.working.reshape({u.chunk}).rows(r.begin, r.begin + r.count) : Tensor{};
    const Tensor params = part(params_, r.begin, r.count), exp_avg = part(exp_avg_, r.begin, r.count);
    const Tensor exp_avg_sq = part(exp_avg_sq_, r.begin, r.count), grads = part(grads_, r.begin, r.count);
    const AdamWHyper& h = r.decayed ? hyper : undecayed;
    if (r.known) adamw_step_known_zero(params, working, exp_avg, exp_avg_sq, grads, r.known->flags, h);
    else adamw_step(params, working, exp_avg, exp_avg_sq, grads, h);
  }
}

namespace {
// Matrices a Newton-Schulz call takes at most: its scratch for a layer's experts at once would be GBs.
constexpr int64_t kMuonBatch = 64;

DType orthogonalized_dtype(Device device) { return device == Device::cuda ? DType::bf16 : DType::f32; }

// Newton-Schulz of `count` [rows, cols] matrices from element `at` of from (f32) into to, batch by batch.
void orthogonalize(Tensor to, Tensor from, int64_t at, int64_t count, int64_t rows, int64_t cols, int steps) {
  for (int64_t first = 0; first < count; first += kMuonBatch) {
    const int64_t batch = std::min(kMuonBatch, count - first), begin = at + first * rows * cols, end = begin + batch * rows * cols;
    newton_schulz(to.rows(begin, end).reshape({batch, rows, cols}), from.rows(begin, end).reshape({batch, rows, cols}), steps);
  }
}
}  // namespace

void ShardedParameters::apply_orthogonalized(const Unit& u, int64_t first, int64_t count, Tensor orth, const Unit::MatrixRun& m,
                                             const AdamWHyper& hyper, const MuonHyper& muon) {
  const bool separate = u.working.data != nullptr && u.working.data != u.shard(params_).data;
  muon_apply(params_.slice(u.offset + first, {count}), separate ? u.working.reshape({u.chunk}).rows(first, first + count) : Tensor{},
             orth, hyper.lr, hyper.weight_decay, muon.scale * std::sqrt(double(std::max(m.rows, m.cols))));
}

void ShardedParameters::muon_local(const Unit& u, const AdamWHyper& hyper, const MuonHyper& muon) {
  for (const Unit::MatrixRun& m : u.matrices)
    for (int64_t first = 0; first < m.count; first += kMuonBatch) {
      const int64_t batch = std::min(kMuonBatch, m.count - first), at = m.begin + first * m.rows * m.cols, n = batch * m.rows * m.cols;
      Buffer update(DType::f32, device_, {n}), orth(orthogonalized_dtype(device_), device_, {n});
      muon_momentum(update, exp_avg_.slice(u.offset + at, {n}), grads_.slice(u.offset + at, {n}), muon.momentum, hyper.grad_scale);
      orthogonalize(orth, update, 0, batch, m.rows, m.cols, muon.steps);
      apply_orthogonalized(u, at, n, orth, m, hyper, muon);
    }
}

// A sharded unit's matrices are whole on no member: each member's momentum-updated shard is gathered
// whole, each member orthogonalizes the matrices it owns (a run's matrices cut into n blocks, block
// b owned by member (b + turn) % n, turn advancing with every run so that single matrices spread
// over the group too), and a reduce-scatter brings the results to their shards: every element has
// one non-zero term, so the sum is exact and the update that of one process.
void ShardedParameters::muon_unit(const Unit& u, const AdamWHyper& hyper, const MuonHyper& muon, int64_t& turn) {
  if (u.matrices.empty()) return;
  if (u.n == 1) return muon_local(u, hyper, muon);
  const int64_t own = u.group->rank() * u.chunk;
  // The shard's part [first, last) of run m, in shard elements.
  auto piece = [&](const Unit::MatrixRun& m) {
    return std::pair{std::clamp<int64_t>(m.begin - own, 0, u.chunk), std::clamp<int64_t>(m.end() - own, 0, u.chunk)};
  };
  Buffer update = Buffer::zeros(DType::f32, device_, {u.chunk}), whole(DType::f32, device_, {u.n * u.chunk});
  for (const Unit::MatrixRun& m : u.matrices)
    if (const auto [first, last] = piece(m); last > first)
      muon_momentum(update.view().rows(first, last), exp_avg_.slice(u.offset + first, {last - first}),
                    grads_.slice(u.offset + first, {last - first}), muon.momentum, hyper.grad_scale);
  u.group->all_gather(whole, update, "Muon update all_gather");
  Buffer orth = Buffer::zeros(orthogonalized_dtype(device_), device_, {u.n * u.chunk});
  for (const Unit::MatrixRun& m : u.matrices) {
    for (int64_t b = 0; b < u.n; ++b) {
      const int64_t first = b * m.count / u.n, count = (b + 1) * m.count / u.n - first;
      if ((b + turn) % u.n == u.group->rank())
        orthogonalize(orth, whole, m.begin + first * m.rows * m.cols, count, m.rows, m.cols, muon.steps);
    }
    ++turn;
  }
  Buffer mine(orthogonalized_dtype(device_), device_, {u.chunk});
  u.group->reduce_scatter_sum(mine, orth, "Muon update reduce_scatter");
  for (const Unit::MatrixRun& m : u.matrices)
    if (const auto [first, last] = piece(m); last > first)
      apply_orthogonalized(u, first, last - first, mine.view().rows(first, last), m, hyper, muon);
}

void ShardedParameters::optimizer_step(const AdamWHyper& hyper, std::span<const KnownZeroGrads> known, const MuonHyper* muon) {
  ++weights_generation();
  forget_slots();
  int64_t turn = 0;
  // In the order the next forward needs them, each unit's gather starting as soon as it is updated.
  for (size_t i : update_order_) {
    Unit& u = units_[i];
    if (muon) muon_unit(u, hyper, *muon, turn);
    adamw_unit(u, hyper, known, muon != nullptr);
    gather_kept(u);
  }
}

}  // namespace marrow
