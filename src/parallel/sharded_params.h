// Fully sharded data parallelism (ZeRO-3, and HSDP with parallel.dp_shard; DESIGN.md §5) for any
// model whose parameter table (core/tensor_spec.h) tells each tensor's stage.
//
// The table is cut into units, each a contiguous range of the model's layout: the prolog, each
// decoder layer's dense tensors, each layer's expert tensors, the epilog, and the norms of each
// pipeline chunk together; a pipeline rank has only its chunks' units. A unit of N elements is cut
// into n chunks of c = ceil(N / n) (the last padded with zeros) over its shard group: expert units
// over the dp_shard x cp ranks holding the same experts (Mesh::expert_shard), the others over
// dp_shard x cp x ep (Mesh::shard). Member r owns elements [r c, (r + 1) c): their fp32 master
// weights, gradients and AdamW moments, units in table order. Replicas (Mesh::replicas) sum their
// gradients.
//
// One step of a unit:
//   weights  AdamW writes the compute-dtype shard (on the CPU the fp32 master itself serves), which
//            is all-gathered on the communication stream: kept units (prolog, epilog, norms; all
//            with parallel.keep_gathered) right after the update, decoder layers one layer ahead of
//            each forward and backward through two slots (layer l in slot l % 2).
//   grads    The backward writes a whole fp32 gradient. Decoder layers write it into two slots and
//            reduce-scatter it after each micro-batch into the owner's shard; kept units (all with
//            parallel.keep_whole_grads) accumulate it whole and reduce-scatter once, as soon as the
//            last micro-batch's backward has passed the stage. Replicas then sum the shards.
// A unit with n = 1 is neither gathered nor scattered (plain replicated data parallelism). With
// cast_on_use (GPU) such a decoder-layer unit keeps no compute copy: its fp32 master is cast into the
// layer's slot before each use. With split_master (GPU) the master is kept split (core/split_f32.h):
// its high halves are the compute-dtype shard, its low halves the params() arena (u16), 4 bytes a
// parameter instead of 6; initial values and checkpoints pass through master_staging() (the fp32
// gradient arena, empty between an optimizer step and the next backward).
// The model binds its views through a Placement, never to shard arenas. A new parameter must keep
// each unit (prolog, a layer's dense tensors, a layer's experts, epilog, all norms) contiguous in the
// spec table, or setup fails with an internal error. With split master weights (the GPU's default)
// params() holds bf16 high halves and u16 low halves (4 bytes a parameter for master and copy, 6
// with "fp32"); anything new that reads params() as fp32 goes through master_staging(): write it,
// then master_changed() (which zeroes it again); for a save unpack_master(), then
// release_master_staging() (TrainLoop::save_checkpoint). train.bf16_weight_copy=false needs
// master_weights = "fp32" and runs only on the GPU (the CPU computes on the fp32 master): layers are
// cast into the FSDP slots; tools/gpu_attention.sh long checks its losses bit for bit.
#pragma once
#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "core/memory.h"
#include "core/tensor_spec.h"
#include "ops/adamw.h"
#include "parallel/mesh.h"

namespace marrow {

// Muon's own hyperparameters (ops/muon.h); its lr, weight decay and gradient scale are AdamW's.
struct MuonHyper {
  double momentum = 0.95, scale = 0.2;  // the update scaled by scale * sqrt(max(rows, cols))
  int steps = 5;
};

class ShardedParameters {
 public:
  // compute: the model's dtype. stage_chunk[stage + 1]: the pipeline chunk holding each stage, -1
  // for another pipeline rank's. moments: f32 or bf16 (ops/adamw.h). split_master takes effect with
  // a bf16 compute dtype and excludes cast_on_use (the split keeps the compute copy).
  ShardedParameters(const std::vector<TensorSpec>& specs, int64_t num_layers, const std::vector<int64_t>& stage_chunk, const Mesh& mesh,
                    bool keep_gathered, bool keep_whole_grads, bool cast_on_use, Device device, DType compute,
                    DType moments = DType::f32, bool split_master = false);
  ShardedParameters(const ShardedParameters&) = delete;
  ShardedParameters& operator=(const ShardedParameters&) = delete;

  // This rank's shards in table order, fp32 (moments in their dtype; split master: u16 low halves).
  const Arena& params() const { return params_; }
  const Arena& grads() const { return grads_; }
  const Arena& exp_avg() const { return exp_avg_; }
  const Arena& exp_avg_sq() const { return exp_avg_sq_; }
  // Every allocation of this rank, for the memory bill.
  std::vector<const Arena*> arenas() const;
  // Where the model's weights (what it computes with) and gradients (what its backward writes) live.
  const Placement& weights() const { return weights_; }
  const Placement& gradients() const { return gradients_; }
  // The slices of the canonical tensors in the shard arenas, in arena order.
  const std::vector<TensorPiece>& pieces() const { return pieces_; }
  // Replica 0 of each shard saves it.
  bool saves_checkpoint() const { return saves_; }

