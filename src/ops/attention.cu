// attention.h's ops on the CPU (the reference: templates over f32 and f64), their checks, and which
// GPU kernels run them: the own mma.sync kernels (attention_mma.cu), the own wgmma kernels
// (attention_hopper.cu, attention_hopper_backward.cu) or cuDNN's (attention_cudnn.cpp), by
// train.attention_kernels and the sizes each serves; a v head dim unlike q's and k's goes to cuDNN's
// under every setting (nothing else serves it).
// Invariants: every entry point checks shapes, block and devices before any path runs, so the paths
// check only their own dtypes and limits; the CPU references give the same bits for any thread count
// (threads own batch rows and heads; the query heads of a group add into dk, dv in head order).
// Gotcha: the backward's path and its memory estimate (attention_backward_scratch) come from one
// function, backward_path; when they were chosen in two places the hopper settings' cuDNN fallback
// ran cuDNN's float-atomic backward (docs/performance.md, GPT-OSS on one H200).
#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/memory.h"
#include "ops/attention_cudnn.h"
#include "ops/attention_hopper.h"
#include "ops/attention_mma.h"
#include "ops/common.h"

namespace marrow {

namespace {

using Dims = AttentionDims;
using NamedTensors = std::initializer_list<std::pair<const char*, const Tensor*>>;

// The keys query row i of batch row b sees, as offsets from k_begin: [first, end). A window keeps
// the keys less than `window` positions before the query (in a causal block the last `window` keys,
// its own included); documents keep those at most the query's document position before it.
struct KeyRange {
  int64_t first, end;
};
KeyRange keys_seen(const AttentionBlock& block, int64_t b, int64_t i) {
  const int64_t end = block.mask == AttentionMask::causal ? i - block.q_begin + 1 : block.k_end - block.k_begin;
  int64_t window = block.window;
  if (block.documents.data) {
    const int64_t reach = block.documents.ptr<int32_t>()[b * block.documents.size(1) + i] + 1;
    window = window == 0 ? reach : std::min(window, reach);
  }
  if (window == 0) return {0, end};
  return {std::clamp<int64_t>(block.distance + (i - block.q_begin) - window + 1, 0, end), end};
}

// sinks: [Hq] or null (none). With the sink in the running max, a sink far above the row's scores
// cannot overflow exp. A row that sees no key and no sink gets lse -inf and out 0.
template <typename T>
void forward_cpu(T* out, T* lse, const T* q, const T* k, const T* v, const T* sinks, const Dims& n, const AttentionBlock& blk) {
  const T scale = T(1 / std::sqrt(double(n.head_dim)));
  const int64_t k_len = blk.k_end - blk.k_begin;
#pragma omp parallel if (n.batch * n.q_heads * (blk.q_end - blk.q_begin) * k_len * n.head_dim > kParallelWork)
  {
    std::vector<T> p(static_cast<size_t>(k_len));
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < n.batch; ++b)
      for (int64_t h = 0; h < n.q_heads; ++h)
        for (int64_t i = blk.q_begin; i < blk.q_end; ++i) {
          const T* qi = q + n.q(b, i, h);
          const KeyRange seen = keys_seen(blk, b, i);
          T m = sinks ? sinks[h] : -std::numeric_limits<T>::infinity();
          for (int64_t j = seen.first; j < seen.end; ++j) {
            p[j] = scale * dot(qi, k + n.kv(b, blk.k_begin + j, h), n.head_dim);
            m = std::max(m, p[j]);
          }
          double sum = 0;
          for (int64_t j = seen.first; j < seen.end; ++j) {
            p[j] = std::exp(p[j] - m);
            sum += p[j];
          }
          if (sinks) sum += std::exp(sinks[h] - m);
          T* oi = out + n.out(b, i, h);
          std::fill(oi, oi + n.v_dim, T(0));
          for (int64_t j = seen.first; j < seen.end; ++j) axpy(oi, T(p[j] / sum), v + n.v(b, blk.k_begin + j, h), n.v_dim);
          lse[n.lse(b, i, h)] = T(m + std::log(sum));
        }
  }
}

// With P = exp(s - lse) and D_i = dout_i . out_i (= sum_j P[i, j] dout_i . v_j):
//   dv_j += P[i, j] dout_i,   dS[i, j] = P[i, j] (dout_i . v_j - D_i),
//   dq_i += scale sum_j dS[i, j] k_j,   dk_j += scale dS[i, j] q_i.
// lse and out are the final ones (every key block merged), so P is the true probability and the
// blocks' shares sum to the whole gradient. Query heads of one group add into the same dk, dv rows
// in a fixed order: deterministic.
// A sink (lse includes it) leaves all of that unchanged and adds dsinks[h] += -sum_i exp(sink - lse_i) D_i
// (sinks_backward_cpu); the window only drops keys.
template <typename T>
void backward_cpu(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const T* out, const T* lse, const Dims& n,
                  const AttentionBlock& blk, AttentionGrads grads) {
  const bool want_q = grads != AttentionGrads::kv, want_kv = grads != AttentionGrads::q;
  const T scale = T(1 / std::sqrt(double(n.head_dim)));
  // Threads own key/value heads: the query heads of a group add into dk, dv in head order.
  const int64_t group = n.q_heads / n.kv_heads;
#pragma omp parallel for collapse(2) schedule(static) if (n.batch * n.q_heads * (blk.q_end - blk.q_begin) * \
                                                              (blk.k_end - blk.k_begin) * n.head_dim > kParallelWork)
  for (int64_t b = 0; b < n.batch; ++b)
    for (int64_t hk = 0; hk < n.kv_heads; ++hk)
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        for (int64_t i = blk.q_begin; i < blk.q_end; ++i) {
          const int64_t qo = n.q(b, i, h), oo = n.out(b, i, h);
          const T *qi = q + qo, *douti = dout + oo;
          const T di = dot(douti, out + oo, n.v_dim), lse_i = lse[n.lse(b, i, h)];
          T* dqi = dq + qo;
          const KeyRange seen = keys_seen(blk, b, i);
          for (int64_t j = blk.k_begin + seen.first; j < blk.k_begin + seen.end; ++j) {
            const int64_t kvo = n.kv(b, j, h), vo = n.v(b, j, h);
            const T p = std::exp(scale * dot(qi, k + kvo, n.head_dim) - lse_i);
            const T ds = p * (dot(douti, v + vo, n.v_dim) - di);
            if (want_kv) axpy(dv + vo, p, douti, n.v_dim);
            if (want_q) axpy(dqi, scale * ds, k + kvo, n.head_dim);
            if (want_kv) axpy(dk + kvo, scale * ds, qi, n.head_dim);
          }
        }
      }
}

