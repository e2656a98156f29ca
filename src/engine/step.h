// One micro-batch through the model, or one pipeline chunk of it: the engine's half of the
// five-stage contract. Stages 2 (dispatch) and 4 (combine) live here because with expert
// parallelism they are the all-to-alls (parallel/expert_parallel.h). A forward keeps what the
// backward consumes in a MicroBatch; ForwardPass and BackwardPass run a chunk one stage at a time,
// so a schedule can interleave one micro-batch's forward with another's backward stage by stage
// (forward_backward) and hide each all-to-all under the other's compute.
// With one process a layer's expert_offsets are in GPU memory: the grouped GEMMs build their
// schedules from them there, and nothing waits for the GPU between the optimizer and the gradient
// norm (losses are read through HostSum at the step's end). Code that wants the expert sizes on the
// host copies them (to_host, a wait for the GPU), never calls ptr<int32_t>() on them; with expert
// parallelism they are the route's host offsets.
// With one expert-parallel rank y_perm is freed after combine: aggregate_backward writes dout's
// copies unweighted, and the experts' backward applies the routing weights and writes their
// gradient (swiglu_weighted_backward, ops/swiglu.h). A model whose expert outputs are not linear in
// the last matrix's input cannot take this path (Qwen3's down projection is).
#pragma once
#include <functional>
#include <span>
#include <vector>

#include "engine/model.h"
#include "engine/stage_timer.h"
#include "ops/dispatch.h"
#include "ops/router.h"
#include "parallel/dualpipev.h"
#include "parallel/expert_parallel.h"