  // Fills the master shards: init(out, spec, first) writes elements [first, first + out.numel()) of
  // the whole tensor's initial values into master_staging(); master_changed() takes them up.
  void initialize(const std::function<void(Tensor, const TensorSpec&, int64_t)>& init) const;
  // The fp32 master shards laid out as params(): params() itself, or with the split master the
  // gradient arena, between unpack_master() (or a checkpoint's load) and master_changed() /
  // release_master_staging(). Only outside a step.
  const Arena& master_staging() const { return split_ ? grads_ : params_; }
  bool split_master() const { return split_; }
  // After master_staging() was written (initial values, a checkpoint): the compute copies follow.
  void master_changed();
  // The master shards into master_staging(), released after they were read (a checkpoint's save).
  void unpack_master() const;
  void release_master_staging() const;

  // Gradients (views into gradients()) with row flags of ops/known_zero.h: flags[r] set means row r
  // of grad is all zeros. Only where grads_final() holds for their unit.
  struct KnownZeroGrads {
    Tensor grad, flags;
  };

  // One step: start_step; per micro-batch the forward and backward with the hooks below;
  // finish_gradients; gradient_norm; optimizer_step. start_step zeroes the gradients the backward
  // adds to, those of `known` by the rows written since (restart_known_zero).
  void start_step(std::span<const KnownZeroGrads> known = {});
  void before_forward(int64_t stage);
  void before_backward(int64_t stage);
  // micro: the micro-batch's index in the step; last: it is the step's last one.
  void after_backward(int64_t stage, int64_t micro, bool last, bool overlap);
  // Whether this micro-batch's backward writes (not adds to) the decoder layers'
  // first_backward_writes gradients (the epilog's, always kept whole: micro == 0).
  bool first_writes_fresh(int64_t micro) const { return micro == 0 || first_writes_slotted_; }
  // Whether those gradients add up over a step's micro-batches in one place (not slotted).
  bool expert_grads_accumulate() const { return !first_writes_slotted_; }
  // The reductions not started during the backward; the compute stream then waits for all.
  void finish_gradients(bool overlapped);
  // The global gradient norm, each element counted once (summed over the shard group, then the
  // pipeline, in rank order). expert_squares[l], where given (only where expert_grads_final()),
  // holds parts summing to layer l's expert gradients' squares, so that unit is not read; the sums
  // then run on the device and reach the host in one copy. known: flagged rows are not read (at
  // most one such gradient per run of units between the fused ones).
  double gradient_norm(std::span<const Tensor> expert_squares = {}, std::span<const KnownZeroGrads> known = {}) const;
  // Whether every expert unit's gradient is complete once the last backward wrote it (n = 1, no
  // replicas); grads_final the same for one stage's other units (false where none is held).
  bool expert_grads_final() const;
  bool grads_final(int64_t stage) const;
  // AdamW on the shards (norms and biases undecayed; known's flagged rows read as zero), with muon
  // Muon on the orthogonalized matrices instead (momentum in exp_avg()); then the compute copies are
  // gathered again.
  void optimizer_step(const AdamWHyper& hyper, std::span<const KnownZeroGrads> known = {}, const MuonHyper* muon = nullptr);

 private:
  struct Unit {
    int64_t stage = 0;  // -1 prolog (and the norms), 0..L-1 decoder layers, L epilog
    bool expert = false, norms = false;
    int64_t begin = 0, numel = 0;  // in the model's layout
    const Comm* group = nullptr;
    int64_t n = 1, chunk = 0, offset = 0;  // shard group size, chunk, place in the shard arenas
    bool weights_kept = true;              // the whole weights kept for the step (else slots)
    bool grads_kept = true;                // the whole gradient accumulated over the step (else slots)
    bool cast = false;                     // n == 1 in slots: cast from the master, no compute copy kept
    // [begin, end) in the unit's elements of tensors without weight decay (TensorSpec::decayed)
    std::vector<std::pair<int64_t, int64_t>> undecayed;
    // Runs of consecutive orthogonalized matrices of one shape, `count` [rows, cols] matrices from
    // element `begin` of the unit
    struct MatrixRun {
      int64_t begin, count, rows, cols;
      int64_t end() const { return begin + count * rows * cols; }
    };
    std::vector<MatrixRun> matrices;
    Tensor working;                        // the shard the optimizer writes, in the compute dtype
    Tensor gathered;                       // weights_kept: the whole unit, n * chunk elements
    Tensor whole_grad;                     // grads_kept: the whole fp32 gradient (n == 1: the shard)
    std::vector<Tensor> zeroed;            // gradient views a step (grads_kept) or a use (slots) starts at zero
    Comm::Point gathered_at;
    Tensor shard(const Arena& a) const { return a.slice(offset, {chunk}); }
  };
  struct Slot {
    Tensor weights, grad;
    int64_t holds = -1;  // the layer whose weights are in it, -1 when stale
    Comm::Point gathered_at, reduced_at;
  };