// dsinks[h] += the sum over batch rows b (in order) of each row's share -sum_i exp(sinks[h] - lse_i) D_i,
// D_i = dout_i . out_i, over query rows [0, q_seq).
template <typename T>
void sinks_backward_cpu(T* dsinks, const T* dout, const T* out, const T* lse, const T* sinks, const Dims& n) {
  std::vector<T> share(size_t(n.batch * n.q_heads));
#pragma omp parallel for collapse(2) schedule(static) if (n.batch * n.q_heads * n.q_seq * n.v_dim > kParallelWork)
  for (int64_t b = 0; b < n.batch; ++b)
    for (int64_t h = 0; h < n.q_heads; ++h) {
      T dsink = 0;
      for (int64_t i = 0; i < n.q_seq; ++i) {
        const int64_t oo = n.out(b, i, h);
        dsink -= std::exp(sinks[h] - lse[n.lse(b, i, h)]) * dot(dout + oo, out + oo, n.v_dim);
      }
      share[size_t(b * n.q_heads + h)] = dsink;
    }
  for (int64_t h = 0; h < n.q_heads; ++h)
    for (int64_t b = 0; b < n.batch; ++b) dsinks[h] += share[size_t(b * n.q_heads + h)];
}

// Rows [begin, end) of (out, lse) become the log-sum-exp merge with (part_out, part_lse). A row
// whose two lse are -inf (no key seen yet on either side) stays as it is.
template <typename T>
void merge_cpu(T* out, T* lse, const T* part_out, const T* part_lse, const Dims& n, int64_t begin, int64_t end) {
  for (int64_t b = 0; b < n.batch; ++b)
    for (int64_t h = 0; h < n.q_heads; ++h)
      for (int64_t i = begin; i < end; ++i) {
        T& l = lse[n.lse(b, i, h)];
        const T l2 = part_lse[n.lse(b, i, h)], m = std::max(l, l2);
        if (m == -std::numeric_limits<T>::infinity()) continue;
        const T w1 = std::exp(l - m), w2 = std::exp(l2 - m), sum = w1 + w2;
        T* o = out + n.out(b, i, h);
        const T* o2 = part_out + n.out(b, i, h);
        for (int64_t d = 0; d < n.v_dim; ++d) o[d] = (w1 * o[d] + w2 * o2[d]) / sum;
        l = m + std::log(sum);
      }
}

