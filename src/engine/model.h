// What the engine needs from a model family: the five-stage contract of DESIGN.md §3 as a C++20
// concept. Each family (src/models/) satisfies it with plain member functions; nothing is virtual.
#pragma once
#include <concepts>

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
  { m.bind(std::declval<const Arena&>()) } -> std::same_as<typename M::Weights>;
  m.prolog_forward(t, batch, w);
  m.prolog_backward(w, t, batch);
  m.attention_forward(a, std::move(buffer), batch, w.layers[0]);
  m.attention_backward(t, w.layers[0], t, t, t, scale, a, batch, w.layers[0]);
  { m.aux_loss(a) } -> std::convertible_to<double>;
  m.experts_forward(t, e, std::move(buffer), t, w.layers[0]);
  m.experts_backward(t, w.layers[0], t, e, t, w.layers[0], flag);
  m.experts_backward_input(t, t, e, t, w.layers[0]);
  m.experts_backward_weights(w.layers[0], t, e, t, flag);
  m.experts_drop_input(e);
  m.experts_restore_input(e, std::move(buffer));
  m.aggregate_forward(t, a, t, t);
  m.aggregate_backward(t, t, t, a, t, t);
  { m.epilog_forward(p, std::move(buffer), batch, w) } -> std::convertible_to<double>;
  m.epilog_backward(t, w, scale, p, batch, w);
};

}  // namespace marrow