  static std::vector<Unit> cut_units(const std::vector<TensorSpec>& specs, int64_t num_layers, const std::vector<int64_t>& stage_chunk,
                                     const Mesh& mesh, bool keep_gathered, bool keep_whole_grads, bool cast_on_use);
  static int64_t shard_elements(const std::vector<Unit>& units);
  static void add_undecayed(Unit& u, const TensorSpec& s);
  static void add_matrices(Unit& u, const TensorSpec& s);
  void allocate(DType compute);
  void place(const std::vector<TensorSpec>& specs);
  void place_absent(const std::vector<TensorSpec>& specs, const std::vector<int64_t>& stage_chunk, DType compute);
  // After unit u's master shard changed: its kept weights are gathered anew.
  void gather_kept(Unit& u);
  // The slots' weights are stale (the master shards changed).
  void forget_slots();
  void gather_slot(const Unit& u, int64_t layer);
  // cast_on_use: the slot's weights from the master shard, on cast_stream_ (GPU); returns the point
  // the compute stream waits for.
  Comm::Point cast_into_slot(Tensor weights, Tensor master);
  // The compute stream waits for the stage's weights (and, in the backward, for its gradient slots).
  void wait_for_weights(int64_t stage, bool backward);
  void prefetch(int64_t layer);
  Slot& slot(const Unit& u, int64_t layer) { return slots_[u.expert ? 1 : 0][size_t(layer % 2)]; }
  void reduce_kept(const Unit& u);
  // A piece of a unit's shard that one AdamW call updates: one weight decay, at most one known-zero
  // gradient (whole).
  struct AdamWRun {
    int64_t begin = 0, count = 0;  // in the shard's elements
    bool decayed = true, orthogonalized = false;
    const KnownZeroGrads* known = nullptr;
  };
  // Unit u's shard cut where a tensor without weight decay or a known-zero gradient begins or ends,
  // and with muon where a run of orthogonalized matrices does.
  std::vector<AdamWRun> adamw_runs(const Unit& u, std::span<const KnownZeroGrads> known, bool muon) const;
  // AdamW on unit u's shard, run by run, but with muon those of orthogonalized matrices.
  void adamw_unit(const Unit& u, const AdamWHyper& hyper, std::span<const KnownZeroGrads> known, bool muon);
  // Muon on unit u's matrices: held whole (n = 1) batch by batch (muon_local), else through their
  // owners; turn spreads the owners of the group's matrices (muon_unit).
  void muon_unit(const Unit& u, const AdamWHyper& hyper, const MuonHyper& muon, int64_t& turn);
  void muon_local(const Unit& u, const AdamWHyper& hyper, const MuonHyper& muon);
  // muon_apply on elements [first, first + count) of u's shard from orth (as many), at run m's scale.
  void apply_orthogonalized(const Unit& u, int64_t first, int64_t count, Tensor orth, const Unit::MatrixRun& m, const AdamWHyper& hyper,
                            const MuonHyper& muon);
  // This rank's sum of squares of its gradient shards (see gradient_norm).
  double local_squares(std::span<const Tensor> expert_squares, std::span<const KnownZeroGrads> known) const;
  // Whether unit u's gradient is complete once the backward has written it (no reduction follows).
  bool final_after_backward(const Unit& u) const { return u.n == 1 && u.grads_kept && mesh_.replicas.size() == 1; }

  const std::vector<TensorSpec>& specs_;
  int64_t num_layers_;
  Device device_;
  const Mesh& mesh_;
  std::vector<Unit> units_;
  std::vector<std::vector<size_t>> by_stage_;  // units by stage + 1
  std::vector<size_t> update_order_;           // the order the forward needs the units in: norms, then by stage
  Arena params_, grads_, exp_avg_, exp_avg_sq_;
  std::optional<Arena> shards_, gathered_, whole_grads_;  // compute-dtype shards, whole copies, whole gradients
  std::array<std::array<Slot, 2>, 2> slots_;             // [dense, expert][layer % 2]
  Placement weights_, gradients_;
  std::vector<TensorPiece> pieces_;
  bool saves_ = true, first_writes_slotted_ = false, split_ = false;
  // cast_on_use's own GPU stream, so the next layer's cast overlaps this layer's compute.
  std::shared_ptr<void> cast_stream_;
};

}  // namespace marrow
