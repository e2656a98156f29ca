#include "models/common.h"

#include <algorithm>
#include <cmath>
#include <string_view>

#include "core/weights_generation.h"

#include "ops/cross_entropy.h"
#include "ops/grouped_linear.h"
#include "ops/grouped_linear_fp8.h"
#include "ops/init.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/swiglu.h"

namespace marrow {

void expect_family(const JsonFields& f, const std::string& source, const char* model_type, const char* architecture) {
  const std::string type = f.string("model_type");
  MARROW_CHECK(type == model_type, "{}: model_type is '{}' but this model is {}", source, type, model_type);
  if (f.has("architectures")) {
    const Json& arch = f.raw("architectures");
    MARROW_CHECK(arch.is_array() && arch.size() == 1 && arch[0] == architecture, "{}: architectures must be [\"{}\"], got {}", source,
                 architecture, arch.dump());
  }
  MARROW_CHECK(!f.boolean("tie_word_embeddings", false), "{}: tie_word_embeddings = true is not supported", source);
  MARROW_CHECK(f.number("attention_dropout", 0.0) == 0.0, "{}: attention_dropout must be 0", source);
}

// rope_scaling when a non-empty object, else rope_parameters, else none.
static const char* rope_key(const JsonFields& f) {
  const auto given = [&](const char* key) { return f.has(key) && !(f.raw(key).is_object() && f.raw(key).empty()); };
  return given("rope_scaling") ? "rope_scaling" : given("rope_parameters") ? "rope_parameters" : nullptr;
}

const Json& rope_settings(const JsonFields& f, const Json& fallback) {
  const char* key = rope_key(f);
  return key ? f.raw(key) : fallback;
}

RopeParameters read_rope(const JsonFields& f, const std::string& source, double default_theta, const Json& fallback, bool allow_yarn,
                         bool allow_mscale) {
  const char* key = rope_key(f);
  const Json& settings = rope_settings(f, fallback);
  const std::string where = source + ": " + (key ? key : "the default rope_parameters");
  MARROW_CHECK(settings.is_object(), "{} must be an object, got {}", where, settings.dump());
  for (const char* layer_type : {"full_attention", "sliding_attention"})
    MARROW_CHECK(!settings.contains(layer_type), "{}: settings per layer type are not supported", where);
  JsonFields rope(settings, where);
  RopeParameters r;
  r.theta = rope.number("rope_theta", f.number("rope_theta", default_theta));
  const std::string type = rope.string("rope_type", rope.string("type", "default"));
  MARROW_CHECK(type == "default" || (allow_yarn && type == "yarn"), "{}: rope_type '{}' is not supported ({})", where, type,
               allow_yarn ? "default or yarn" : "only default");
  for (const char* unsupported : {"mscale", "mscale_all_dim", "partial_rotary_factor"})
    MARROW_CHECK((allow_mscale && std::string_view(unsupported) != "partial_rotary_factor") || (!rope.has(unsupported) && !f.has(unsupported)),
                 "{}: {} is not supported", source, unsupported);
  if (type == "default") return r;
  r.yarn = true;
  r.factor = rope.number("factor");
  r.beta_fast = rope.number("beta_fast", 32.0);
  r.beta_slow = rope.number("beta_slow", 1.0);
  r.attention_factor = rope.number("attention_factor", 0.0);
  // transformers' _compute_yarn_parameters: DeepSeek's ratio of the two temperatures when both are given.
  const double mscale = rope.number("mscale", 0.0), mscale_all_dim = rope.number("mscale_all_dim", 0.0);
  if (allow_mscale && r.attention_factor == 0.0 && mscale != 0.0 && mscale_all_dim != 0.0 && r.factor > 1)
    r.attention_factor = (0.1 * mscale * std::log(r.factor) + 1.0) / (0.1 * mscale_all_dim * std::log(r.factor) + 1.0);
  r.original_max_positions = f.positive("original_max_position_embeddings",
                                        rope.positive("original_max_position_embeddings", f.positive("max_position_embeddings", 0)));
  MARROW_CHECK(r.original_max_positions > 0, "{}: yarn needs original_max_position_embeddings (or max_position_embeddings)", where);
  r.truncate = rope.boolean("truncate", true);
  return r;
}

void ParameterTable::add(std::string name, std::vector<int64_t> shape, ParamKind kind, bool is_expert) {
  const bool is_norm = kind == ParamKind::norm;
  const bool first_writes = is_expert || (layer == num_layers && !is_norm);
  TensorSpec s;
  s.name = std::move(name);
  s.shape = std::move(shape);
  s.offset = numel;
  s.numel = 1;
  s.is_norm = is_norm;
  s.decayed = kind == ParamKind::matrix || kind == ParamKind::table;
  s.orthogonalized = kind == ParamKind::matrix && s.shape.size() >= 2;
  s.first_backward_writes = first_writes;
  s.is_expert = is_expert;
  s.layer = layer;
  for (int64_t d : s.shape) s.numel *= d;
  numel += s.numel;
  specs.push_back(std::move(s));
}

void ParameterTable::add_expert_rows(std::string name, std::vector<int64_t> canonical_shape, int64_t first, int64_t count,
                                     ParamKind kind) {
  const int64_t experts = canonical_shape.at(0);
  MARROW_CHECK(first >= 0 && count >= 1 && first + count <= experts, "internal: experts [{}, {}) of {}'s {}", first, first + count, name,
               experts);
  std::vector<int64_t> shape = canonical_shape;
  shape[0] = count;
  add(std::move(name), shape, kind, true);
  if (count == experts) return;
  TensorSpec& s = specs.back();
  s.canonical_first = first * (s.numel / count);
  s.canonical_shape = std::move(canonical_shape);
}

Tensor TableCursor::take(std::initializer_list<int64_t> dims, int64_t count) {
  const TensorSpec& s = specs_.at(next_);
  next_ += size_t(count);
  return placement_.slice(s.offset, dims);
}

void TableCursor::expect_end() const {
  MARROW_CHECK(next_ == specs_.size(), "internal: bound {} of {} parameter tensors", next_, specs_.size());
}

void initialize_tensor(Tensor out, const TensorSpec& spec, int64_t first, uint64_t seed, double std, bool zeros) {
  MARROW_CHECK(first >= 0 && first + out.numel() <= spec.numel, "internal: elements [{}, {}) of {} with {} elements", first,
               first + out.numel(), spec.name, spec.numel);
  if (spec.is_norm) fill_constant(out, 1.0);
  else if (zeros) fill_constant(out, 0.0);
  else fill_normal(out, seed, spec.name, std, spec.canonical_first + first);  // a part draws the canonical tensor's numbers
}

int64_t logits_chunk(int64_t tokens, int64_t vocab, DType dtype, int64_t forced) {
  if (forced > 0) return std::min(tokens, forced);
  const int64_t row_bytes = vocab * int64_t(dtype_size(dtype));
  if (tokens * row_bytes <= kWholeLogitsBytes) return tokens;
  // Whole multiples of 64 rows, so every chunk but the last keeps the GEMMs' tiles full.
  const int64_t most = std::max<int64_t>(64, kLogitsChunkBytes / row_bytes / 64 * 64);
  const int64_t chunks = (tokens + most - 1) / most;
  return std::min(most, ((tokens + chunks - 1) / chunks + 63) / 64 * 64);
}

namespace {

// One chunk of the LM head's backward: the logits' gradient in place of the logits, the head's
// gradient (written at the step's first chunk when overwrite), and dh's rows.
void lm_head_chunk_backward(Tensor logits, Tensor h, Tensor lse, Tensor targets, Tensor dh, Tensor lm_head, Tensor lm_head_grad,
                            double loss_scale, bool overwrite) {
  cross_entropy_backward(logits, logits, lse, targets, loss_scale);
  linear_backward_weight(lm_head_grad, logits, h, overwrite);
  linear_backward_input(dh, logits, lm_head);
}

}  // namespace

HostSum epilog_forward(EpilogActivations& p, Buffer x, Tensor targets, const LmHead& head, Tensor lm_head_grad, double loss_scale,
                       bool overwrite) {
  const int64_t T = x.view().size(0), H = x.view().size(1), V = head.lm_head.size(0);
  p.x = std::move(x);
  p.h = Buffer(head.dtype, head.device, {T, H});
  p.rstd = Buffer(head.stats_dtype, head.device, {T});
  rmsnorm_forward(p.h, p.rstd, p.x, head.final_norm, head.eps);
  p.lse = Buffer(head.stats_dtype, head.device, {T});
  p.token_loss = Buffer(head.stats_dtype, head.device, {T});
  const int64_t chunk = head.chunk;
  const bool backward_now = lm_head_grad.data != nullptr && chunk < T;
  if (backward_now) p.dh = Buffer(head.dtype, head.device, {T, H});
  Buffer logits(head.dtype, head.device, {chunk, V});
  for (int64_t begin = 0; begin < T; begin += chunk) {
    const int64_t end = std::min(T, begin + chunk);
    const Tensor part = logits.view().rows(0, end - begin), h = p.h.view().rows(begin, end);
    const Tensor lse = p.lse.view().rows(begin, end), part_targets = targets.rows(begin, end);
    linear_forward(part, h, head.lm_head);
    cross_entropy_forward(p.token_loss.view().rows(begin, end), lse, part, part_targets);
    if (backward_now)
      lm_head_chunk_backward(part, h, lse, part_targets, p.dh.view().rows(begin, end), head.lm_head, lm_head_grad, loss_scale,
                             overwrite && begin == 0);
  }
  if (chunk == T) p.logits = std::move(logits);
  HostSum loss;
  loss.add(p.token_loss);
  return loss;
}

void epilog_backward(Tensor dx, Tensor final_norm_grad, Tensor lm_head_grad, double loss_scale, EpilogActivations& p, Tensor targets,
                     const LmHead& head, bool overwrite) {
  const int64_t T = p.x.view().size(0), H = p.x.view().size(1), V = head.lm_head.size(0);
  if (p.dh.view().data == nullptr) {
    const bool kept = p.logits.view().data != nullptr;
    const int64_t chunk = kept ? T : head.chunk;
    Buffer logits = kept ? std::move(p.logits) : Buffer(head.dtype, head.device, {chunk, V});
    p.dh = Buffer(head.dtype, head.device, {T, H});
    for (int64_t begin = 0; begin < T; begin += chunk) {
      const int64_t end = std::min(T, begin + chunk);
      const Tensor part = logits.view().rows(0, end - begin), h = p.h.view().rows(begin, end);
      if (!kept) linear_forward(part, h, head.lm_head);
      lm_head_chunk_backward(part, h, p.lse.view().rows(begin, end), targets.rows(begin, end), p.dh.view().rows(begin, end), head.lm_head,
                             lm_head_grad, loss_scale, overwrite && begin == 0);
    }
  }
  rmsnorm_backward(dx, final_norm_grad, p.dh, p.x, head.final_norm, p.rstd);
  p = EpilogActivations{};
}

// x, h, the logits when kept whole; rstd, lse, token losses. Whole logits: dh in the backward (the
// loss gradient overwrites the logits). Chunked logits (training runs their backward in the
// forward): one chunk's buffer in the forward, dh from the forward to the backward.
StageBytes epilog_bytes(int64_t T, int64_t H, int64_t V, int64_t chunk, int64_t a, int64_t s) {
  return {T * 2 * H * a + (chunk == T ? T * V * a : T * H * a) + 3 * T * s, chunk == T ? 0 : chunk * V * a, chunk == T ? T * H * a : 0};
}

const Fp8ExpertWeights& fp8_expert_weights(std::vector<Fp8ExpertWeights>& cache, int64_t layer, int64_t num_layers, Tensor gate_up,
                                           Tensor down) {
  MARROW_CHECK(layer >= 0 && layer < num_layers, "fp8_expert_weights: the layer weights carry no layer index ({}); bind sets it", layer);
  if (cache.empty()) cache.resize(size_t(num_layers));
  Fp8ExpertWeights& q = cache[size_t(layer)];
  if (q.generation == weights_generation() && q.source == gate_up.data && q.gate_up.values.view().data) return q;
  if (!q.gate_up.values.view().data) {
    const int64_t E = gate_up.size(0);
    q.gate_up = Fp8Buffer::blocks(gate_up.device, E, gate_up.size(1), gate_up.size(2));
    q.gate_up_t = Fp8Buffer::blocks(gate_up.device, E, gate_up.size(2), gate_up.size(1));
    q.down = Fp8Buffer::blocks(down.device, E, down.size(1), down.size(2));
    q.down_t = Fp8Buffer::blocks(down.device, E, down.size(2), down.size(1));
  }
  quantize_blocks(q.gate_up.view(), q.gate_up_t.view(), gate_up);
  quantize_blocks(q.down.view(), q.down_t.view(), down);
  q.generation = weights_generation();
  q.source = gate_up.data;
  return q;
}

void fp8_grouped(Tensor y, Tensor x, const Fp8Buffer& w, Tensor expert_offsets) {
  const Fp8Buffer xq = Fp8Buffer::rows(x.device, x.size(0), x.size(1));
  quantize_rows(xq.view(), x);
  grouped_linear_fp8(y, xq.view(), w.view(), expert_offsets);
}

int64_t grouped_squares_count(Tensor dweight) { return grouped_weight_squares_count(dweight.size(0), dweight.size(1), dweight.size(2)); }

std::pair<Tensor, Tensor> split_record(const char* name, Tensor record, int64_t first, int64_t expected) {
  if (record.data == nullptr) return {};
  MARROW_CHECK(record.ndim == 1 && record.numel() == expected,
               "experts_backward_weights: {} has shape {} but the layer's expert gradients need [{}]", name, record.shape_string(), expected);
  return {record.rows(0, first), record.rows(first, record.numel())};
}

void swiglu_experts_forward(Tensor y_perm, SwigluExpertActivations& e, Buffer x_perm, Tensor expert_offsets, const SwigluExperts& w) {
  const int64_t R = x_perm.view().size(0), I = w.down.size(2);
  e.x_perm = std::move(x_perm);
  e.gate_up = Buffer(w.dtype, w.device, {R, 2 * I});
  if (w.fp8) fp8_grouped(e.gate_up, e.x_perm, w.fp8->gate_up, expert_offsets);
  else grouped_linear_forward(e.gate_up, e.x_perm, w.gate_up, expert_offsets);
  const Buffer act(w.dtype, w.device, {R, I});
  swiglu_forward(act, e.gate_up);
  if (w.fp8) fp8_grouped(y_perm, act, w.fp8->down, expert_offsets);
  else grouped_linear_forward(y_perm, act, w.down, expert_offsets);
}

void swiglu_experts_backward_input(Tensor dx_perm, Tensor dy_perm, SwigluExpertActivations& e, Tensor expert_offsets, const SwigluExperts& w) {
  const int64_t R = e.gate_up.view().size(0), I = w.down.size(2);
  Buffer dact(w.dtype, w.device, {R, I});
  if (w.fp8) fp8_grouped(dact, dy_perm, w.fp8->down_t, expert_offsets);
  else grouped_linear_backward_input(dact, dy_perm, w.down, expert_offsets);
  e.act = Buffer(w.dtype, w.device, {R, I});  // computed again, for the down projection's weight gradient
  e.dgate_up = Buffer(w.dtype, w.device, {R, 2 * I});
  if (e.copy_row.data != nullptr) {
    swiglu_weighted_backward(e.dgate_up, e.act, e.dtopk_weight, dact, e.gate_up, e.topk_weight, e.copy_row);
    e.topk_weight = e.copy_row = e.dtopk_weight = Tensor{};
  } else {
    swiglu_forward(e.act, e.gate_up);
    swiglu_backward(e.dgate_up, dact, e.gate_up);
  }
  e.gate_up = Buffer{};
  if (w.fp8) fp8_grouped(dx_perm, e.dgate_up, w.fp8->gate_up_t, expert_offsets);
  else grouped_linear_backward_input(dx_perm, e.dgate_up, w.gate_up, expert_offsets);
}

namespace {
struct ExpertRecords {  // squares and known_zero cut into down's and gate_up's parts
  Tensor down_squares, gate_up_squares, down_zero, gate_up_zero;
};
ExpertRecords split_expert_records(Tensor ddown, Tensor dgate_up, Tensor squares, Tensor known_zero) {
  const int64_t down_squares = grouped_squares_count(ddown), down_experts = ddown.size(0);
  const auto [ds, gs] = split_record("squares", squares, down_squares, down_squares + grouped_squares_count(dgate_up));
  const auto [dz, gz] = split_record("known_zero", known_zero, down_experts, down_experts + dgate_up.size(0));
  return {ds, gs, dz, gz};
}
}  // namespace

void swiglu_experts_backward_weights(Tensor ddown, Tensor dgate_up, Tensor dy_perm, SwigluExpertActivations& e, Tensor expert_offsets,
                                     bool overwrite_grads, Tensor squares, Tensor known_zero) {
  const ExpertRecords r = split_expert_records(ddown, dgate_up, squares, known_zero);
  grouped_linear_backward_weight(ddown, dy_perm, e.act, expert_offsets, overwrite_grads, r.down_squares, r.down_zero);
  grouped_linear_backward_weight(dgate_up, e.dgate_up, e.x_perm, expert_offsets, overwrite_grads, r.gate_up_squares, r.gate_up_zero);
  e = SwigluExpertActivations{};
}

void swiglu_experts_backward_weights_pair(Tensor ddown, Tensor dgate_up, Tensor earlier_dy_perm, SwigluExpertActivations& earlier,
                                          Tensor earlier_offsets, Tensor dy_perm, SwigluExpertActivations& e, Tensor expert_offsets,
                                          bool overwrite_grads, Tensor squares, Tensor known_zero) {
  const ExpertRecords r = split_expert_records(ddown, dgate_up, squares, known_zero);
  grouped_linear_backward_weight_pair(ddown, {earlier_dy_perm, earlier.act, earlier_offsets}, {dy_perm, e.act, expert_offsets},
                                      overwrite_grads, r.down_squares, r.down_zero);
  grouped_linear_backward_weight_pair(dgate_up, {earlier.dgate_up, earlier.x_perm, earlier_offsets}, {e.dgate_up, e.x_perm, expert_offsets},
                                      overwrite_grads, r.gate_up_squares, r.gate_up_zero);
  earlier = SwigluExpertActivations{};
  e = SwigluExpertActivations{};
}

}  // namespace marrow