// attention_merge's arithmetic with a part of value 0 and lse sinks[h].
template <typename T>
void sinks_merge_cpu(T* out, T* lse, const T* sinks, const Dims& n) {
  for (int64_t b = 0; b < n.batch; ++b)
    for (int64_t h = 0; h < n.q_heads; ++h)
      for (int64_t i = 0; i < n.q_seq; ++i) {
        T& l = lse[n.lse(b, i, h)];
        const T m = std::max(l, sinks[h]), w1 = std::exp(l - m), sum = w1 + std::exp(sinks[h] - m);
        T* o = out + n.out(b, i, h);
        for (int64_t d = 0; d < n.v_dim; ++d) o[d] = w1 * o[d] / sum;
        l = m + std::log(sum);
      }
}

// Checks q's layout and that k and v match each other (v's head dim may differ); returns the sizes.
Dims check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  MARROW_CHECK(q.ndim == 4, "{}: q must be [batch, seq, heads, head_dim], got {}", op, q.shape_string());
  MARROW_CHECK(k.ndim == 4, "{}: k must be [batch, seq, kv_heads, head_dim], got {}", op, k.shape_string());
  MARROW_CHECK(v.ndim == 4, "{}: v must be [batch, seq, kv_heads, v_head_dim], got {}", op, v.shape_string());
  Dims n{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  expect_shape(op, "k", k, {n.batch, n.kv_seq, n.kv_heads, n.head_dim});
  expect_shape(op, "v", v, {n.batch, n.kv_seq, n.kv_heads, n.v_dim});
  MARROW_CHECK(n.kv_heads > 0 && n.q_heads % n.kv_heads == 0,
               "{}: the {} query heads of q are not a multiple of the {} key/value heads of k", op, n.q_heads,
               n.kv_heads);
  return n;
}

// out [B, Sq, Hq, Dv] and lse [B, Hq, Sq].
void check_out_lse(const char* op, const Dims& n, const Tensor& out, const Tensor& lse) {
  expect_shape(op, "out", out, {n.batch, n.q_seq, n.q_heads, n.v_dim});
  expect_shape(op, "lse", lse, {n.batch, n.q_heads, n.q_seq});
}

// A block's ranges lie inside q and k, and a causal block pairs ranges of equal length.
void check_block(const char* op, const Dims& n, const AttentionBlock& blk) {
  MARROW_CHECK(0 <= blk.q_begin && blk.q_begin <= blk.q_end && blk.q_end <= n.q_seq && 0 <= blk.k_begin &&
                   blk.k_begin <= blk.k_end && blk.k_end <= n.kv_seq,
               "{}: query rows [{}, {}) and key rows [{}, {}) do not fit {} queries and {} keys", op, blk.q_begin,
               blk.q_end, blk.k_begin, blk.k_end, n.q_seq, n.kv_seq);
  MARROW_CHECK(blk.mask == AttentionMask::full || blk.q_end - blk.q_begin == blk.k_end - blk.k_begin,
               "{}: a causal block pairs {} queries with {} keys (it needs equal counts)", op, blk.q_end - blk.q_begin,
               blk.k_end - blk.k_begin);
  MARROW_CHECK(blk.q_begin == blk.q_end || blk.k_begin < blk.k_end, "{}: {} queries see no key", op,
               blk.q_end - blk.q_begin);
  MARROW_CHECK(blk.window >= 0, "{}: the sliding window must be 0 (none) or positive, got {}", op, blk.window);
  MARROW_CHECK((blk.window == 0 && !blk.documents.data) || blk.mask == AttentionMask::full || blk.distance == 0,
               "{}: a causal block's queries and keys are the same tokens, but its distance is {}", op, blk.distance);
}

// The causal op as a block: every query row against every key row, with the variant's window and documents.
AttentionBlock whole_sequence(const Dims& n, const AttentionVariant& variant) {
  return {AttentionMask::causal, 0, n.q_seq, 0, n.q_seq, variant.window, 0, variant.documents};
}