namespace marrow {

// The groups a micro-batch communicates with; both null for one process.
struct StepGroups {
  const ExpertParallel* experts = nullptr;  // the layer's experts are spread over this group
  const Comm* routing = nullptr;            // load-balance statistics are summed over this group
  // The step's routing totals, f64 [layers, E + 1] (router_step_statistics): each forward adds its
  // layers' summed statistics, in micro-batch order whatever the schedule; with global_balance the
  // load-balance loss takes its expert fractions from them. Empty: none (evaluation).
  Tensor step_totals;
  bool global_balance = false;
  // Before each stage's forward and backward (prolog -1, the layers, epilog num_layers): e.g. to
  // gather the stage's sharded weights.
  std::function<void(int64_t stage, bool forward)> before_stage;
  // Once a stage's gradients of this micro-batch are written: e.g. to start reducing them while
  // the stages below compute.
  std::function<void(int64_t stage)> layer_done;
};

template <MoeModel M> struct MicroBatch {
  struct Layer {
    typename M::AttentionActivations attention;
    typename M::ExpertActivations experts;
    Buffer expert_offsets, copy_row;
    Buffer y_perm;  // the expert outputs; kept for the backward only under expert parallelism
    ExpertRoute route;  // with expert parallelism, instead of expert_offsets and copy_row
  };
  std::vector<Layer> layers;
  typename M::EpilogActivations epilog;  // epilog.logits holds the logits until backward
  // Set by training (never by evaluation): lets M::epilog_forward run the epilog's backward at once.
  struct EpilogGradients {
    const typename M::Weights* grads = nullptr;
    double loss_scale = 1;
    bool overwrite = false;  // the step's first micro-batch: BackwardPass::Options::first_of_step
  } epilog_gradients;
  // One expert-parallel rank: x_perm dropped after each experts forward, gathered again from h2
  // for the backward (train.expert_inputs).
  bool gathers_expert_inputs = false;
  // Expert weight gradients a deferring backward left for weights_backward(), layers top down. With
  // one expert-parallel rank a layer keeps dout [T, H] and copy_row instead of dy_perm [T x K, H].
  struct DeferredExperts {
    int64_t layer;
    typename M::ExpertActivations experts;
    Buffer dy_perm, expert_offsets;
    Buffer dout, copy_row;
    Buffer take_dy_perm(const M& m) {
      if (dout.view().data == nullptr) return std::move(dy_perm);
      Buffer rows = m.buffer({copy_row.view().numel(), m.hidden_size()});
      m.aggregate_backward_rows(rows, dout, copy_row);
      dout = Buffer{};
      copy_row = Buffer{};
      return rows;
    }
  };
  std::vector<DeferredExperts> deferred;
  HostSum token_loss;  // cross-entropy summed over counted targets
  HostSum aux_loss;    // load-balance loss summed over layers (each layer's: ops/router.h)
  // The layers' load-balance losses summed on the device (f64 [1]) until the chunk's forward ends:
  // one host read per chunk, not per layer.
  Buffer aux_loss_total;
};

// The rows of x_perm gathered from h2 by the layer's plan (again, for the backward).
template <MoeModel M> Buffer gather_expert_rows(typename MicroBatch<M>::Layer& s, const M& m) {
  Buffer x_perm = m.buffer({s.copy_row.view().numel(), m.hidden_size()});
  dispatch_forward(x_perm, s.attention.h2, s.copy_row);
  return x_perm;
}

// Stage 2 of one process: all of a token's copies stay here. Returns x_perm.
template <MoeModel M> Buffer dispatch_local(typename MicroBatch<M>::Layer& s, const M& m) {
  const Tensor index = s.attention.topk_index;
  const int64_t T = index.size(0), K = index.size(1);
  // On the GPU the offsets stay in its memory: the grouped GEMMs build their schedules there, so the
  // plan does not wait for the GPU (ops/dispatch.h).
  s.expert_offsets = Buffer(DType::i32, m.device(), {m.num_experts() + 1});
  s.copy_row = Buffer(DType::i32, m.device(), {T, K});
  dispatch_plan(s.expert_offsets, s.copy_row, index);
  return gather_expert_rows<M>(s, m);
}

// Stages [-1, num_layers]: the whole model as one chunk.
template <MoeModel M> PipelineChunk whole_model(const M& m) { return {-1, m.num_layers()}; }

// The forward of one micro-batch through a chunk, one stage per step(): the prolog, each layer's
// attention, dispatch, experts and combine, the epilog. x: the chunk's input (empty before the
// prolog); output(): what it hands on (empty after the epilog). timer gets each stage's time.
template <MoeModel M> class ForwardPass {
 public:
  ForwardPass(MicroBatch<M>& mb, const M& m, const typename M::Weights& w, const typename M::Batch& batch, PipelineChunk chunk,
              Buffer x, StepGroups groups = {}, StageTimer* timer = nullptr)
      : mb_(mb), m_(m), w_(w), batch_(batch), chunk_(chunk), groups_(std::move(groups)), timer_(timer), stage_(chunk.first),
        x_(std::move(x)) {
    mb_.layers.resize(size_t(m.num_layers()));
    mb_.aux_loss_total = Buffer::zeros(DType::f64, m.device(), {1});
  }
  bool done() const { return stage_ > chunk_.last; }
  // The next step starts an exchange between processes (an expert all-to-all).
  bool next_communicates() const { return groups_.experts && stage_ >= 0 && stage_ < m_.num_layers() && part_ % 2 == 1; }
  // The next step plans an expert dispatch: the host waits for the layer's routing first.
  bool next_plans() const { return next_communicates() && part_ == 1; }
  Buffer output() {
    finish_combine();
    return std::move(x_);
  }

  void step() {
    advance();
    if (done()) read_aux_loss();
  }

 private:
  void advance() {
    const int64_t H = m_.hidden_size();
    finish_combine();
    if (stage_ < 0 || stage_ == m_.num_layers()) return end_step();
    auto& s = mb_.layers[size_t(stage_)];
    const auto& lw = w_.layers[size_t(stage_)];
    switch (part_) {
      case 0: {
        before(stage_);
        StageScope scope(timer_, Stage::attention);
        m_.attention_forward(s.attention, std::move(x_), batch_, lw);
        if (dense_layer(m_, stage_)) {  // the whole layer: the next one starts at its attention
          x_ = std::move(s.attention.x_mid);
          ++stage_;
          return;
        }
        if (groups_.routing) groups_.routing->all_reduce_sum(s.attention.routing_stats, "load-balance statistics (all_reduce)");
        if (groups_.step_totals.data)
          router_step_statistics(groups_.step_totals.rows(stage_, stage_ + 1).reshape({m_.num_experts() + 1}), s.attention.routing_stats,
                                 groups_.global_balance);
        m_.add_aux_loss(mb_.aux_loss_total, s.attention);
        if (groups_.experts) groups_.experts->plan_sends(s.route, s.attention.topk_index);
        break;
      }
      case 1: {
        StageScope scope(timer_, Stage::dispatch);
        if (groups_.experts) exchange_ = groups_.experts->start_dispatch(s.route, s.attention.h2, s.attention.topk_index, s.attention.topk_weight);
        else x_perm_ = dispatch_local<M>(s, m_);
        break;
      }
      case 2: {
        if (groups_.experts) {
          StageScope scope(timer_, Stage::dispatch);
          x_perm_ = groups_.experts->finish_dispatch(exchange_, s.route);
        }
        const Tensor offsets = groups_.experts ? s.route.expert_offsets.view() : s.expert_offsets.view();
        s.y_perm = m_.buffer({x_perm_.view().size(0), H});
        StageScope scope(timer_, Stage::experts);
        m_.experts_forward(s.y_perm, s.experts, std::move(x_perm_), offsets, lw);
        if (mb_.gathers_expert_inputs && !groups_.experts) m_.experts_drop_input(s.experts);
        break;
      }
      case 3: {
        StageScope scope(timer_, Stage::combine);
        if (groups_.experts) {
          exchange_ = groups_.experts->start_combine(s.y_perm, s.route);
          combining_ = stage_;
        } else {
          x_ = m_.buffer({batch_.batch * batch_.seq, H});
          m_.aggregate_forward(x_, s.attention, s.y_perm, s.copy_row);
          // The backward takes the routing weights' gradient from the experts instead (MoeModel's
          // aggregate_backward), so the largest activation of a layer goes now.
          s.y_perm = Buffer{};
        }
        ++stage_;
        break;
      }
    }
    part_ = (part_ + 1) % 4;
  }
  void read_aux_loss() {
    mb_.aux_loss.add(mb_.aux_loss_total);
    mb_.aux_loss_total = Buffer{};
  }
  // The residual after an expert-parallel layer exists once its combine has arrived: the step that
  // consumes it waits here, so the exchange overlaps whatever was queued in between.
  void finish_combine() {
    if (combining_ < 0) return;
    auto& s = mb_.layers[size_t(combining_)];
    x_ = m_.buffer({batch_.batch * batch_.seq, m_.hidden_size()});
    StageScope scope(timer_, Stage::combine);
    groups_.experts->finish_combine(x_, s.attention.x_mid, exchange_, s.route);
    combining_ = -1;
  }
  void before(int64_t stage) {
    if (groups_.before_stage) groups_.before_stage(stage, true);
  }
  void end_step() {
    before(stage_);
    if (stage_ < 0) {
      StageScope scope(timer_, Stage::prolog);
      x_ = m_.buffer({batch_.batch * batch_.seq, m_.hidden_size()});
      m_.prolog_forward(x_, batch_, w_);
    } else {
      StageScope scope(timer_, Stage::epilog);
      const auto& g = mb_.epilog_gradients;
      mb_.token_loss = m_.epilog_forward(mb_.epilog, std::move(x_), batch_, w_, g.grads, g.loss_scale, g.overwrite);
    }
    ++stage_;
  }

  MicroBatch<M>& mb_;
  const M& m_;
  const typename M::Weights& w_;
  const typename M::Batch& batch_;
  PipelineChunk chunk_;
  StepGroups groups_;
  StageTimer* timer_;
  int64_t stage_;
  int part_ = 0;  // within a decoder layer: attention, dispatch, experts, combine
  Buffer x_, x_perm_;
  ExpertParallel::Exchange exchange_;  // the layer's dispatch or combine in flight
  int64_t combining_ = -1;             // the layer whose combine is in flight
};

// Layer `layer`'s entry of a per-layer record of the expert gradients (expert_squares,
// expert_known_zero): empty where none is kept.
inline Tensor layer_record(std::span<const Tensor> records, int64_t layer) {
  return size_t(layer) < records.size() ? records[size_t(layer)] : Tensor{};
}

// The backward of one micro-batch through a chunk, one stage per step(), from the epilog down to
// the prolog, releasing activations as it goes. Gradients of (loss_scale * token_loss + aux_grad *
// aux_loss) accumulate into grads, except that first_micro_batch writes the layers'
// first_backward_writes gradients and first_of_step the epilog's. dx: the gradient of the chunk's
// output (empty at the epilog); output(): that of its input. defer_expert_weights leaves the expert
// weight gradients for weights_backward() or for the next micro-batch's backward (`earlier`), which
// computes both in one pass (experts_backward_weights_pair, the same bits as two). expert_squares[l]
// and expert_known_zero[l], where given, receive the sums of squares and known-zero flags of layer
// l's expert gradients as this backward writes them, so the gradient norm need not read them.
template <MoeModel M> class BackwardPass {
 public:
  struct Options {
    double loss_scale = 1, aux_grad = 0;
    bool first_micro_batch = false, defer_expert_weights = false;
    std::span<const Tensor> expert_squares = {};
    std::span<const Tensor> expert_known_zero = {};
    Tensor prolog_known_zero = {};  // the prolog's gradient row flags (the model's prolog_known_zero_parts)
    bool first_of_step = false;     // micro-batch 0: the epilog's first_backward_writes gradients are written
    std::vector<typename MicroBatch<M>::DeferredExperts>* earlier = nullptr;  // consumed, layer by layer
    bool earlier_overwrites = false;  // the earlier micro-batch writes first_backward_writes gradients
  };
  BackwardPass(MicroBatch<M>& mb, const M& m, const typename M::Weights& w, const typename M::Weights& grads,
               const typename M::Batch& batch, PipelineChunk chunk, Buffer dx, Options options, StepGroups groups = {},
               StageTimer* timer = nullptr)
      : mb_(mb), m_(m), w_(w), g_(grads), batch_(batch), chunk_(chunk), options_(options), groups_(std::move(groups)), timer_(timer),
        stage_(chunk.last), dx_(std::move(dx)) {}
  bool done() const { return stage_ < chunk_.first; }
  bool next_communicates() const {
    return groups_.experts && stage_ >= 0 && stage_ < m_.num_layers() && part_ % 2 == 0 && !dense_layer(m_, stage_);
  }
  Buffer output() { return std::move(dx_); }

  void step() {
    if (stage_ < 0 || stage_ == m_.num_layers()) return end_step();
    if (dense_layer(m_, stage_)) return dense();
    switch (part_) {
      case 0: return combine();
      case 1: return experts();
      case 2: return dispatch();
      case 3: return attention();
    }
  }

 private:
  typename MicroBatch<M>::Layer& layer() { return mb_.layers[size_t(stage_)]; }
  Tensor offsets() { return groups_.experts ? layer().route.expert_offsets.view() : layer().expert_offsets.view(); }
  void before(int64_t stage) {
    if (groups_.before_stage) groups_.before_stage(stage, false);
  }
  void done_with(int64_t stage) {
    if (groups_.layer_done) groups_.layer_done(stage);
  }
  void end_step() {
    before(stage_);
    if (stage_ < 0) {
      StageScope scope(timer_, Stage::prolog);
      m_.prolog_backward(g_, dx_, batch_, options_.prolog_known_zero);
      dx_ = Buffer{};
    } else {
      dx_ = m_.buffer({batch_.batch * batch_.seq, m_.hidden_size()});
      StageScope scope(timer_, Stage::epilog);
      m_.epilog_backward(dx_, g_, options_.loss_scale, mb_.epilog, batch_, w_, options_.first_of_step);
    }
    done_with(stage_);
    --stage_;
  }
  // A layer without experts in one step: its attention stage's backward is the whole layer's.
  void dense() {
    before(stage_);
    Buffer dx_in = m_.buffer({batch_.batch * batch_.seq, m_.hidden_size()});
    {
      StageScope scope(timer_, Stage::attention);
      m_.attention_backward(dx_in, g_.layers[size_t(stage_)], dx_, Tensor{}, Tensor{}, options_.aux_grad, layer().attention, batch_,
                            w_.layers[size_t(stage_)]);
    }
    dx_ = std::move(dx_in);
    layer() = typename MicroBatch<M>::Layer{};
    done_with(stage_);
    --stage_;
  }
  // With expert parallelism one step starts each exchange and the next finishes it.
  void combine() {
    auto& s = layer();
    const int64_t T = batch_.batch * batch_.seq, H = m_.hidden_size();
    dy_perm_ = m_.buffer({groups_.experts ? s.y_perm.view().size(0) : s.copy_row.view().numel(), H});
    dtopk_weight_ = m_.stats({T, m_.top_k()});
    before(stage_);
    StageScope scope(timer_, Stage::combine);
    if (groups_.experts) exchange_ = groups_.experts->start_combine_backward(dx_, s.route);
    else m_.aggregate_backward(dy_perm_, dtopk_weight_, dx_, s.attention, s.copy_row, s.experts);
    part_ = 1;
  }
  void experts() {
    auto& s = layer();
    if (groups_.experts) {
      StageScope scope(timer_, Stage::combine);
      dweight_recv_ = groups_.experts->finish_combine_backward(dy_perm_, s.y_perm, exchange_, s.route);
    }
    dx_perm_ = m_.buffer({dy_perm_.view().size(0), m_.hidden_size()});
    StageScope scope(timer_, Stage::experts);
    if (mb_.gathers_expert_inputs && !groups_.experts) m_.experts_restore_input(s.experts, gather_expert_rows<M>(s, m_));
    const auto& grads = g_.layers[size_t(stage_)];
    const Tensor squares = layer_record(options_.expert_squares, stage_), known_zero = layer_record(options_.expert_known_zero, stage_);
    auto* earlier = earlier_of_layer();
    m_.experts_backward_input(dx_perm_, dy_perm_, s.experts, offsets(), w_.layers[size_t(stage_)]);
    if (options_.defer_expert_weights) {
      Buffer& kept_offsets = groups_.experts ? s.route.expert_offsets : s.expert_offsets;
      // One process: dout and copy_row join the entry when attention() is done with them.
      mb_.deferred.push_back({stage_, std::move(s.experts), groups_.experts ? std::move(dy_perm_) : Buffer{}, std::move(kept_offsets), Buffer{}, Buffer{}});
    } else if (earlier != nullptr) {
      const Buffer earlier_dy_perm = earlier->take_dy_perm(m_);
      m_.experts_backward_weights_pair(grads, earlier_dy_perm, earlier->experts, earlier->expert_offsets.view(), dy_perm_, s.experts, offsets(),
                                       options_.earlier_overwrites, squares, known_zero);
      options_.earlier->erase(options_.earlier->begin() + (earlier - options_.earlier->data()));
    } else {
      m_.experts_backward_weights(grads, dy_perm_, s.experts, offsets(), options_.first_micro_batch, squares, known_zero);
    }
    dy_perm_ = Buffer{};
    part_ = 2;
  }
  // The earlier micro-batch's held expert inputs of this layer, if any.
  typename MicroBatch<M>::DeferredExperts* earlier_of_layer() {
    if (options_.earlier == nullptr) return nullptr;
    for (auto& d : *options_.earlier)
      if (d.layer == stage_) return &d;
    return nullptr;
  }
  void dispatch() {
    auto& s = layer();
    StageScope scope(timer_, Stage::dispatch);
    if (groups_.experts) {
      exchange_ = groups_.experts->start_dispatch_backward(dx_perm_, std::move(dweight_recv_), s.route);
    } else {
      dh2_ = m_.buffer({batch_.batch * batch_.seq, m_.hidden_size()});
      dispatch_backward(dh2_, dx_perm_, s.copy_row);
    }
    dx_perm_ = Buffer{};
    part_ = 3;
  }
  void attention() {
    auto& s = layer();
    if (groups_.experts) {
      dh2_ = m_.buffer({batch_.batch * batch_.seq, m_.hidden_size()});
      StageScope scope(timer_, Stage::dispatch);
      groups_.experts->finish_dispatch_backward(dh2_, dtopk_weight_, exchange_, s.route);
    }
    Buffer dx_in = m_.buffer({batch_.batch * batch_.seq, m_.hidden_size()});
    {
      StageScope scope(timer_, Stage::attention);
      m_.attention_backward(dx_in, g_.layers[size_t(stage_)], dx_, dh2_, dtopk_weight_, options_.aux_grad, s.attention, batch_,
                            w_.layers[size_t(stage_)]);
    }
    Buffer dout = std::exchange(dx_, std::move(dx_in));
    if (options_.defer_expert_weights && !groups_.experts) {
      mb_.deferred.back().dout = std::move(dout);
      mb_.deferred.back().copy_row = std::move(s.copy_row);
    }
    dh2_ = Buffer{};
    dtopk_weight_ = Buffer{};
    s = typename MicroBatch<M>::Layer{};
    done_with(stage_);
    --stage_;
    part_ = 0;
  }

  MicroBatch<M>& mb_;
  const M& m_;
  const typename M::Weights& w_;
  const typename M::Weights& g_;
  const typename M::Batch& batch_;
  PipelineChunk chunk_;
  Options options_;
  StepGroups groups_;
  StageTimer* timer_;
  int64_t stage_;
  int part_ = 0;  // within a decoder layer: combine, experts, dispatch, attention
  Buffer dx_, dy_perm_, dtopk_weight_, dweight_recv_, dx_perm_, dh2_;
  ExpertParallel::Exchange exchange_;  // the layer's combine or dispatch gradients in flight
};

// The expert weight gradients a deferring backward of mb left, in the order it left them
// (expert_squares and expert_known_zero as BackwardPass's).
template <MoeModel M>
void weights_backward(MicroBatch<M>& mb, const M& m, const typename M::Weights& grads, bool first_micro_batch, StageTimer* timer = nullptr,
                      std::span<const Tensor> expert_squares = {}, std::span<const Tensor> expert_known_zero = {}) {
  StageScope scope(timer, Stage::experts);
  for (auto& d : mb.deferred) {
    const Buffer dy_perm = d.take_dy_perm(m);
    m.experts_backward_weights(grads.layers[size_t(d.layer)], dy_perm, d.experts, d.expert_offsets.view(), first_micro_batch,
                               layer_record(expert_squares, d.layer), layer_record(expert_known_zero, d.layer));
  }
  mb.deferred.clear();
}

// A forward and another micro-batch's backward, stage by stage: whichever comes to an exchange
// issues it first, so it runs under the other's compute. A dispatch first waits on the host for
// its plan's counts, so the backward queues its stage before it and the GPU computes meanwhile.
template <MoeModel M> void forward_backward(ForwardPass<M>& f, BackwardPass<M>& b) {
  while (!f.done() || !b.done()) {
    const bool forward_first = b.done() || (!f.done() && f.next_communicates() && !f.next_plans());
    if (forward_first) f.step();
    if (!b.done()) b.step();
    if (!forward_first && !f.done()) f.step();
  }
}

template <class Pass> void run_pass(Pass& pass) {
  while (!pass.done()) pass.step();
}

// The whole model's forward of one micro-batch.
template <MoeModel M>
void forward(MicroBatch<M>& mb, const M& m, const typename M::Weights& w, const typename M::Batch& batch, StepGroups groups = {},
             StageTimer* timer = nullptr) {
  ForwardPass<M> f(mb, m, w, batch, whole_model(m), Buffer{}, std::move(groups), timer);
  run_pass(f);
}

// The whole model's backward of one micro-batch (see BackwardPass).
template <MoeModel M>
void backward(MicroBatch<M>& mb, const M& m, const typename M::Weights& w, const typename M::Weights& grads,
              const typename M::Batch& batch, const typename BackwardPass<M>::Options& options, StepGroups groups = {},
              StageTimer* timer = nullptr) {
  BackwardPass<M> b(mb, m, w, grads, batch, whole_model(m), Buffer{}, options, std::move(groups), timer);
  run_pass(b);
}
template <MoeModel M>
void backward(MicroBatch<M>& mb, const M& m, const typename M::Weights& w, const typename M::Weights& grads,
              const typename M::Batch& batch, double loss_scale, double aux_grad, bool first_micro_batch = false,
              StepGroups groups = {}, StageTimer* timer = nullptr, std::span<const Tensor> expert_squares = {}) {
  typename BackwardPass<M>::Options options{loss_scale, aux_grad, first_micro_batch, false, expert_squares};
  options.first_of_step = first_micro_batch;
  backward(mb, m, w, grads, batch, options, std::move(groups), timer);
}

}  // namespace marrow
