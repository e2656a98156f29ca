// One step's micro-batches on one pipeline rank, in the order parallel/dualpipev.h gives: each op
// of the order runs a forward, a backward, a deferred weights pass or a forward overlapped with a
// backward (engine/step.h) on one of the rank's two chunks, taking its input from the previous
// chunk and handing its output to the next: through the pipeline links (parallel/pipeline_links.h)
// when that chunk is on another rank, directly at the turn of the V (the last rank holds chunks
// PP - 1 and PP). Messages are one fixed shape: [tokens, hidden] in the compute dtype.
// DualPipeV (parallel.pp > 1 or parallel.schedule = dualpipev) implies keep_gathered and
// keep_whole_grads; a pipeline rank's Weights views of other ranks' layers have data == nullptr.
#pragma once
#include <functional>
#include <map>
#include <optional>
#include <tuple>
#include <vector>

#include "engine/step.h"
#include "parallel/dualpipev.h"
#include "parallel/pipeline_links.h"

namespace marrow {

template <MoeModel M> class PipelineStep {
 public:
  struct Setup {
    const M& model;
    const typename M::Weights& w;
    const typename M::Weights& g;
    int64_t pp = 1, pp_rank = 0;
    std::vector<PipelineChunk> chunks;  // all 2 x pp
    const PipelineLinks* links = nullptr;
    StageTimer* timer = nullptr;
    bool gathers_expert_inputs = false;  // MicroBatch::gathers_expert_inputs of every micro-batch
  };
  using Batches = std::function<typename M::Batch(int64_t micro)>;
  using Groups = std::function<StepGroups(int64_t micro)>;

  // backward: loss_scale and aux_grad of every backward; first_writes(micro): whether that
  // micro-batch's backward writes the first_backward_writes gradients.
  PipelineStep(Setup setup, int64_t micro_batches, Batches batches, Groups groups, typename BackwardPass<M>::Options backward,
               std::function<bool(int64_t)> first_writes)
      : s_(std::move(setup)), n_(micro_batches), batches_(std::move(batches)), groups_(std::move(groups)), backward_(backward),
        first_writes_(std::move(first_writes)), batch_(size_t(n_)), mb_(2) {
    for (auto& phase : mb_) phase.resize(size_t(n_));
  }

  // Runs the ops in order; forward_only drops each micro-batch's activations after its forward
  // (evaluation). Returns this rank's sums of token losses and load-balance losses.
  std::pair<double, double> run(const std::vector<PipelineOp>& order, bool forward_only = false) {
    for (const PipelineOp& op : order) {
      switch (op.kind) {
        case PipelineOp::forward: forward(op.phase, op.micro, forward_only); break;
        case PipelineOp::backward: backward(op.phase, op.micro, op.defer_weights); break;
        case PipelineOp::weights:
          weights_backward(mb(op.phase, op.micro), s_.model, s_.g, first_writes_(op.micro), s_.timer, backward_.expert_squares,
                           backward_.expert_known_zero);
          break;
        case PipelineOp::forward_backward: forward_backward(op); break;
      }
      executed_.push_back(op);
    }
    if (s_.links) s_.links->wait_sends();
    sent_.clear();
    return {token_loss_.value(), aux_loss_.value()};
  }
  // The ops run so far, in the order they ran.
  const std::vector<PipelineOp>& executed() const { return executed_; }

 private:
  int64_t chunk_index(int phase) const { return phase == 0 ? s_.pp_rank : 2 * s_.pp - 1 - s_.pp_rank; }
  PipelineChunk chunk(int phase) const { return s_.chunks[size_t(chunk_index(phase))]; }
  bool turn_of_the_v() const { return s_.pp_rank == s_.pp - 1; }
  MicroBatch<M>& mb(int phase, int64_t micro) { return mb_[size_t(phase)][size_t(micro)]; }
  const typename M::Batch& batch(int64_t micro) {
    if (!batch_[size_t(micro)]) batch_[size_t(micro)].emplace(batches_(micro));
    return *batch_[size_t(micro)];
  }
  Buffer message(int64_t micro) {
    const typename M::Batch& b = batch(micro);
    return s_.model.buffer({b.batch * b.seq, s_.model.hidden_size()});
  }

  // A chunk's input: for a forward the previous chunk's output (none for chunk 0), for a backward
  // the next chunk's input gradient (none for the last chunk).
  Buffer input(bool forward, int phase, int64_t micro) {
    if (chunk_index(phase) == (forward ? 0 : 2 * s_.pp - 1)) return {};
    if (phase == (forward ? 1 : 0) && turn_of_the_v()) return take_local(forward, micro);
    Buffer t = message(micro);
    const auto [comm, peer] = link(forward, phase, false);
    comm.recv(t, peer, label(forward, phase, "recv").c_str());
    return t;
  }
  void output(bool forward, int phase, int64_t micro, Buffer t) {
    if (chunk_index(phase) == (forward ? 2 * s_.pp - 1 : 0)) return;
    if (phase == (forward ? 0 : 1) && turn_of_the_v()) return put_local(forward, micro, std::move(t));
    const auto [comm, peer] = link(forward, phase, true);
    comm.send(t, peer, label(forward, phase, "send").c_str());
    sent_.push_back(std::move(t));
  }
  // Forwards of phase 0 and backwards of phase 1 travel down the ranks, the other two up: a sender
  // uses the link in that direction, a receiver the other; the peer is the link's other member.
  std::pair<const Comm&, int> link(bool forward, int phase, bool send) const {
    const bool down = (forward == (phase == 0)) == send;
    const size_t kind = size_t((forward ? PipelineLinks::forward0 : PipelineLinks::backward0) + phase);  // the enum's order
    return {(down ? s_.links->down : s_.links->up)[kind], down ? 1 : 0};
  }
  static std::string label(bool forward, int phase, const char* direction) {
    return fmt::format("pipeline {}, phase {} ({})", forward ? "activations" : "gradients", phase, direction);
  }
  void put_local(bool forward, int64_t micro, Buffer t) { local_[{forward, micro}] = std::move(t); }
  Buffer take_local(bool forward, int64_t micro) {
    auto at = local_.find({forward, micro});
    MARROW_CHECK(at != local_.end(), "internal: DualPipeV order runs micro-batch {}'s {} before its input exists", micro,
                 forward ? "forward" : "backward");
    Buffer t = std::move(at->second);
    local_.erase(at);
    return t;
  }

  // training: the epilog may run its backward in the forward (MicroBatch::epilog_gradients).
  ForwardPass<M> forward_pass(int phase, int64_t micro, bool training) {
    if (training) mb(phase, micro).epilog_gradients = {&s_.g, backward_.loss_scale, micro == 0};
    mb(phase, micro).gathers_expert_inputs = s_.gathers_expert_inputs;
    return ForwardPass<M>(mb(phase, micro), s_.model, s_.w, batch(micro), chunk(phase), input(true, phase, micro), groups_(micro),
                          s_.timer);
  }
  BackwardPass<M> backward_pass(int phase, int64_t micro, bool defer) {
    typename BackwardPass<M>::Options options = backward_;
    options.first_micro_batch = first_writes_(micro);
    options.first_of_step = micro == 0;
    options.defer_expert_weights = defer;
    return BackwardPass<M>(mb(phase, micro), s_.model, s_.w, s_.g, batch(micro), chunk(phase), input(false, phase, micro), options,
                           groups_(micro), s_.timer);
  }
  void forward_done(int phase, int64_t micro, ForwardPass<M>& f, bool forward_only) {
    output(true, phase, micro, f.output());
    token_loss_.add(std::move(mb(phase, micro).token_loss));
    aux_loss_.add(std::move(mb(phase, micro).aux_loss));
    if (forward_only) mb(phase, micro) = MicroBatch<M>{};
  }
  void forward(int phase, int64_t micro, bool forward_only) {
    ForwardPass<M> f = forward_pass(phase, micro, !forward_only);
    run_pass(f);
    forward_done(phase, micro, f, forward_only);
  }
  void backward(int phase, int64_t micro, bool defer) {
    BackwardPass<M> b = backward_pass(phase, micro, defer);
    run_pass(b);
    output(false, phase, micro, b.output());
  }
  void forward_backward(const PipelineOp& op) {
    ForwardPass<M> f = forward_pass(op.phase, op.micro, true);
    BackwardPass<M> b = backward_pass(1 - op.phase, op.back_micro, false);
    marrow::forward_backward(f, b);
    forward_done(op.phase, op.micro, f, false);
    output(false, 1 - op.phase, op.back_micro, b.output());
  }

  Setup s_;
  int64_t n_;
  Batches batches_;
  Groups groups_;
  typename BackwardPass<M>::Options backward_;
  std::function<bool(int64_t)> first_writes_;
  std::vector<std::optional<typename M::Batch>> batch_;
  std::vector<std::vector<MicroBatch<M>>> mb_;  // [phase][micro]
  std::map<std::pair<bool, int64_t>, Buffer> local_;  // (forward?, micro) handed over at the turn of the V
  std::vector<Buffer> sent_;                          // alive until the sends complete
  std::vector<PipelineOp> executed_;
  HostSum token_loss_, aux_loss_;  // read once the step's work is queued
};

// Evaluation through the pipeline: each micro-batch's forward down and back up the V.
inline std::vector<PipelineOp> forward_only_order(int64_t micro_batches) {
  std::vector<PipelineOp> order;
  for (int64_t i = 0; i < micro_batches; ++i)
    for (int phase : {0, 1}) order.push_back({PipelineOp::forward, phase, i});
  return order;
}

}  // namespace marrow