// The backward's shape and device checks (the gradients' dtypes are the caller's); returns the
// sizes and whether the tensors are on the GPU.
std::pair<Dims, bool> check_backward(const char* op, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
                                     Tensor v, Tensor out, Tensor lse) {
  const Dims n = check_qkv(op, q, k, v);
  expect_shape(op, "dq", dq, {n.batch, n.q_seq, n.q_heads, n.head_dim});
  expect_shape(op, "dk", dk, {n.batch, n.kv_seq, n.kv_heads, n.head_dim});
  expect_shape(op, "dv", dv, {n.batch, n.kv_seq, n.kv_heads, n.v_dim});
  expect_shape(op, "dout", dout, {n.batch, n.q_seq, n.q_heads, n.v_dim});
  check_out_lse(op, n, out, lse);
  const NamedTensors tensors = {{"q", &q},       {"k", &k},   {"v", &v},   {"out", &out}, {"lse", &lse},
                                {"dout", &dout}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}};
  const bool gpu = common_device(op, tensors) == Device::cuda;
  if (!gpu) expect_same_dtype(op, tensors);
  return {n, gpu};
}

// sinks [Hq] with q's dtype and device, a window >= 0. Returns whether the op has a variant.
bool check_variant(const char* op, const Dims& n, const Tensor& q, const AttentionVariant& variant) {
  MARROW_CHECK(variant.window >= 0, "{}: the sliding window must be 0 (none) or positive, got {}", op, variant.window);
  if (variant.sinks.data) {
    expect_shape(op, "sinks", variant.sinks, {n.q_heads});
    expect_dtype(op, "sinks", variant.sinks, q.dtype);
    expect_device(op, "sinks", variant.sinks, q.device);
  }
  return variant.sinks.data || variant.window > 0 || variant.documents.data;
}

// Marrow's own kernels (mma.sync, wgmma) take one head dim of 64 or 128 for q, k and v; only cuDNN's
// serve a v head dim unlike q's and k's (DeepSeek-V2's 192 / 128) or 256 (Qwen3.5's).
bool mixed_head_dims(const Dims& n) { return n.v_dim != n.head_dim; }
bool own_serves(const Dims& n) { return !mixed_head_dims(n) && (n.head_dim == 64 || n.head_dim == 128); }

// Where head dims the own kernels do not take reach them, cuDNN's did not take the sizes either.
void expect_one_head_dim(const char* op, const Dims& n) {
  MARROW_CHECK(own_serves(n),
               "{}: head dims {} (q, k) and {} (v) run only on cuDNN's kernels, which do not serve batch {}, {} positions, {} / {} heads",
               op, n.head_dim, n.v_dim, n.batch, n.q_seq, n.q_heads, n.kv_heads);
}

// Both forwards on the own kernels or the CPU, after their checks. sinks: [Hq] or empty.
void forward(const char* op, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const Dims& n, const AttentionBlock& block,
             Tensor sinks, Stream stream) {
  const NamedTensors tensors = {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}};
  if (common_device(op, tensors) == Device::cuda) {
    expect_one_head_dim(op, n);
    return mma_attention_forward(op, out, lse, q, k, v, n, block, sinks, stream);
  }
  expect_same_dtype(op, tensors);
  with_cpu_scalar(op, q, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(out.ptr<T>(), lse.ptr<T>(), q.ptr<T>(), k.ptr<T>(), v.ptr<T>(), sinks.data ? sinks.ptr<T>() : nullptr, n, block);
  });
}

// Both backwards on the own kernels or the CPU, after their checks. accumulate: add the block's
// share into dq, dk, dv (f32 on the GPU); else overwrite them (bf16 on the GPU).
void backward(const char* op, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
              const Dims& n, const AttentionBlock& block, bool accumulate, AttentionGrads grads, bool gpu, Stream stream) {
  if (gpu) {
    expect_one_head_dim(op, n);
    return mma_attention_backward(op, dq, dk, dv, dout, q, k, v, out, lse, n, block, accumulate, grads, stream);
  }
  if (!accumulate)
    for (Tensor g : {dq, dk, dv}) fill_zero(g);
  with_cpu_scalar(op, q, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dq.ptr<T>(), dk.ptr<T>(), dv.ptr<T>(), dout.ptr<T>(), q.ptr<T>(), k.ptr<T>(), v.ptr<T>(), out.ptr<T>(),
                    lse.ptr<T>(), n, block, grads);
  });
}

AttentionKernels kernels_setting = AttentionKernels::own;

