#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/common.h"

namespace marrow {

namespace {

// Eight independent partial sums: one running sum would serialise on the latency of the add. The
// order is fixed, so the result is deterministic.
template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <typename T>
void axpy(T* y, T alpha, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

struct Dims {
  int64_t batch, seq, q_heads, kv_heads, head_dim;
  // Element offsets of row (b, i) of a query head and of a key/value head.
  int64_t q(int64_t b, int64_t i, int64_t h) const { return ((b * seq + i) * q_heads + h) * head_dim; }
  int64_t kv(int64_t b, int64_t j, int64_t h) const {
    return ((b * seq + j) * kv_heads + h / (q_heads / kv_heads)) * head_dim;
  }
  int64_t lse(int64_t b, int64_t i, int64_t h) const { return (b * q_heads + h) * seq + i; }
};

template <typename T>
void forward_cpu(T* out, T* lse, const T* q, const T* k, const T* v, const Dims& n) {
  const T scale = T(1 / std::sqrt(double(n.head_dim)));
  std::vector<T> p(n.seq);
  for (int64_t b = 0; b < n.batch; ++b)
    for (int64_t h = 0; h < n.q_heads; ++h)
      for (int64_t i = 0; i < n.seq; ++i) {
        const T* qi = q + n.q(b, i, h);
        T m = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          p[j] = scale * dot(qi, k + n.kv(b, j, h), n.head_dim);
          m = std::max(m, p[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          p[j] = std::exp(p[j] - m);
          sum += p[j];
        }
        T* oi = out + n.q(b, i, h);
        std::fill(oi, oi + n.head_dim, T(0));
        for (int64_t j = 0; j <= i; ++j) axpy(oi, T(p[j] / sum), v + n.kv(b, j, h), n.head_dim);
        lse[n.lse(b, i, h)] = T(m + std::log(sum));
      }
}

// With P = exp(s - lse) and D_i = dout_i . out_i (= sum_j P[i, j] dout_i . v_j):
//   dv_j += P[i, j] dout_i,   dS[i, j] = P[i, j] (dout_i . v_j - D_i),
//   dq_i = scale sum_j dS[i, j] k_j,   dk_j += scale dS[i, j] q_i.
// Query heads of one group add into the same dk, dv rows in a fixed order: deterministic.
template <typename T>
void backward_cpu(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const T* out, const T* lse,
                  const Dims& n) {
  const int64_t kv_numel = n.batch * n.seq * n.kv_heads * n.head_dim;
  std::fill(dk, dk + kv_numel, T(0));
  std::fill(dv, dv + kv_numel, T(0));
  const T scale = T(1 / std::sqrt(double(n.head_dim)));
  for (int64_t b = 0; b < n.batch; ++b)
    for (int64_t h = 0; h < n.q_heads; ++h)
      for (int64_t i = 0; i < n.seq; ++i) {
        const int64_t qo = n.q(b, i, h);
        const T *qi = q + qo, *douti = dout + qo;
        const T di = dot(douti, out + qo, n.head_dim), lse_i = lse[n.lse(b, i, h)];
        T* dqi = dq + qo;
        std::fill(dqi, dqi + n.head_dim, T(0));
        for (int64_t j = 0; j <= i; ++j) {
          const int64_t kvo = n.kv(b, j, h);
          const T p = std::exp(scale * dot(qi, k + kvo, n.head_dim) - lse_i);
          const T ds = p * (dot(douti, v + kvo, n.head_dim) - di);
          axpy(dv + kvo, p, douti, n.head_dim);
          axpy(dqi, scale * ds, k + kvo, n.head_dim);
          axpy(dk + kvo, scale * ds, qi, n.head_dim);
        }
      }
}

// Checks q's layout and that k and v match it; returns the sizes.
Dims check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  MARROW_CHECK(q.ndim == 4, "{}: q must be [batch, seq, heads, head_dim], got {}", op, q.shape_string());
  MARROW_CHECK(k.ndim == 4, "{}: k must be [batch, seq, kv_heads, head_dim], got {}", op, k.shape_string());
  Dims n{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  expect_shape(op, "k", k, {n.batch, n.seq, n.kv_heads, n.head_dim});
  expect_shape(op, "v", v, {n.batch, n.seq, n.kv_heads, n.head_dim});
  MARROW_CHECK(n.kv_heads > 0 && n.q_heads % n.kv_heads == 0,
               "{}: the {} query heads of q are not a multiple of the {} key/value heads of k", op, n.q_heads,
               n.kv_heads);
  return n;
}

}  // namespace

void attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, Stream stream) {
  const char* op = "attention_forward";
  const Dims n = check_qkv(op, q, k, v);
  expect_shape(op, "out", out, {n.batch, n.seq, n.q_heads, n.head_dim});
  expect_shape(op, "lse", lse, {n.batch, n.q_heads, n.seq});
  expect_same_dtype(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}});
  if (common_device(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}}) == Device::cuda)
    no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, q, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(out.ptr<T>(), lse.ptr<T>(), q.ptr<T>(), k.ptr<T>(), v.ptr<T>(), n);
  });
}

void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                        Tensor lse, Stream stream) {
  const char* op = "attention_backward";
  const Dims n = check_qkv(op, q, k, v);
  expect_shape(op, "dq", dq, {n.batch, n.seq, n.q_heads, n.head_dim});
  expect_shape(op, "dk", dk, {n.batch, n.seq, n.kv_heads, n.head_dim});
  expect_shape(op, "dv", dv, {n.batch, n.seq, n.kv_heads, n.head_dim});
  expect_shape(op, "dout", dout, {n.batch, n.seq, n.q_heads, n.head_dim});
  expect_shape(op, "out", out, {n.batch, n.seq, n.q_heads, n.head_dim});
  expect_shape(op, "lse", lse, {n.batch, n.q_heads, n.seq});
  const std::initializer_list<std::pair<const char*, const Tensor*>> tensors = {
      {"q", &q},       {"k", &k},   {"v", &v},   {"out", &out}, {"lse", &lse},
      {"dout", &dout}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}};
  expect_same_dtype(op, tensors);
  if (common_device(op, tensors) == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, q, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dq.ptr<T>(), dk.ptr<T>(), dv.ptr<T>(), dout.ptr<T>(), q.ptr<T>(), k.ptr<T>(), v.ptr<T>(),
                    out.ptr<T>(), lse.ptr<T>(), n);
  });
}

}  // namespace marrow
