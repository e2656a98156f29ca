// What the engine needs from a model family: the five-stage contract of DESIGN.md §3 as a C++20
// concept. Each family (src/models/) satisfies it with plain member functions; nothing is virtual.
// The sequential trainer pairs micro-batches 2i and 2i + 1 for the expert weight gradients (under
// 512 rows per expert, expert gradients accumulating in place): 2i defers them (MicroBatch::deferred,
// holding dout and copy_row instead of dy_perm with one process) and 2i + 1's BackwardPass runs
// experts_backward_weights_pair with earlier_overwrites set from 2i. The kernel side must stay the
// two calls' bits (ops/grouped_linear.h); Qwen3Moe.PairedExpertWeightGradientsGiveTheSameBits checks
// the engine side on the CPU.
#pragma once
#include <concepts>
#include <utility>
#include <vector>

#include "core/host_sum.h"
#include "core/memory.h"
#include "core/stage_bytes.h"

namespace marrow {

template <class M>
concept MoeModel = requires(const M& m, typename M::AttentionActivations& a, typename M::ExpertActivations& e,
                            typename M::EpilogActivations& p, const typename M::Weights& w, const typename M::Batch& batch,
                            Buffer buffer, Tensor t, double scale, bool flag) {
  typename M::Config;
  { M::model_type } -> std::convertible_to<const char*>;
  { m.num_layers() } -> std::convertible_to<int64_t>;
  { m.num_experts() } -> std::convertible_to<int64_t>;
  { m.top_k() } -> std::convertible_to<int64_t>;
  { m.hidden_size() } -> std::convertible_to<int64_t>;
  { m.activation_bytes(int64_t(1), int64_t(1), int64_t(1)) } -> std::same_as<ModelActivationBytes>;  // the memory estimate
  { m.device() } -> std::same_as<Device>;
  { m.buffer({1}) } -> std::same_as<Buffer>;
  { m.stats({1}) } -> std::same_as<Buffer>;
  { m.num_parameters() } -> std::convertible_to<int64_t>;
  { m.num_active_parameters() } -> std::convertible_to<int64_t>;
  { m.attention_width() } -> std::convertible_to<int64_t>;  // query heads x head dim: attention's FLOPs
  { m.attention_flops_per_token(int64_t(1)) } -> std::convertible_to<double>;  // forward and backward, all layers
  { m.bind(std::declval<const Arena&>()) } -> std::same_as<typename M::Weights>;
  m.prolog_forward(t, batch, w);
  m.prolog_backward(w, t, batch, t);  // t: the embedding gradient's known-zero row flags
  { m.prolog_known_zero_count() } -> std::convertible_to<int64_t>;
  { m.prolog_known_zero_parts(w, t) } -> std::same_as<std::vector<std::pair<Tensor, Tensor>>>;
  m.attention_forward(a, std::move(buffer), batch, w.layers[0]);
  m.attention_backward(t, w.layers[0], t, t, t, scale, a, batch, w.layers[0]);
  m.add_aux_loss(t, a);
  m.experts_forward(t, e, std::move(buffer), t, w.layers[0]);
  m.experts_backward_input(t, t, e, t, w.layers[0]);
  m.experts_backward_weights(w.layers[0], t, e, t, flag, t, t);  // t, t last: squares and known-zero flags
  m.experts_backward_weights_pair(w.layers[0], t, e, t, t, e, t, flag, t, t);  // an earlier micro-batch's, then this one's
  { m.expert_squares_count(w.layers[0]) } -> std::convertible_to<int64_t>;
  { m.expert_known_zero_count(w.layers[0]) } -> std::convertible_to<int64_t>;
  { m.expert_known_zero_parts(w.layers[0], t) } -> std::same_as<std::vector<std::pair<Tensor, Tensor>>>;
  m.experts_drop_input(e);
  m.experts_restore_input(e, std::move(buffer));
  m.aggregate_forward(t, a, t, t);
  m.aggregate_backward(t, t, t, a, t, e);
  m.aggregate_backward_rows(t, t, t);
  { m.epilog_forward(p, std::move(buffer), batch, w) } -> std::same_as<HostSum>;
  // With the gradients (and epilog_backward's scale and flag) a model may run the epilog's backward
  // in its forward where that saves work; epilog_backward then finishes it.
  { m.epilog_forward(p, std::move(buffer), batch, w, &w, scale, flag) } -> std::same_as<HostSum>;
  m.epilog_backward(t, w, scale, p, batch, w, flag);  // flag: write the first_backward_writes gradients
};

// Whether layer `layer` has no experts (DeepSeek-V2's first_k_dense_replace): its attention stage is
// then the whole layer, with no routing, dispatch, experts or combine. A family without such layers
// need not say.
template <class M> bool dense_layer(const M& m, int64_t layer) {
  if constexpr (requires { m.dense_layer(layer); }) return m.dense_layer(layer);
  else return false;
}
// The layers with experts: the load-balance loss is their mean.
template <class M> int64_t moe_layer_count(const M& m) {
  int64_t n = 0;
  for (int64_t l = 0; l < m.num_layers(); ++l) n += dense_layer(m, l) ? 0 : 1;
  return n;
}
// Each family's Batch has a member `StatisticsRows sequences` (ops/router.h) for the sequence-wise
// load balance (config sequence_aux, set from train.load_balance): the engine, which sums the
// statistics over the data group (StepGroups::routing), says there which rows of the data-parallel
// ranks' sequences are the micro-batch's; context-parallel ranks holding shares of the same sequences
// get the same rows.

// Whether the trainer pairs consecutive micro-batches' expert weight gradients (BackwardPass's
// earlier): a micro-batch's dW reads and writes 8 bytes of fp32 gradient an element for 2 x rows
// multiply-adds, so below ~600 rows an expert (an H200's ~4 TB/s against ~650 bf16 TFLOP/s) that
// traffic binds the kernel, and a pair halves it for the memory of one micro-batch's expert inputs
// held until the next one's backward. Rows per expert under balanced routing: tokens x top-k x ep
// / experts (the bench shape has 256). The same bits either way.
constexpr int64_t kPairedBelowRowsPerExpert = 512;
inline bool pairs_expert_weight_gradients(bool wanted, int64_t tokens, int64_t top_k, int64_t ep, int64_t num_experts) {
  return wanted && tokens * top_k * ep < kPairedBelowRowsPerExpert * num_experts;
}

}  // namespace marrow