// Which kernels run the causal op on the GPU: the setting's choice where it serves the sizes, else
// the next (hopper -> cuDNN -> own); mixed head dims go to cuDNN under every setting. The wgmma
// kernels (hopper) take no variant.
enum class CausalPath : uint8_t { hopper, cudnn, own };

bool cudnn_backward_deterministic() { return kernels_setting != AttentionKernels::cudnn_nondeterministic; }

// The wgmma kernels take no variant and one head dim for q, k and v.
bool hopper_serves(const Dims& n, bool variant) {
  return !variant && own_serves(n) && hopper_attention_supports(n.q_seq, n.q_heads, n.kv_heads, n.head_dim);
}

CausalPath forward_path(const Dims& n, bool variant) {
  const AttentionKernels setting = kernels_setting;
  if (!MARROW_CUDA || (setting == AttentionKernels::own && own_serves(n))) return CausalPath::own;
  if (setting == AttentionKernels::hopper && hopper_serves(n, variant)) return CausalPath::hopper;
  return cudnn_attention_forward_supports(n.q_seq, n.head_dim, n.v_dim) ? CausalPath::cudnn : CausalPath::own;
}

CausalPath backward_path(const Dims& n, bool variant) {
  const AttentionKernels setting = kernels_setting;
  if (!MARROW_CUDA || (setting == AttentionKernels::own && own_serves(n))) return CausalPath::own;
  const bool hopper = setting == AttentionKernels::hopper || setting == AttentionKernels::hopper_backward;
  if (hopper && hopper_serves(n, variant)) return CausalPath::hopper;
  return cudnn_attention_backward_supports(n.batch, n.q_seq, n.q_heads, n.kv_heads, n.head_dim, n.v_dim, cudnn_backward_deterministic())
             ? CausalPath::cudnn
             : CausalPath::own;
}

bool cpu_blocks_fused = false;

// documents [B, Sq] i32 on q's device; on the GPU only the mma.sync kernels serve them.
void check_documents(const char* op, const Dims& n, const Tensor& q, const Tensor& documents) {
  if (!documents.data) return;
  expect_shape(op, "documents", documents, {n.batch, n.q_seq});
  expect_dtype(op, "documents", documents, DType::i32);
  expect_device(op, "documents", documents, q.device);
  MARROW_CHECK(q.device == Device::cpu || (kernels_setting == AttentionKernels::own && own_serves(n)),
               "{}: data.document_mask runs on the GPU on the own attention kernels only, with one head dim for q, k and v: set "
               "train.attention_kernels = own (DeepSeek-V2's MLA: train on the CPU)",
               op);
}

// GPU blocks: cuDNN's kernels where v's head dim differs (nothing else serves it), else the wgmma
// kernels unless the setting is own, where those serve the block, else the mma.sync kernels.
enum class BlockPath : uint8_t { hopper, cudnn, own };

BlockPath block_path(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionBlock& block) {
  if (v.size(3) != q.size(3)) return BlockPath::cudnn;
  return kernels_setting != AttentionKernels::own && hopper_attention_serves_block(q, k, block) ? BlockPath::hopper : BlockPath::own;
}

}  // namespace

void set_attention_kernels(AttentionKernels kernels) { kernels_setting = kernels; }
AttentionKernels attention_kernels() { return kernels_setting; }

// The settings' names, in the enum's order.
constexpr const char* kKernelsNames[] = {"own", "cudnn", "cudnn_nondeterministic", "hopper", "hopper_backward"};

AttentionKernels parse_attention_kernels(const std::string& name) {
  for (AttentionKernels k : kAttentionKernels)
    if (name == attention_kernels_name(k)) return k;
  fail("attention kernels must be own, cudnn, cudnn_nondeterministic, hopper or hopper_backward, got '{}'", name);
}

const char* attention_kernels_name(AttentionKernels kernels) { return kKernelsNames[size_t(kernels)]; }

void set_cpu_blocks_fused(bool fused) { cpu_blocks_fused = fused; }

bool attention_block_backward_fused(const Tensor& q, const Tensor& k, const AttentionBlock& block, const Tensor& v) {
  return q.device == Device::cpu ? cpu_blocks_fused : block_path(q, k, v.ndim == 4 ? v : k, block) != BlockPath::own;
}

void attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionVariant& variant, Stream stream) {
  const char* op = "attention_forward";
  const Dims n = check_qkv(op, q, k, v);
  expect_shape(op, "k", k, {n.batch, n.q_seq, n.kv_heads, n.head_dim});
  check_out_lse(op, n, out, lse);
  const bool has_variant = check_variant(op, n, q, variant);
  check_documents(op, n, q, variant.documents);
  const AttentionBlock whole = whole_sequence(n, variant);
  if (common_device(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}}) == Device::cuda)
    switch (forward_path(n, has_variant)) {
      case CausalPath::hopper: return hopper_attention_forward(out, lse, q, k, v, whole, stream);
      case CausalPath::cudnn: return cudnn_attention_forward(out, lse, q, k, v, variant, stream);
      case CausalPath::own: break;
    }
  forward(op, out, lse, q, k, v, n, whole, variant.sinks, stream);
}

void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                        Tensor lse, Stream stream) {
  attention_backward(dq, dk, dv, {}, dout, q, k, v, out, lse, AttentionVariant{}, stream);
}

void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dsinks, Tensor dout, Tensor q, Tensor k, Tensor v,
                        Tensor out, Tensor lse, const AttentionVariant& variant, Stream stream) {
  const char* op = "attention_backward";
  const auto [n, gpu] = check_backward(op, dq, dk, dv, dout, q, k, v, out, lse);
  expect_shape(op, "k", k, {n.batch, n.q_seq, n.kv_heads, n.head_dim});
  const bool has_variant = check_variant(op, n, q, variant);
  if (variant.sinks.data) {
    MARROW_CHECK(dsinks.data, "{}: variant.sinks is given but dsinks, its gradient, is empty", op);
    expect_shape(op, "dsinks", dsinks, {n.q_heads});
    expect_dtype(op, "dsinks", dsinks, gpu ? DType::f32 : q.dtype);
    expect_device(op, "dsinks", dsinks, q.device);
  } else {
    MARROW_CHECK(!dsinks.data, "{}: dsinks is given but variant.sinks is empty", op);
  }
  check_documents(op, n, q, variant.documents);
  const AttentionBlock whole = whole_sequence(n, variant);
  switch (gpu ? backward_path(n, has_variant) : CausalPath::own) {
    case CausalPath::hopper: return hopper_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, whole, false, AttentionGrads::all, stream);
    case CausalPath::cudnn:
      cudnn_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, variant, stream, cudnn_backward_deterministic());
      break;
    case CausalPath::own: backward(op, dq, dk, dv, dout, q, k, v, out, lse, n, whole, false, AttentionGrads::all, gpu, stream);
  }
  if (variant.sinks.data) attention_sinks_backward(dsinks, dout, out, lse, variant.sinks, stream);
}

int64_t attention_backward_scratch(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                   bool variant, int64_t v_head_dim) {
  const int64_t v_dim = v_head_dim > 0 ? v_head_dim : head_dim;
  switch (backward_path({batch, seq, seq, q_heads, kv_heads, head_dim, v_dim}, variant)) {
    case CausalPath::hopper: return hopper_attention_backward_scratch(batch, seq, q_heads, kv_heads, head_dim);
    case CausalPath::cudnn:
      return cudnn_attention_backward_scratch(batch, seq, q_heads, kv_heads, head_dim, v_dim, cudnn_backward_deterministic());
    case CausalPath::own: break;
  }
  const int64_t T = batch * seq;
  return T * q_heads * 4 + (q_heads > kv_heads ? T * q_heads * (head_dim + v_dim) * 4 : 0);
}

void attention_block_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionBlock& block,
                             Stream stream) {
  const char* op = "attention_block_forward";
  const Dims n = check_qkv(op, q, k, v);
  check_out_lse(op, n, out, lse);
  check_block(op, n, block);
  check_documents(op, n, q, block.documents);
  if (common_device(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}}) == Device::cuda)
    switch (block_path(q, k, v, block)) {
      case BlockPath::hopper: return hopper_attention_forward(out, lse, q, k, v, block, stream);
      case BlockPath::cudnn: return cudnn_attention_block_forward(out, lse, q, k, v, block, stream);
      case BlockPath::own: break;
    }
  forward(op, out, lse, q, k, v, n, block, {}, stream);
}

