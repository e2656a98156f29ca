// One micro-batch through the model on a single pipeline stage: the engine's half of the
// five-stage contract. Stage 2 (dispatch) and stage 4 (combine) live here because with expert
// parallelism they are the all-to-all exchanges (parallel/expert_parallel.h); with one
// expert-parallel rank the expert outputs are already local and combine moves nothing. forward()
// keeps what backward() consumes in a MicroBatch, so a schedule can interleave the two across
// micro-batches.
#pragma once
#include <functional>
#include <vector>

#include "engine/model.h"
#include "engine/stage_timer.h"
#include "ops/dispatch.h"
#include "parallel/expert_parallel.h"

namespace marrow {

// The groups a micro-batch communicates with; both null for one process.
struct StepGroups {
  const ExpertParallel* experts = nullptr;  // the layer's experts are spread over this group
  const Comm* routing = nullptr;            // load-balance statistics are summed over this group
  // Called before each stage's forward (forward = true) and backward: the prolog as stage -1, the
  // decoder layers, the epilog as num_layers; e.g. to gather the stage's sharded weights.
  std::function<void(int64_t stage, bool forward)> before_stage;
  // Called by backward() once a stage's gradients of this micro-batch are written (the epilog,
  // each decoder layer, then the prolog), e.g. to start reducing them over the processes while the
  // stages below compute.
  std::function<void(int64_t stage)> layer_done;
};

template <MoeModel M> struct MicroBatch {
  struct Layer {
    typename M::AttentionActivations attention;
    typename M::ExpertActivations experts;
    Buffer expert_offsets, copy_row, y_perm;
    ExpertRoute route;  // with expert parallelism, instead of expert_offsets and copy_row
  };
  std::vector<Layer> layers;
  typename M::EpilogActivations epilog;  // epilog.logits holds the logits until backward
  double token_loss_sum = 0;  // cross-entropy summed over counted targets
  double aux_loss_sum = 0;    // load-balance loss (Hugging Face's form) summed over layers
};

// Stage 2 of one process: all of a token's copies stay here. Returns x_perm.
template <MoeModel M> Buffer dispatch_local(typename MicroBatch<M>::Layer& s, const M& m) {
  const Tensor index = s.attention.topk_index;
  const int64_t T = index.size(0), K = index.size(1);
  // The grouped GEMMs need expert sizes on the host, so the offsets live there.
  s.expert_offsets = Buffer(DType::i32, Device::cpu, {m.num_experts() + 1});
  s.copy_row = Buffer(DType::i32, m.device(), {T, K});
  dispatch_plan(s.expert_offsets, s.copy_row, index);
  Buffer x_perm = m.buffer({T * K, m.hidden_size()});
  dispatch_forward(x_perm, s.attention.h2, s.copy_row);
  return x_perm;
}

// timer, when given, gets each stage's time (engine/stage_timer.h).
template <MoeModel M>
void forward(MicroBatch<M>& mb, const M& m, const typename M::Weights& w, const typename M::Batch& batch, StepGroups groups = {},
             StageTimer* timer = nullptr) {
  const int64_t T = batch.batch * batch.seq, H = m.hidden_size();
  mb.layers.resize(size_t(m.num_layers()));
  auto before = [&](int64_t stage, bool forward) {
    if (groups.before_stage) groups.before_stage(stage, forward);
  };
  Buffer x = m.buffer({T, H});
  {
    StageScope scope(timer, Stage::prolog);
    before(-1, true);
    m.prolog_forward(x, batch, w);
  }
  for (int64_t l = 0; l < m.num_layers(); ++l) {
    auto& s = mb.layers[size_t(l)];
    const auto& lw = w.layers[size_t(l)];
    {
      before(l, true);
      StageScope scope(timer, Stage::attention);
      m.attention_forward(s.attention, std::move(x), batch, lw);
      if (groups.routing) groups.routing->all_reduce_sum(s.attention.routing_stats, "load-balance statistics (all_reduce)");
      mb.aux_loss_sum += m.aux_loss(s.attention);
    }
    Buffer x_perm;
    {
      StageScope scope(timer, Stage::dispatch);
      x_perm = groups.experts ? groups.experts->dispatch_forward(s.route, s.attention.h2, s.attention.topk_index, s.attention.topk_weight)
                              : dispatch_local<M>(s, m);
    }
    const Tensor offsets = groups.experts ? s.route.expert_offsets.view() : s.expert_offsets.view();
    s.y_perm = m.buffer({x_perm.view().size(0), H});
    {
      StageScope scope(timer, Stage::experts);
      m.experts_forward(s.y_perm, s.experts, std::move(x_perm), offsets, lw);
    }
    x = m.buffer({T, H});
    {
      StageScope scope(timer, Stage::combine);
      if (groups.experts) groups.experts->combine_forward(x, s.attention.x_mid, s.y_perm, s.route);
      else m.aggregate_forward(x, s.attention, s.y_perm, s.copy_row);
    }
  }
  StageScope scope(timer, Stage::epilog);
  before(m.num_layers(), true);
  mb.token_loss_sum = m.epilog_forward(mb.epilog, std::move(x), batch, w);
}

// Gradients of (loss_scale * token_loss_sum + aux_grad * aux_loss_sum) accumulate into grads,
// except that first_micro_batch = true writes the gradients the model's spec table marks
// first_backward_writes (the caller zeroes only the others); the micro-batch's activations are
// released as the backward passes them.
template <MoeModel M>
void backward(MicroBatch<M>& mb, const M& m, const typename M::Weights& w, const typename M::Weights& grads,
              const typename M::Batch& batch, double loss_scale, double aux_grad, bool first_micro_batch = false,
              StepGroups groups = {}, StageTimer* timer = nullptr) {
  const int64_t T = batch.batch * batch.seq, H = m.hidden_size(), K = m.top_k();
  auto before = [&](int64_t stage) {
    if (groups.before_stage) groups.before_stage(stage, false);
  };
  auto done = [&](int64_t stage) {
    if (groups.layer_done) groups.layer_done(stage);
  };
  Buffer dx = m.buffer({T, H});
  {
    StageScope scope(timer, Stage::epilog);
    before(m.num_layers());
    m.epilog_backward(dx, grads, loss_scale, mb.epilog, batch, w);
  }
  done(m.num_layers());
  for (int64_t l = m.num_layers() - 1; l >= 0; --l) {
    auto& s = mb.layers[size_t(l)];
    const auto& lw = w.layers[size_t(l)];
    const auto& lg = grads.layers[size_t(l)];
    const int64_t rows = s.y_perm.view().size(0);
    const Tensor offsets = groups.experts ? s.route.expert_offsets.view() : s.expert_offsets.view();
    Buffer dy_perm = m.buffer({rows, H}), dtopk_weight = m.stats({T, K}), dweight_recv;
    {
      StageScope scope(timer, Stage::combine);
      before(l);
      if (groups.experts) dweight_recv = groups.experts->combine_backward(dy_perm, dx, s.y_perm, s.route);
      else m.aggregate_backward(dy_perm, dtopk_weight, dx, s.attention, s.y_perm, s.copy_row);
    }
    Buffer dx_perm = m.buffer({rows, H});
    {
      StageScope scope(timer, Stage::experts);
      m.experts_backward(dx_perm, lg, dy_perm, s.experts, offsets, lw, first_micro_batch);
    }
    Buffer dh2 = m.buffer({T, H});
    {
      StageScope scope(timer, Stage::dispatch);
      if (groups.experts) groups.experts->dispatch_backward(dh2, dtopk_weight, dx_perm, dweight_recv, s.route);
      else dispatch_backward(dh2, dx_perm, s.copy_row);
    }
    Buffer dx_in = m.buffer({T, H});
    {
      StageScope scope(timer, Stage::attention);
      m.attention_backward(dx_in, lg, dx, dh2, dtopk_weight, aux_grad, s.attention, batch, lw);
    }
    dx = std::move(dx_in);
    s = typename MicroBatch<M>::Layer{};
    done(l);
  }
  StageScope scope(timer, Stage::prolog);
  before(-1);
  m.prolog_backward(grads, dx, batch);
  done(-1);
}

}  // namespace marrow
