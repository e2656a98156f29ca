// One micro-batch through the model on a single pipeline stage: the engine's half of the
// five-stage contract. Stage 2 (dispatch) and stage 4 (combine) live here because with expert
// parallelism they are the all-to-all exchanges; with one expert-parallel rank the expert outputs
// are already local and combine moves nothing. forward() keeps what backward() consumes in a
// MicroBatch, so a schedule can interleave the two across micro-batches.
#pragma once
#include <vector>

#include "engine/model.h"
#include "engine/stage_timer.h"
#include "ops/dispatch.h"

namespace marrow {

template <MoeModel M> struct MicroBatch {
  struct Layer {
    typename M::AttentionActivations attention;
    typename M::ExpertActivations experts;
    Buffer expert_offsets, copy_row, y_perm;
  };
  std::vector<Layer> layers;
  typename M::EpilogActivations epilog;  // epilog.logits holds the logits until backward
  double token_loss_sum = 0;  // cross-entropy summed over counted targets
  double aux_loss_sum = 0;    // load-balance loss (Hugging Face's form) summed over layers
};

// timer, when given, gets each stage's time (engine/stage_timer.h).
template <MoeModel M>
void forward(MicroBatch<M>& mb, const M& m, const typename M::Weights& w, const typename M::Batch& batch,
             StageTimer* timer = nullptr) {
  const int64_t T = batch.batch * batch.seq, H = m.hidden_size(), E = m.num_experts(), K = m.top_k();
  mb.layers.resize(size_t(m.num_layers()));
  Buffer x = m.buffer({T, H});
  {
    StageScope scope(timer, Stage::prolog);
    m.prolog_forward(x, batch, w);
  }
  for (int64_t l = 0; l < m.num_layers(); ++l) {
    auto& s = mb.layers[size_t(l)];
    const auto& lw = w.layers[size_t(l)];
    {
      StageScope scope(timer, Stage::attention);
      m.attention_forward(s.attention, std::move(x), batch, lw);
      mb.aux_loss_sum += m.aux_loss(s.attention);
    }
    Buffer x_perm = m.buffer({T * K, H});
    {
      // Stage 2. The grouped GEMMs need expert sizes on the host, so the offsets live there.
      StageScope scope(timer, Stage::dispatch);
      s.expert_offsets = Buffer(DType::i32, Device::cpu, {E + 1});
      s.copy_row = Buffer(DType::i32, m.device(), {T, K});
      dispatch_plan(s.expert_offsets, s.copy_row, s.attention.topk_index);
      dispatch_forward(x_perm, s.attention.h2, s.copy_row);
    }
    s.y_perm = m.buffer({T * K, H});
    {
      StageScope scope(timer, Stage::experts);
      m.experts_forward(s.y_perm, s.experts, std::move(x_perm), s.expert_offsets, lw);
    }
    x = m.buffer({T, H});
    {
      StageScope scope(timer, Stage::combine);
      m.aggregate_forward(x, s.attention, s.y_perm, s.copy_row);
    }
  }
  StageScope scope(timer, Stage::epilog);
  mb.token_loss_sum = m.epilog_forward(mb.epilog, std::move(x), batch, w);
}

// Gradients of (loss_scale * token_loss_sum + aux_grad * aux_loss_sum) accumulate into grads,
// except that first_micro_batch = true writes the gradients the model's spec table marks
// first_backward_writes (the caller zeroes only the others); the micro-batch's activations are
// released as the backward passes them.
template <MoeModel M>
void backward(MicroBatch<M>& mb, const M& m, const typename M::Weights& w, const typename M::Weights& grads,
              const typename M::Batch& batch, double loss_scale, double aux_grad, bool first_micro_batch = false,
              StageTimer* timer = nullptr) {
  const int64_t T = batch.batch * batch.seq, H = m.hidden_size(), K = m.top_k();
  Buffer dx = m.buffer({T, H});
  {
    StageScope scope(timer, Stage::epilog);
    m.epilog_backward(dx, grads, loss_scale, mb.epilog, batch, w);
  }
  for (int64_t l = m.num_layers() - 1; l >= 0; --l) {
    auto& s = mb.layers[size_t(l)];
    const auto& lw = w.layers[size_t(l)];
    const auto& lg = grads.layers[size_t(l)];
    Buffer dy_perm = m.buffer({T * K, H}), dtopk_weight = m.stats({T, K});
    {
      StageScope scope(timer, Stage::combine);
      m.aggregate_backward(dy_perm, dtopk_weight, dx, s.attention, s.y_perm, s.copy_row);
    }
    Buffer dx_perm = m.buffer({T * K, H});
    {
      StageScope scope(timer, Stage::experts);
      m.experts_backward(dx_perm, lg, dy_perm, s.experts, s.expert_offsets, lw, first_micro_batch);
    }
    Buffer dh2 = m.buffer({T, H});
    {
      StageScope scope(timer, Stage::dispatch);
      dispatch_backward(dh2, dx_perm, s.copy_row);
    }
    Buffer dx_in = m.buffer({T, H});
    {
      StageScope scope(timer, Stage::attention);
      m.attention_backward(dx_in, lg, dx, dh2, dtopk_weight, aux_grad, s.attention, batch, lw);
    }
    dx = std::move(dx_in);
    s = typename MicroBatch<M>::Layer{};
  }
  StageScope scope(timer, Stage::prolog);
  m.prolog_backward(grads, dx, batch);
}

}  // namespace marrow