void attention_block_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                              Tensor lse, const AttentionBlock& block, AttentionGrads grads, Stream stream) {
  const char* op = "attention_block_backward";
  const auto [n, gpu] = check_backward(op, dq, dk, dv, dout, q, k, v, out, lse);
  check_block(op, n, block);
  check_documents(op, n, q, block.documents);
  switch (gpu ? block_path(q, k, v, block) : BlockPath::own) {
    case BlockPath::hopper: return hopper_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, block, true, grads, stream);
    case BlockPath::cudnn:
      return cudnn_attention_block_backward(dq, dk, dv, dout, q, k, v, out, lse, block, grads, stream, cudnn_backward_deterministic());
    case BlockPath::own: break;
  }
  backward(op, dq, dk, dv, dout, q, k, v, out, lse, n, block, true, grads, gpu, stream);
}

// The merge and the sinks take their sizes from out [B, S, Hq, Dv] and lse [B, Hq, S].
namespace {
Dims out_dims(const char* op, const Tensor& out, const Tensor& lse) {
  MARROW_CHECK(out.ndim == 4, "{}: out must be [batch, seq, heads, head_dim], got {}", op, out.shape_string());
  const Dims n{out.size(0), out.size(1), out.size(1), out.size(2), out.size(2), out.size(3), out.size(3)};
  expect_shape(op, "lse", lse, {n.batch, n.q_heads, n.q_seq});
  return n;
}
}  // namespace

void attention_merge(Tensor out, Tensor lse, Tensor part_out, Tensor part_lse, int64_t begin, int64_t end,
                     Stream stream) {
  const char* op = "attention_merge";
  const Dims n = out_dims(op, out, lse);
  expect_shape(op, "part_out", part_out, {n.batch, n.q_seq, n.q_heads, n.v_dim});
  expect_shape(op, "part_lse", part_lse, {n.batch, n.q_heads, n.q_seq});
  MARROW_CHECK(0 <= begin && begin <= end && end <= n.q_seq, "{}: rows [{}, {}) do not fit {} rows", op, begin, end,
               n.q_seq);
  const NamedTensors tensors = {{"out", &out}, {"lse", &lse}, {"part_out", &part_out}, {"part_lse", &part_lse}};
  if (common_device(op, tensors) == Device::cuda) return gpu_attention_merge(out, lse, part_out, part_lse, n, begin, end, stream);
  expect_same_dtype(op, tensors);
  with_cpu_scalar(op, out, [&](auto s) {
    using T = decltype(s);
    merge_cpu<T>(out.ptr<T>(), lse.ptr<T>(), part_out.ptr<T>(), part_lse.ptr<T>(), n, begin, end);
  });
}

void attention_sinks_merge(Tensor out, Tensor lse, Tensor sinks, Stream stream) {
  const char* op = "attention_sinks_merge";
  const Dims n = out_dims(op, out, lse);
  expect_shape(op, "sinks", sinks, {n.q_heads});
  const NamedTensors tensors = {{"out", &out}, {"lse", &lse}, {"sinks", &sinks}};
  if (common_device(op, tensors) == Device::cuda) return gpu_attention_sinks_merge(out, lse, sinks, n, stream);
  expect_same_dtype(op, tensors);
  with_cpu_scalar(op, out, [&](auto s) {
    using T = decltype(s);
    sinks_merge_cpu<T>(out.ptr<T>(), lse.ptr<T>(), sinks.ptr<T>(), n);
  });
}

void attention_sinks_backward(Tensor dsinks, Tensor dout, Tensor out, Tensor lse, Tensor sinks, Stream stream) {
  const char* op = "attention_sinks_backward";
  const Dims n = out_dims(op, out, lse);
  expect_shape(op, "sinks", sinks, {n.q_heads});
  expect_shape(op, "dout", dout, {n.batch, n.q_seq, n.q_heads, n.v_dim});
  expect_shape(op, "dsinks", dsinks, {n.q_heads});
  const NamedTensors tensors = {{"dsinks", &dsinks}, {"dout", &dout}, {"out", &out}, {"lse", &lse}, {"sinks", &sinks}};
  if (common_device(op, tensors) == Device::cuda) return gpu_attention_sinks_backward(dsinks, dout, out, lse, sinks, n, stream);
  expect_same_dtype(op, tensors);
  with_cpu_scalar(op, out, [&](auto s) {
    using T = decltype(s);
    sinks_backward_cpu<T>(dsinks.ptr<T>(), dout.ptr<T>(), out.ptr<T>(), lse.ptr<T>(), sinks.ptr<T>(), n);
  });
}

}  // namespace marrow
