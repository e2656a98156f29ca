// marrow check, elementwise group, DeepSeek-V2's ops: MLA's query and key/value assembly with the
// interleaved RoPE (ops/mla.h), forward and backward, and the router's DeepSeek options (scale,
// normalisation, group-limited selection) with per-sequence statistics (ops/router.h), each against
// its f32 CPU reference on random inputs rounded to the GPU's dtypes: odd sizes (the one-element
// kernel paths) and DeepSeek-V2-Lite's layer (T = 4096, H = 16, Dn = 128, Dr = 64, Dv = 128;
// E = 64, K = 6) and DeepSeek-V2's router (E = 160, 8 groups, top 3).
#include <algorithm>
#include <cmath>
#include <string>

#include "gpu_check/check.h"
#include "core/rng.h"
#include "ops/mla.h"
#include "ops/router.h"

namespace marrow {

namespace {

// As check_elementwise.cpp's: a bf16 output is one rounding off f32 math; f32 sums in another order.
constexpr double kBf16 = 1e-2, kF32 = 1e-5, kExact = 0;
constexpr DType bf16 = DType::bf16, f32 = DType::f32, i32 = DType::i32;

// Positions uniform in [0, 131072), with 0, YaRN's original context edge (4095, 4096) and the
// longest, 131071, first.
Buffer random_positions(int64_t n, uint64_t seed) {
  Buffer b(i32, Device::cpu, {n});
  Philox rng = philox_for(seed, "check positions");
  for (int64_t i = 0; i < n; ++i) b.ptr<int32_t>()[i] = std::min<int32_t>(int32_t(rng.uniform(uint64_t(i)) * 131072.0f), 131071);
  const int32_t planted[] = {0, 4095, 4096, 131071};
  for (int64_t i = 0; i < std::min<int64_t>(n, 4); ++i) b.ptr<int32_t>()[i] = planted[i];
  return b;
}

// DeepSeek-V2's rope_parameters; attention_factor 0 is Hugging Face's default (1.37 for factor 40,
// cos and sin scaled), 1 DeepSeek-V2's own (mscale = mscale_all_dim).
RopeParameters deepseek_rope(double attention_factor) {
  RopeParameters rope;
  rope.theta = 10000.0;
  rope.yarn = true;
  rope.factor = 40.0;
  rope.original_max_positions = 4096;
  rope.attention_factor = attention_factor;
  return rope;
}

// yarn_apply_mscale's factor for DeepSeek-V2 (mscale_all_dim 0.707, factor 40): the query scale.
const double kDeepseekQueryScale = std::pow(0.1 * 0.707 * std::log(40.0) + 1.0, 2);

std::string mla_size(int64_t n, int64_t heads, int64_t dn, int64_t dr, double attention_factor) {
  return fmt::format("T={} H={} Dn={} Dr={} yarn attention_factor {}", n, heads, dn, dr, attention_factor);
}

void check_mla_query(CheckReport& report, int64_t n, int64_t heads, int64_t dn, int64_t dr, double attention_factor, double scale,
                     bool in_place) {
  const std::string size = mla_size(n, heads, dn, dr, attention_factor) + fmt::format(" scale {:.4f}{}", scale, in_place ? " in place" : "");
  const RopeParameters rope = deepseek_rope(attention_factor);
  const Both positions(random_positions(n, 200), i32);
  for (int backward = 0; backward < 2; ++backward) {
    const Both x(random_bf16({n, heads, dn + dr}, 201 + backward), bf16), y = Both::out(bf16, {n, heads, dn + dr});
    const Tensor out[2] = {y.cpu, in_place ? x.gpu : y.gpu};
    on_each_side([&](int s) {
      if (backward) mla_query_backward(out[s], x[s], positions[s], dr, rope, scale);
      else mla_query_forward(out[s], x[s], positions[s], dr, rope, scale);
    });
    report.compare((backward ? "mla_query_backward " : "mla_query_forward ") + size, out[1], y.cpu, kBf16);
  }
}

// The copies exact, the rotations one bf16 rounding; dk_pe's sum over heads twice: the same bits.
void check_mla_key_value(CheckReport& report, int64_t n, int64_t heads, int64_t dn, int64_t dr, int64_t dv, double attention_factor) {
  const std::string size = mla_size(n, heads, dn, dr, attention_factor) + fmt::format(" Dv={}", dv);
  const RopeParameters rope = deepseek_rope(attention_factor);
  const Both positions(random_positions(n, 210), i32), kv(random_bf16({n, heads, dn + dv}, 211), bf16), k_pe(random_bf16({n, dr}, 212), bf16);
  const Both k = Both::out(bf16, {n, heads, dn + dr}), v = Both::out(bf16, {n, heads, dv});
  on_each_side([&](int s) { mla_key_value_forward(k[s], v[s], kv[s], k_pe[s], positions[s], rope); });
  report.compare("mla_key_value_forward k " + size, k, kBf16);
  report.compare("mla_key_value_forward v " + size, v, kExact);

  const Both dk(random_bf16({n, heads, dn + dr}, 213), bf16), dv_in(random_bf16({n, heads, dv}, 214), bf16);
  const Both dkv = Both::out(bf16, {n, heads, dn + dv}), dk_pe = Both::out(bf16, {n, dr}), dk_pe_again = Both::out(bf16, {n, dr});
  on_each_side([&](int s) { mla_key_value_backward(dkv[s], dk_pe[s], dk[s], dv_in[s], positions[s], rope); });
  mla_key_value_backward(dkv.gpu, dk_pe_again.gpu, dk.gpu, dv_in.gpu, positions.gpu, rope);
  report.compare("mla_key_value_backward dkv " + size, dkv, kExact);
  report.compare("mla_key_value_backward dk_pe " + size, dk_pe, kBf16);
  report.expect_same_bits("mla_key_value_backward dk_pe two runs " + size, dk_pe_again.gpu, dk_pe.gpu);
}

// Columns [c0, c1) of every row of a host f32 [rows, cols] tensor.
Buffer columns(Tensor host, int64_t c0, int64_t c1) {
  const int64_t rows = host.size(0), cols = host.size(1);
  Buffer out(f32, Device::cpu, {rows, c1 - c0});
  const float* in = host.ptr<float>();
  for (int64_t r = 0; r < rows; ++r) std::copy(in + r * cols + c0, in + r * cols + c1, out.ptr<float>() + r * (c1 - c0));
  return out;
}

// The router with DeepSeek's options on T tokens, then its statistics per run of tokens_per_group
// (G = T / tokens_per_group rows), their aux loss (mean over rows) and the backward through both.
// Each GPU op gets the CPU's inputs.
void check_deepseek_router(CheckReport& report, int64_t n, int64_t e, int64_t k, const RouterOptions& o, int64_t tokens_per_group) {
  const int64_t rows = n / tokens_per_group, width = 2 * e + 1;
  const std::string size = fmt::format("T={} E={} K={} {} scale {} groups {} top {} G={}", n, e, k, o.normalize ? "normalized" : "unnormalized",
                                       o.scale, o.groups, o.top_groups, rows);
  const Both logits(random_host({n, e}, 220, 2.0), f32);
  Both probs = Both::out(f32, {n, e}), topk_weight = Both::out(f32, {n, k}), topk_index = Both::out(i32, {n, k});
  on_each_side([&](int s) { router_forward(probs[s], topk_index[s], topk_weight[s], logits[s], o); });
  report.compare("router_forward probs " + size, probs, kF32);
  report.expect_equal("router_forward topk_index " + size, topk_index);
  report.compare("router_forward topk_weight " + size, topk_weight, kF32);

  const Both probs_in(probs.cpu, f32), index_in(topk_index.cpu, i32), weight_in(topk_weight.cpu, f32);
  Both stats = Both::out(f32, {rows, width});
  on_each_side([&](int s) { router_statistics_grouped(stats[s], probs_in[s], index_in[s], tokens_per_group); });
  const Buffer gpu_stats = to_host_f32(stats.gpu);
  const Tensor gpu_rows = gpu_stats.view().reshape({rows, width});
  report.expect_equal("router_statistics_grouped counts " + size, columns(gpu_rows, 0, e), columns(stats.cpu, 0, e));
  report.compare("router_statistics_grouped sums " + size, columns(gpu_rows, e, width), columns(stats.cpu, e, width), kF32);
  Buffer aux(f32, Device::cpu, {1}), aux_gpu(f32, Device::cpu, {1});
  aux.ptr<float>()[0] = float(router_aux_loss(stats.cpu));
  aux_gpu.ptr<float>()[0] = float(router_aux_loss(stats.gpu));
  report.compare("router_aux_loss per row " + size, aux_gpu, aux, kF32);
  Buffer total = Buffer::zeros(DType::f64, Device::cpu, {1}), total_gpu = Buffer::zeros(DType::f64, Device::cuda, {1});
  router_aux_loss_add(total, gpu_rows);
  router_aux_loss_add(total_gpu, stats.gpu);
  report.expect_equal("router_aux_loss_add per row " + size, total_gpu, total);

  // aux_grad = T / 2 makes the aux term's gradient comparable to the routing weights'.
  const Both dtopk(random_host({n, k}, 221), f32), stats_in(stats.cpu, f32);
  Both dlogits = Both::out(bf16, {n, e});
  on_each_side([&](int s) { router_backward(dlogits[s], dtopk[s], probs_in[s], index_in[s], weight_in[s], o, 0.5 * double(n), stats_in[s]); });
  report.compare("router_backward dlogits " + size, dlogits, kBf16);
}

RouterOptions deepseek_options(bool normalize, double scale, int64_t groups, int64_t top_groups) {
  RouterOptions o;
  o.normalize = normalize;
  o.scale = scale;
  o.groups = groups;
  o.top_groups = top_groups;
  return o;
}

}  // namespace

void check_mla_ops(CheckReport& report) {
  // One element (or pair) at a time: odd T, Dn and Dv, one head and three.
  check_mla_query(report, 37, 3, 6, 4, 0, 0.7, false);
  check_mla_query(report, 37, 1, 0, 4, 1, 1.0, true);
  check_mla_key_value(report, 37, 3, 6, 4, 5, 0);
  check_mla_key_value(report, 37, 1, 0, 4, 5, 1);
  // Packs of 8.
  check_mla_query(report, 37, 3, 16, 64, 0, kDeepseekQueryScale, false);
  check_mla_key_value(report, 37, 3, 16, 64, 8, 0);
  // DeepSeek-V2-Lite's attention (16 heads, q_lora_rank none), the query in place as the model runs it.
  check_mla_query(report, 4096, 16, 128, 64, 1, kDeepseekQueryScale, true);
  check_mla_query(report, 4096, 16, 128, 64, 0, 1.0, false);
  check_mla_key_value(report, 4096, 16, 128, 64, 128, 1);
  check_mla_key_value(report, 4096, 16, 128, 64, 128, 0);

  // Odd sizes: 37 tokens, a token per row, 3 groups of 12 tokens.
  check_deepseek_router(report, 37, 64, 6, deepseek_options(false, 16.0, 8, 3), 37);
  check_deepseek_router(report, 36, 64, 6, deepseek_options(true, 1.0, 8, 3), 12);
  check_deepseek_router(report, 37, 64, 6, deepseek_options(false, 1.0, 64, 6), 1);  // groups of one expert
  // DeepSeek-V2-Lite (64 experts, top-6, greedy, scale 1) and with groups (8, top 3) and scale 16,
  // statistics per sequence of 1024 tokens and over the whole micro-batch; DeepSeek-V2's 160 experts.
  for (const RouterOptions& o : {deepseek_options(false, 1.0, 1, 1), deepseek_options(false, 16.0, 8, 3), deepseek_options(true, 16.0, 8, 3),
                                 deepseek_options(false, 1.0, 8, 3)})
    for (int64_t tokens_per_group : {1024, 4096}) check_deepseek_router(report, 4096, 64, 6, o, tokens_per_group);
  check_deepseek_router(report, 4096, 160, 6, deepseek_options(false, 16.0, 8, 3), 1024);
}

}  // namespace marrow
