// The gated delta rule (ops/gated_delta.h). Chunk algebra, per chunk of n tokens from state S0, with
// gamma_i = g_1 + ... + g_i (within the chunk), G_i = exp(gamma_i), e_i = exp(gamma_n - gamma_i) and
// M_ij = exp(gamma_i - gamma_j) for j <= i (else 0):
//   L = strict_lower(diag(beta) K K^T * M),  U = (I + L)^-1 diag(beta) V,  W = (I + L)^-1 diag(beta G) K
//   Vn = U - W S0 (each token's delta),  O = diag(G) Q S0 + (Q K^T * M) Vn,  S_n = G_n S0 + K^T diag(e) Vn.
// The backward is this algebra's transpose, chunk by chunk from the last, carrying dS; q and k get
// their l2norm's backward after the value heads of a key head are summed (in head order).
#include "ops/gated_delta.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

constexpr double kNormEps = 1e-6;  // transformers' l2norm: x / sqrt(sum x^2 + 1e-6)

// Where a (sequence, token, head)'s data sit in qkv, g/beta, o and the states.
struct Layout {
  GatedDeltaShape s;
  int64_t group() const { return s.value_heads / s.key_heads; }
  int64_t width() const { return 2 * s.key_heads * s.key_dim + s.value_heads * s.value_dim; }
  int64_t q(int64_t b, int64_t t, int64_t h) const { return (b * s.seq + t) * width() + h / group() * s.key_dim; }
  int64_t v(int64_t b, int64_t t, int64_t h) const { return (b * s.seq + t) * width() + 2 * s.key_heads * s.key_dim + h * s.value_dim; }
  int64_t gate(int64_t b, int64_t t, int64_t h) const { return (b * s.seq + t) * s.value_heads + h; }
  int64_t state(int64_t b, int64_t h) const { return (b * s.value_heads + h) * s.key_dim * s.value_dim; }
};

// CPU reference: one (sequence, value head) at a time, its data gathered into a Head.

template <typename T> T inverse_norm(const T* x, int64_t n) { return T(1) / std::sqrt(dot(x, x, n) + T(kNormEps)); }

// A head's inputs, or their gradients (q, k before the l2norm's backward).
template <typename T> struct Head {
  int64_t n, dk, dv;
  std::vector<T> q, k, v, g, beta;  // q, k l2-normalized (q times dk^-0.5) [n, dk]; v [n, dv]; g, beta [n]
  Head(int64_t n, int64_t dk, int64_t dv) : n(n), dk(dk), dv(dv), q(n * dk), k(n * dk), v(n * dv), g(n), beta(n) {}
};

template <typename T> struct Inputs : Layout { const T *qkv, *g, *beta, *s0; };  // s0 null: zeros

template <typename T> Head<T> load_head(const Inputs<T>& in, int64_t b, int64_t h) {
  const int64_t n = in.s.seq, dk = in.s.key_dim, dv = in.s.value_dim;
  Head<T> x(n, dk, dv);
  const T scale = T(1) / std::sqrt(T(dk));
  for (int64_t t = 0; t < n; ++t) {
    const T *q = in.qkv + in.q(b, t, h), *k = q + in.s.key_heads * dk, *v = in.qkv + in.v(b, t, h);
    const T rq = inverse_norm(q, dk) * scale, rk = inverse_norm(k, dk);
    for (int64_t i = 0; i < dk; ++i) x.q[t * dk + i] = q[i] * rq, x.k[t * dk + i] = k[i] * rk;
    std::copy(v, v + dv, &x.v[t * dv]);
    x.g[t] = in.g[in.gate(b, t, h)], x.beta[t] = in.beta[in.gate(b, t, h)];
  }
  return x;
}

// c[m, n] (add ? += : =) alpha op(a) op(b); a is [m, k] ([k, m] when ta), b [k, n] ([n, k] when tb).
// Every inner loop runs along contiguous memory.
template <typename T>
void matmul(T* c, const T* a, const T* b, int64_t m, int64_t n, int64_t k, bool ta, bool tb, bool add, T alpha = T(1)) {
  if (!add) std::fill(c, c + m * n, T(0));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < (tb ? n : k); ++p)  // tb: c[i][p] += a_i . b_p, else c_i += a[i][p] b_p
      if (tb) c[i * n + p] += alpha * dot(a + i * k, b + p * k, k);
      else axpy(c + i * n, alpha * (ta ? a[p * m + i] : a[i * k + p]), b + p * n, n);
}

// x[n, w] = (I + L)^-1 x, or (I + L)^-T x when transposed: L [n, n] strictly lower triangular.
template <typename T> void solve_unit_lower(T* x, const T* L, int64_t n, int64_t w, bool transposed) {
  for (int64_t s = 0; s < n; ++s) {
    const int64_t i = transposed ? n - 1 - s : s;
    for (int64_t j = transposed ? i + 1 : 0; j < (transposed ? n : i); ++j) axpy(x + i * w, -L[transposed ? j * n + i : i * n + j], x + j * w, w);
  }
}

// The intermediates of the chunk [t0, t0 + n) that the forward and the backward share.
template <typename T> struct Chunk {
  int64_t t0, n;
  std::vector<T> gamma, decay, kk, p, L, u, w, vn, qg, ke;  // decay = M, kk = K K^T, p = Q K^T * M; qg = diag(G) Q, ke = diag(e) K
  T G(int64_t i) const { return std::exp(gamma[i]); }
  T e(int64_t i) const { return std::exp(gamma[n - 1] - gamma[i]); }
};

template <typename T> Chunk<T> chunk_intermediates(const Head<T>& x, int64_t t0, int64_t n, const T* s0) {
  const int64_t dk = x.dk, dv = x.dv;
  const T *Q = &x.q[t0 * dk], *K = &x.k[t0 * dk], *beta = &x.beta[t0];
  Chunk<T> c{t0, n, std::vector<T>(n), std::vector<T>(n * n), std::vector<T>(n * n), std::vector<T>(n * n), std::vector<T>(n * n),
             std::vector<T>(n * dv), std::vector<T>(n * dk), std::vector<T>(n * dv), std::vector<T>(n * dk), std::vector<T>(n * dk)};
  for (int64_t i = 0; i < n; ++i) c.gamma[i] = (i ? c.gamma[i - 1] : T(0)) + x.g[t0 + i];
  matmul(c.kk.data(), K, K, n, n, dk, false, true, false);
  matmul(c.p.data(), Q, K, n, n, dk, false, true, false);
  for (int64_t i = 0; i < n * n; ++i) {
    const int64_t r = i / n, j = i % n;
    c.decay[i] = j <= r ? std::exp(c.gamma[r] - c.gamma[j]) : T(0), c.p[i] *= c.decay[i];
    if (j < r) c.L[i] = beta[r] * c.kk[i] * c.decay[i];
  }
  for (int64_t i = 0; i < n * dk; ++i) c.qg[i] = c.G(i / dk) * Q[i], c.ke[i] = c.e(i / dk) * K[i];
  for (int64_t i = 0; i < n * dv; ++i) c.u[i] = beta[i / dv] * x.v[t0 * dv + i];
  for (int64_t i = 0; i < n * dk; ++i) c.w[i] = beta[i / dk] * c.G(i / dk) * K[i];
  solve_unit_lower(c.u.data(), c.L.data(), n, dv, false);
  solve_unit_lower(c.w.data(), c.L.data(), n, dk, false);
  c.vn = c.u;
  matmul(c.vn.data(), c.w.data(), s0, n, dv, dk, false, false, true, T(-1));
  return c;
}

// The chunked forward of one head: s [dk, dv] enters as the initial state and leaves as the final
// one; o [n, dv] receives the outputs (null: not wanted), starts each chunk's initial state.
template <typename T> void chunked_forward_head(const Head<T>& x, int64_t chunk, T* s, T* o, std::vector<T>* starts = nullptr) {
  const int64_t dk = x.dk, dv = x.dv;
  for (int64_t t0 = 0; t0 < x.n; t0 += chunk) {
    const int64_t n = std::min(chunk, x.n - t0);
    if (starts) starts->insert(starts->end(), s, s + dk * dv);
    const Chunk<T> c = chunk_intermediates(x, t0, n, s);
    if (o) matmul(o + t0 * dv, c.qg.data(), s, n, dv, dk, false, false, false);
    if (o) matmul(o + t0 * dv, c.p.data(), c.vn.data(), n, dv, n, false, false, true);
    for (int64_t i = 0; i < dk * dv; ++i) s[i] *= c.G(n - 1);
    matmul(s, c.ke.data(), c.vn.data(), dk, dv, n, true, false, true);
  }
}

// One chunk's backward: ds [dk, dv] enters as the gradient of the chunk's final state and leaves
// as that of its initial state s0; d receives the chunk's rows.
template <typename T> void chunk_backward(const Head<T>& x, const Chunk<T>& c, const T* s0, const T* dout, T* ds, Head<T>& d) {
  const int64_t n = c.n, dk = x.dk, dv = x.dv, t0 = c.t0, last = n - 1;
  const T *Q = &x.q[t0 * dk], *K = &x.k[t0 * dk], *V = &x.v[t0 * dv], *beta = &x.beta[t0], *dO = dout + t0 * dv;
  T *dQ = &d.q[t0 * dk], *dK = &d.k[t0 * dk];
  std::vector<T> dgam(n), dpm(n * n), x_ij(n * n), dvn(n * dv), vds(n * dk), dsp(ds, ds + dk * dv);
  // dVn = P^T dO + diag(e) K dS
  matmul(dvn.data(), c.p.data(), dO, n, dv, n, true, false, false);
  matmul(dvn.data(), c.ke.data(), ds, n, dv, dk, false, false, true);
  // dQ = diag(G) dO S0^T + (dP * M) K with dP = dO Vn^T; the first term is d gamma's q part.
  matmul(dQ, dO, s0, n, dk, dv, false, true, false);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < dk; ++j) dQ[i * dk + j] *= c.G(i);
    dgam[i] += dot(Q + i * dk, dQ + i * dk, dk);
  }
  matmul(dpm.data(), dO, c.vn.data(), n, n, dv, false, true, false);
  for (int64_t i = 0; i < n * n; ++i) x_ij[i] = dpm[i] * c.p[i], dpm[i] *= c.decay[i];
  matmul(dQ, dpm.data(), K, n, dk, n, false, false, true);
  // dK = (dP * M)^T Q + diag(e) Vn dS^T; e's part of d gamma.
  matmul(dK, dpm.data(), Q, n, dk, n, true, false, false);
  matmul(vds.data(), c.vn.data(), ds, n, dk, dv, false, true, false);
  for (int64_t i = 0; i < n; ++i) {
    const T t = dot(c.ke.data() + i * dk, vds.data() + i * dk, dk);
    dgam[i] -= t, dgam[last] += t;
    axpy(dK + i * dk, c.e(i), vds.data() + i * dk, dk);
  }
  dgam[last] += c.G(last) * dot(s0, ds, dk * dv);
  // dS0 = G_n dS + Q^T diag(G) dO - W^T dVn
  for (T& v : dsp) v *= c.G(last);
  matmul(dsp.data(), c.qg.data(), dO, dk, dv, n, true, false, true);
  matmul(dsp.data(), c.w.data(), dvn.data(), dk, dv, n, true, false, true, T(-1));
  // Through the solve: dB = (I + L)^-T dU, dE = (I + L)^-T dW, dL = -(dB U^T + dE W^T).
  std::vector<T> db = dvn, de(n * dk), dl(n * n), gm(n * n);  // gm = dL * M times beta_i: d(K K^T)'s rows
  matmul(de.data(), dvn.data(), s0, n, dk, dv, false, true, false, T(-1));
  solve_unit_lower(db.data(), c.L.data(), n, dv, true);
  solve_unit_lower(de.data(), c.L.data(), n, dk, true);
  matmul(dl.data(), db.data(), c.u.data(), n, n, dv, false, true, false, T(-1));
  matmul(dl.data(), de.data(), c.w.data(), n, n, dk, false, true, true, T(-1));
  for (int64_t i = 0; i < n; ++i) {
    const T kde = c.G(i) * dot(de.data() + i * dk, K + i * dk, dk);
    for (int64_t j = 0; j < dv; ++j) d.v[(t0 + i) * dv + j] = beta[i] * db[i * dv + j];
    d.beta[t0 + i] = dot(db.data() + i * dv, V + i * dv, dv) + kde;
    dgam[i] += beta[i] * kde;
    axpy(dK + i * dk, beta[i] * c.G(i), de.data() + i * dk, dk);
    for (int64_t j = 0; j < i; ++j) {
      const T h = dl[i * n + j] * c.decay[i * n + j] * c.kk[i * n + j];
      d.beta[t0 + i] += h;
      x_ij[i * n + j] += beta[i] * h;
      gm[i * n + j] = dl[i * n + j] * beta[i] * c.decay[i * n + j];
    }
  }
  matmul(dK, gm.data(), K, n, dk, n, false, false, true);
  matmul(dK, gm.data(), K, n, dk, n, true, false, true);
  // gamma_i enters M_ij as +, M_ji as -; g_j reaches every gamma_i with i >= j.
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < i; ++j) dgam[i] += x_ij[i * n + j], dgam[j] -= x_ij[i * n + j];
  for (int64_t i = last; i >= 0; --i) d.g[t0 + i] = dgam[i] + (i < last ? d.g[t0 + i + 1] : T(0));
  std::copy(dsp.begin(), dsp.end(), ds);
}

template <typename T> void chunked_backward_head(const Head<T>& x, int64_t chunk, const T* s0, const T* dout, T* ds, Head<T>& d) {
  std::vector<T> s(s0, s0 + x.dk * x.dv), starts;
  chunked_forward_head(x, chunk, s.data(), static_cast<T*>(nullptr), &starts);
  for (int64_t c = (x.n - 1) / chunk; c >= 0; --c) {
    const T* start = &starts[c * x.dk * x.dv];
    chunk_backward(x, chunk_intermediates(x, c * chunk, std::min(chunk, x.n - c * chunk), start), start, dout, ds, d);
  }
}

// The recurrence token by token; states (when given) receives the state before each token.
template <typename T> void recurrent_forward_head(const Head<T>& x, T* s, T* o, std::vector<T>* states = nullptr) {
  const int64_t dk = x.dk, dv = x.dv;
  std::vector<T> kv(dv);
  for (int64_t t = 0; t < x.n; ++t) {
    if (states) states->insert(states->end(), s, s + dk * dv);
    const T alpha = std::exp(x.g[t]), *q = &x.q[t * dk], *k = &x.k[t * dk], *v = &x.v[t * dv];
    for (int64_t i = 0; i < dk * dv; ++i) s[i] *= alpha;
    matmul(kv.data(), k, s, 1, dv, dk, false, false, false);
    for (int64_t j = 0; j < dv; ++j) kv[j] = x.beta[t] * (v[j] - kv[j]);
    matmul(s, k, kv.data(), dk, dv, 1, true, false, true);
    if (o) matmul(o + t * dv, q, s, 1, dv, dk, false, false, false);
  }
}

// Backward of the recurrence, tokens in reverse; each step recomputes its states from the one before.
template <typename T> void recurrent_backward_head(const Head<T>& x, const T* s0, const T* dout, T* ds, Head<T>& d) {
  const int64_t dk = x.dk, dv = x.dv;
  std::vector<T> s(s0, s0 + dk * dv), states, sp(dk * dv), st(dk * dv), r(dv), u(dv), du(dv);
  recurrent_forward_head(x, s.data(), static_cast<T*>(nullptr), &states);
  for (int64_t t = x.n - 1; t >= 0; --t) {
    const T alpha = std::exp(x.g[t]), beta = x.beta[t], *q = &x.q[t * dk], *k = &x.k[t * dk], *v = &x.v[t * dv], *dO = dout + t * dv;
    T *dq = &d.q[t * dk], *dk_t = &d.k[t * dk];
    for (int64_t i = 0; i < dk * dv; ++i) sp[i] = alpha * states[t * dk * dv + i];
    matmul(r.data(), k, sp.data(), 1, dv, dk, false, false, false);
    for (int64_t j = 0; j < dv; ++j) r[j] = v[j] - r[j], u[j] = beta * r[j];
    st = sp;
    matmul(st.data(), k, u.data(), dk, dv, 1, true, false, true);
    matmul(dq, dO, st.data(), 1, dk, dv, false, true, false);  // o = S_t^T q
    matmul(ds, q, dO, dk, dv, 1, true, false, true);
    matmul(du.data(), k, ds, 1, dv, dk, false, false, false);  // S_t = S' + k u^T
    matmul(dk_t, u.data(), ds, 1, dk, dv, false, true, false);
    for (int64_t j = 0; j < dv; ++j) d.v[t * dv + j] = beta * du[j];
    d.beta[t] = dot(du.data(), r.data(), dv);
    matmul(ds, k, du.data(), dk, dv, 1, true, false, true, -beta);  // u = beta (v - S'^T k)
    matmul(dk_t, du.data(), sp.data(), 1, dk, dv, false, true, true, -beta);
    d.g[t] = dot(sp.data(), ds, dk * dv);  // S' = exp(g) S_{t-1}
    for (int64_t i = 0; i < dk * dv; ++i) ds[i] *= alpha;
  }
}

template <typename T> std::vector<T> head_state(const T* states, int64_t at, int64_t n) {
  return states ? std::vector<T>(states + at, states + at + n) : std::vector<T>(n);
}

// f(b, head) for every sequence and head (of `heads` a sequence) over OpenMP threads.
template <typename F> void for_each_head(const Layout& l, int64_t heads, const F& f) {
#pragma omp parallel for schedule(static) if (l.s.batch * l.s.value_heads * l.s.seq * l.s.key_dim * l.s.value_dim > kParallelWork)
  for (int64_t bh = 0; bh < l.s.batch * heads; ++bh) f(bh / heads, bh % heads);
}

template <typename T> void forward_cpu(const Inputs<T>& in, T* o, T* final_state, int64_t chunk) {
  const int64_t dk = in.s.key_dim, dv = in.s.value_dim, heads = in.s.value_heads;
  for_each_head(in, heads, [&](int64_t b, int64_t h) {
    const Head<T> x = load_head(in, b, h);
    std::vector<T> s = head_state(in.s0, in.state(b, h), dk * dv), out(x.n * dv);
    if (chunk > 0) chunked_forward_head(x, chunk, s.data(), out.data());
    else recurrent_forward_head(x, s.data(), out.data());
    for (int64_t t = 0; t < x.n; ++t) std::copy(&out[t * dv], &out[(t + 1) * dv], o + ((b * x.n + t) * heads + h) * dv);
    if (final_state) std::copy(s.begin(), s.end(), final_state + in.state(b, h));
  });
}

// A key head at a time (one thread writes all its outputs): its value heads' backwards in head
// order, their q, k gradients summed, then the l2norm's: dx = c r (dy - (y . dy) y / c^2), y = c r x.
template <typename T>
void backward_cpu(const Inputs<T>& in, T* dqkv, T* dg, T* dbeta, T* d_initial, const T* dout, const T* d_final, int64_t chunk) {
  const int64_t S = in.s.seq, dk = in.s.key_dim, dv = in.s.value_dim, heads = in.s.value_heads, group = in.group();
  for_each_head(in, in.s.key_heads, [&](int64_t b, int64_t hk) {
    std::vector<T> dq(S * dk), dkey(S * dk), y(dk);
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const Head<T> x = load_head(in, b, h);
      std::vector<T> s0 = head_state(in.s0, in.state(b, h), dk * dv), ds = head_state(d_final, in.state(b, h), dk * dv), o(S * dv);
      for (int64_t t = 0; t < S; ++t) std::copy(dout + ((b * S + t) * heads + h) * dv, dout + ((b * S + t) * heads + h + 1) * dv, &o[t * dv]);
      Head<T> d(S, dk, dv);
      if (chunk > 0) chunked_backward_head(x, chunk, s0.data(), o.data(), ds.data(), d);
      else recurrent_backward_head(x, s0.data(), o.data(), ds.data(), d);
      axpy(dq.data(), T(1), d.q.data(), S * dk), axpy(dkey.data(), T(1), d.k.data(), S * dk);
      for (int64_t t = 0; t < S; ++t) {
        std::copy(&d.v[t * dv], &d.v[(t + 1) * dv], dqkv + in.v(b, t, h));
        dg[in.gate(b, t, h)] = d.g[t], dbeta[in.gate(b, t, h)] = d.beta[t];
      }
      if (d_initial) std::copy(ds.begin(), ds.end(), d_initial + in.state(b, h));
    }
    for (int64_t t = 0; t < S; ++t)
      for (int side = 0; side < 2; ++side) {
        const int64_t at = in.q(b, t, hk * group) + side * in.s.key_heads * dk;
        const T c = side ? T(1) : T(1) / std::sqrt(T(dk)), r = inverse_norm(in.qkv + at, dk), *dy = &(side ? dkey : dq)[t * dk];
        for (int64_t i = 0; i < dk; ++i) y[i] = c * r * in.qkv[at + i];
        const T a = dot(y.data(), dy, dk) / (c * c);
        for (int64_t i = 0; i < dk; ++i) dqkv[at + i] = c * r * (dy[i] - a * y[i]);
      }
  });
}

template <typename T> T* ptr_or_null(const Tensor& t) { return t.data ? t.ptr<T>() : nullptr; }  // an optional state

// Entry checks, shared by the four ops. The shape from out ([B, S, Hv, Dv]: o or d_out) and the split of qkv; checks the tensors
// shaped like qkv, like g (g, beta and their gradients) and the states that are given.
using Named = std::initializer_list<std::pair<const char*, const Tensor*>>;
GatedDeltaShape check_shapes(const char* op, const char* out_name, const Tensor& out, int64_t key_heads, int64_t key_dim, Named like_qkv,
                             Named like_g, Named states) {
  expect_ndim(op, out_name, out, 4, "[batch, seq, value_heads, value_dim]");
  const GatedDeltaShape s{out.size(0), out.size(1), key_heads, key_dim, out.size(2), out.size(3)};
  MARROW_CHECK(key_heads > 0 && key_dim > 0 && s.value_heads % key_heads == 0,
               "{}: key_heads ({}) must be positive and divide the value heads ({}), key_dim ({}) positive", op, key_heads, s.value_heads, key_dim);
  for (auto& [name, t] : like_qkv) expect_shape(op, name, *t, {s.batch, s.seq, Layout{s}.width()});
  for (auto& [name, t] : like_g) expect_shape(op, name, *t, {s.batch, s.seq, s.value_heads});
  for (auto& [name, t] : states)
    if (t->data) expect_shape(op, name, *t, {s.batch, s.value_heads, key_dim, s.value_dim});
  return s;
}

// An optional f32 state as an operand of on_gpu; an absent one stands in as qkv (nothing to check).
Operand state_operand(const char* name, const Tensor& t, const Tensor& qkv) {
  return {name, t.data ? &t : &qkv, t.data ? DType::f32 : DType::bf16};
}

void check_gpu_sizes(const char* op, const GatedDeltaShape& s, int64_t chunk) {
  MARROW_CHECK(chunk == 64 && s.key_dim <= 128 && s.value_dim <= 128, "{}: the GPU kernels take chunks of 64 tokens (the recurrence runs "
               "on the CPU only) and key and value dims up to 128, got chunk {} and dims {}, {}", op, chunk, s.key_dim, s.value_dim);
}

// GPU, chunks of kC = 64. Scratch holds a row per token of each (sequence, value head), rows padded to whole chunks (zeros
// past the end add nothing: beta = 0, q = k = 0), columns to dkp, dvp (multiples of 32). Forward: prepare (a block a chunk:
// normalized q, k; W, U by an f32 solve, a column a thread; P = Q K^T * M), scan<false> (a block per 32 value columns of a
// head, the chunks in turn: Vn, O, states). Backward: prepare, scan<false>, scan<true> (dVn, dS, chunks in reverse),
// grad (per chunk), finish_qk. Products on tensor cores (mma.sync m16n8k16, bf16 operands in shared memory,
// f32 sums); the carried states, U, dW, dVn and the solves stay f32. Deterministic: no atomics, every sum in a fixed order.

int64_t round32(int64_t n) { return (n + 31) / 32 * 32; }

struct ScratchSize {
  int64_t chunks, dkp, dvp, rows;  // rows: B * Hv * chunks * 64
  explicit ScratchSize(const GatedDeltaShape& s)
      : chunks((s.seq + 63) / 64), dkp(round32(s.key_dim)), dvp(round32(s.value_dim)), rows(s.batch * s.value_heads * chunks * 64) {}
  // forward: qn, kn, w (bf16 [rows, dkp]), u (f32 [rows, dvp]), p (bf16 [rows, 64]); gpu_args carves them
  int64_t forward_bytes() const { return rows * (3 * dkp * 2 + dvp * 4 + 64 * 2); }
  // + states, dstates (bf16 [rows / 64, dkp, dvp]), vn (bf16), dvn (f32) [rows, dvp], dq, dk, dw (f32 [rows, dkp])
  int64_t backward_bytes() const { return forward_bytes() + rows / 64 * dkp * dvp * 4 + rows * (dvp * 6 + dkp * 12); }
};

#ifdef __CUDACC__
constexpr int kC = 64, kThreads = 256, kWarps = 8, kBV = 32;  // chunk, block, value columns of a scan block
constexpr int kLdC = kC + 8, kLdBV = kBV + 8, kLdL = kC + 1;  // bf16 rows padded 16 bytes (ldmatrix banks); f32 [64][65]
constexpr int kGam = 0, kG = kC, kE = 2 * kC, kBeta = 3 * kC;  // a chunk's gates in shared memory (gamma first: gt[r] is gamma_r)

struct Scratch { bf16 *qn, *kn, *w, *p, *states, *vn, *dstates; float *u, *dvn, *dq, *dk, *dw; };

// Everything a kernel reads; blockIdx.y is the value head, blockIdx.z the sequence.
struct Args {
  const bf16 *qkv, *dout;  const float *g, *beta, *s0, *ds_final;
  bf16 *o, *dqkv;  float *s_final, *dg, *dbeta, *ds0;
  int S, Hk, Dk, Hv, Dv, dkp, dvp, chunks, width;
  Scratch x;
  __device__ int64_t head() const { return int64_t(blockIdx.z) * Hv + blockIdx.y; }
  __device__ int64_t row(int c, int r) const { return (head() * chunks + c) * kC + r; }  // scratch row of token 64 c + r
  __device__ bool valid(int c, int r) const { return c * kC + r < S; }
  __device__ int64_t token(int c, int r) const { return int64_t(blockIdx.z) * S + c * kC + r; }
  __device__ int64_t gate(int c, int r) const { return token(c, r) * Hv + blockIdx.y; }  // g, beta, o rows
  __device__ int64_t qkv_q(int c, int r) const { return token(c, r) * width + blockIdx.y / (Hv / Hk) * Dk; }
  __device__ int64_t qkv_v(int c, int r) const { return token(c, r) * width + 2 * Hk * Dk + blockIdx.y * Dv; }
  __device__ int64_t state(int c) const { return (head() * chunks + c) * dkp * dvp; }
};

// Shared memory (or scratch) carved in 16-byte aligned pieces; run on the host from 0 it gives the size.
struct Carve {
  uintptr_t at = 0;
  template <typename T> __host__ __device__ T* take(int64_t n) {
    T* p = reinterpret_cast<T*>(at);
    at += uintptr_t(n * int64_t(sizeof(T)) + 15) / 16 * 16;
    return p;
  }
  __host__ __device__ bf16* tile(int rows, int cols) { return take<bf16>(rows * (cols + 8)); }  // rows padded by 16 bytes
};

template <class Smem, typename... Dims> __device__ Smem carve(Dims... dims) {
  extern __shared__ __align__(16) char smem[];
  Carve m{reinterpret_cast<uintptr_t>(smem)};
  return Smem(m, dims...);
}

template <bool Trans> __device__ __forceinline__ void ldsm(uint32_t (&r)[4], const bf16* p) {
  if (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_address(p)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_address(p)));
}
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc[16 x 32] += A[m0.., :k] B[:k, n0..] for one warp, operands bf16 in shared memory: A [M][K] row
// stride lda (AT: stored [K][M]), B stored [N][K] (BT: [K][N]). Fragments as attention_mma.cu's
// head comment lays out; ldmatrix.trans reads the transposed stores. k a multiple of 16.
template <bool AT, bool BT>
__device__ __forceinline__ void warp_mma(float (&acc)[4][4], const bf16* a, int lda, const bf16* b, int ldb, int m0, int n0, int k) {
  const int lane = threadIdx.x % 32, l8 = lane % 8, lo = lane / 8 % 2 * 8, hi = lane / 16 * 8;
  for (int k0 = 0; k0 < k; k0 += 16) {
    uint32_t af[4];
    ldsm<AT>(af, AT ? a + (k0 + hi + l8) * lda + m0 + lo : a + (m0 + lo + l8) * lda + k0 + hi);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      uint32_t bf[4];  // b0, b1 of n-tile 2 np, then of 2 np + 1
      ldsm<BT>(bf, BT ? b + (k0 + lo + l8) * ldb + n0 + np * 16 + hi : b + (n0 + np * 16 + hi + l8) * ldb + k0 + lo);
      mma(acc[2 * np], af, bf[0], bf[1]);
      mma(acc[2 * np + 1], af, bf[2], bf[3]);
    }
  }
}

// The m x n product (multiples of 16 and 32) in 16 x 32 warp tiles: mul(acc, m0, n0) accumulates a
// tile, out(r, c, value) takes its elements. Equal m, n give every element the same thread.
template <class Mul, class Out> __device__ __forceinline__ void block_tiles(int m, int n, const Mul& mul, const Out& out) {
  const int lane = threadIdx.x % 32, across = n / 32;
  for (int t = threadIdx.x / 32; t < m / 16 * across; t += kWarps) {
    const int m0 = t / across * 16, n0 = t % across * 32;
    float acc[4][4] = {};
    mul(acc, m0, n0);
#pragma unroll
    for (int j = 0; j < 16; ++j) out(m0 + lane / 4 + j % 4 / 2 * 8, n0 + 8 * (j / 4) + lane % 4 * 2 + j % 2, acc[j / 4][j % 4]);
  }
}

// A warp tile's rows times f[row]; then per row the sum over its 32 columns of acc * x (bf16, row
// stride ld) into part[row * 4 + n0 / 32] (the quad's lanes summed in a fixed tree).
__device__ __forceinline__ void scale_and_dot(float (&acc)[4][4], int m0, int n0, const float* f, const bf16* x, int ld, float* part) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < 16; ++j) acc[j / 4][j % 4] *= f[m0 + g + j % 4 / 2 * 8];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float s = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) s += acc[j / 2][2 * h + j % 2] * float(x[(m0 + g + 8 * h) * ld + n0 + 8 * (j / 2) + 2 * t + j % 2]);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (t == 0) part[(m0 + g + 8 * h) * 4 + n0 / 32] = s;
  }
}

// tile[r][c] (row stride ld) = bf16(value(r, c)) for r < rows, c < cols.
template <class F> __device__ __forceinline__ void fill(bf16* tile, int ld, int rows, int cols, const F& value) {
  for (int i = threadIdx.x; i < rows * cols; i += kThreads) tile[i / cols * ld + i % cols] = bf16(value(i / cols, i % cols));
}
// rows x cols of a scratch array (row length cols) as a bf16 tile of row stride cols + 8, times scale[row] if given.
template <typename T> __device__ __forceinline__ void load(bf16* tile, const T* src, int rows, int cols, const float* scale = nullptr) {
  fill(tile, cols + 8, rows, cols, [&](int r, int c) { return float(src[r * cols + c]) * (scale ? scale[r] : 1.f); });
}

// A chunk's gates: gamma (cumulative; rows past the end add 0, so gamma[63] is the last token's),
// G = exp(gamma), E = exp(gamma[63] - gamma), beta (0 past the end).
__device__ void load_gates(const Args& a, int c, float* gates) {
  const int r = threadIdx.x;
  if (r < kC) gates[kGam + r] = a.valid(c, r) ? a.g[a.gate(c, r)] : 0.f, gates[kBeta + r] = a.valid(c, r) ? a.beta[a.gate(c, r)] : 0.f;
  __syncthreads();
  for (int i = 1; r == 0 && i < kC; ++i) gates[kGam + i] += gates[kGam + i - 1];
  __syncthreads();
  if (r < kC) gates[kG + r] = expf(gates[kGam + r]), gates[kE + r] = expf(gates[kGam + kC - 1] - gates[kGam + r]);
  __syncthreads();
}

// x = (I + L)^-1 x for a column of 64 rows per thread, L [64][65] strictly lower triangular in
// shared memory (all threads read one address at a time: broadcasts). Backward: x = (I + L)^-T x
// from L's transpose (upper triangular), stored so that both walk its rows.
template <bool Backward> __device__ __forceinline__ void solve_column(float (&x)[kC], const float* L) {
#pragma unroll
  for (int s = 0; s < kC; ++s) {
    const int i = Backward ? kC - 1 - s : s;
#pragma unroll
    for (int j = Backward ? i + 1 : 0; j < (Backward ? kC : i); ++j) x[i] = fmaf(-L[i * kLdL + j], x[j], x[i]);
  }
}

struct PrepareSmem {
  float *gates, *L;  bf16 *q, *k;
  __host__ __device__ PrepareSmem(Carve& m, int dkp)
      : gates(m.take<float>(4 * kC)), L(m.take<float>(kC * kLdL)), q(m.tile(kC, dkp)), k(m.tile(kC, dkp)) {}
};

__global__ void __launch_bounds__(kThreads) prepare_kernel(Args a) {
  const PrepareSmem s = carve<PrepareSmem>(a.dkp);
  const int c = blockIdx.x, lane = threadIdx.x % 32, ldk = a.dkp + 8;
  const float* gt = s.gates;
  begin_after_previous_grid();
  load_gates(a, c, s.gates);
  for (int r = threadIdx.x / 32; r < kC; r += kWarps)
    for (int side = 0; side < 2; ++side) {  // a warp a row: q times Dk^-0.5, then k
      const bool ok = a.valid(c, r);
      const bf16* x = a.qkv + (ok ? a.qkv_q(c, r) + side * a.Hk * a.Dk : 0);
      float ss = 0;
      for (int i = lane; ok && i < a.Dk; i += 32) ss += float(x[i]) * float(x[i]);
      const float inv = rsqrtf(warp_sum(ss) + float(kNormEps)) * (side ? 1.f : rsqrtf(float(a.Dk)));
      bf16 *tile = side ? s.k : s.q, *out = (side ? a.x.kn : a.x.qn) + a.row(c, r) * a.dkp;
      for (int i = lane; i < a.dkp; i += 32) tile[r * ldk + i] = out[i] = bf16(ok && i < a.Dk ? float(x[i]) * inv : 0.f);
    }
  __syncthreads();
  block_tiles(kC, kC, [&](auto& acc, int m0, int n0) { warp_mma<false, false>(acc, s.k, ldk, s.k, ldk, m0, n0, a.dkp); },
              [&](int r, int j, float v) { s.L[r * kLdL + j] = j < r ? gt[kBeta + r] * v * expf(gt[r] - gt[j]) : 0.f; });
  block_tiles(kC, kC, [&](auto& acc, int m0, int n0) { warp_mma<false, false>(acc, s.q, ldk, s.k, ldk, m0, n0, a.dkp); },
              [&](int r, int j, float v) { a.x.p[(a.row(c, 0) + r) * kC + j] = bf16(j <= r ? v * expf(gt[r] - gt[j]) : 0.f); });
  __syncthreads();
  // Columns of W = (I + L)^-1 diag(beta G) K (the first dkp threads) and U = (I + L)^-1 diag(beta) V.
  if (threadIdx.x >= a.dkp + a.dvp) return;
  const bool is_w = threadIdx.x < a.dkp;
  const int j = is_w ? threadIdx.x : threadIdx.x - a.dkp;
  float x[kC];
#pragma unroll
  for (int i = 0; i < kC; ++i)
    x[i] = gt[kBeta + i] * (is_w ? gt[kG + i] * float(s.k[i * ldk + j]) : a.valid(c, i) && j < a.Dv ? float(a.qkv[a.qkv_v(c, i) + j]) : 0.f);
  solve_column<false>(x, s.L);
#pragma unroll
  for (int i = 0; i < kC; ++i)
    if (is_w) a.x.w[a.row(c, i) * a.dkp + j] = bf16(x[i]);
    else a.x.u[a.row(c, i) * a.dvp + j] = x[i];
}

// The scans': a state (or state gradient) tile [dkp][32] in f32 and as bf16, and a chunk's operands.
struct ScanSmem {
  float *gates, *s;  bf16 *sb, *qg, *ke, *w, *p, *vn, *t;
  __host__ __device__ ScanSmem(Carve& m, int dkp)
      : gates(m.take<float>(4 * kC)), s(m.take<float>(dkp * kBV)), sb(m.tile(dkp, kBV)), qg(m.tile(kC, dkp)), ke(m.tile(kC, dkp)),
        w(m.tile(kC, dkp)), p(m.tile(kC, kC)), vn(m.tile(kC, kBV)), t(m.tile(kC, kBV)) {}
};

// The state tile (rows < Dk, columns v0 + j < Dv of head's [Dk, Dv]) from `from` (null: zeros) into
// the f32 and bf16 tiles, or (to) from the f32 tile into `to`.
__device__ void state_tile(const Args& a, const ScanSmem& s, const float* from, float* to) {
  for (int i = threadIdx.x; i < a.dkp * kBV; i += kThreads) {
    const int r = i / kBV, j = blockIdx.x * kBV + i % kBV;
    const bool ok = r < a.Dk && j < a.Dv;
    const int64_t at = (a.head() * a.Dk + r) * a.Dv + j;
    if (to && ok) to[at] = s.s[i];
    if (!to) s.s[i] = from && ok ? from[at] : 0.f, s.sb[r * kLdBV + i % kBV] = bf16(s.s[i]);
  }
}

// Value columns [32 blockIdx.x, +32) of one head, over the chunks in order (Backward: in reverse),
// carrying a state tile S (Backward: dS, the gradient of the chunk's final state):
//   forward:  Vn = U - W S0, O = diag(G) Q S0 + P Vn, S = G_63 S0 + (diag(E) K)^T Vn
//   backward: dVn = P^T dO + diag(E) K dS, dS0 = G_63 dS + (diag(G) Q)^T dO - W^T dVn.
// The tile at each chunk's start (Backward: end) goes to states (dstates) as bf16 when wanted.
template <bool Backward> __global__ void __launch_bounds__(kThreads) scan_kernel(Args a) {
  const ScanSmem s = carve<ScanSmem>(a.dkp);
  const int v0 = blockIdx.x * kBV, ldk = a.dkp + 8;
  bf16* states = Backward ? a.x.dstates : a.x.states;
  begin_after_previous_grid();
  state_tile(a, s, Backward ? a.ds_final : a.s0, nullptr);
  for (int step = 0; step < a.chunks; ++step) {
    const int c = Backward ? a.chunks - 1 - step : step;
    const int64_t r0 = a.row(c, 0);
    __syncthreads();
    for (int i = threadIdx.x; states && i < a.dkp * kBV; i += kThreads)
      states[a.state(c) + i / kBV * a.dvp + v0 + i % kBV] = s.sb[i / kBV * kLdBV + i % kBV];
    load_gates(a, c, s.gates);
    load(s.qg, a.x.qn + r0 * a.dkp, kC, a.dkp, s.gates + kG);
    load(s.ke, a.x.kn + r0 * a.dkp, kC, a.dkp, s.gates + kE);
    load(s.w, a.x.w + r0 * a.dkp, kC, a.dkp);
    load(s.p, a.x.p + r0 * kC, kC, kC);
    if (Backward)
      fill(s.vn, kLdBV, kC, kBV, [&](int r, int j) { return a.valid(c, r) && v0 + j < a.Dv ? float(a.dout[a.gate(c, r) * a.Dv + v0 + j]) : 0.f; });
    __syncthreads();
    const auto update = [&](int r, int j, float v) { s.s[r * kBV + j] = fmaf(s.gates[kG + kC - 1], s.s[r * kBV + j], v); };
    if constexpr (Backward) {
      block_tiles(kC, kBV, [&](auto& acc, int m0, int n0) {
        warp_mma<true, true>(acc, s.p, kLdC, s.vn, kLdBV, m0, n0, kC);
        warp_mma<false, true>(acc, s.ke, ldk, s.sb, kLdBV, m0, n0, a.dkp);
      }, [&](int r, int j, float v) { a.x.dvn[(r0 + r) * a.dvp + v0 + j] = v, s.t[r * kLdBV + j] = bf16(-v); });
      __syncthreads();
      block_tiles(a.dkp, kBV, [&](auto& acc, int m0, int n0) {
        warp_mma<true, true>(acc, s.qg, ldk, s.vn, kLdBV, m0, n0, kC);
        warp_mma<true, true>(acc, s.w, ldk, s.t, kLdBV, m0, n0, kC);
      }, update);
    } else {
      block_tiles(kC, kBV, [&](auto& acc, int m0, int n0) { warp_mma<false, true>(acc, s.w, ldk, s.sb, kLdBV, m0, n0, a.dkp); },
                  [&](int r, int j, float v) {
                    s.vn[r * kLdBV + j] = bf16(a.x.u[(r0 + r) * a.dvp + v0 + j] - v);
                    if (a.x.vn) a.x.vn[(r0 + r) * a.dvp + v0 + j] = s.vn[r * kLdBV + j];
                  });
      __syncthreads();
      if (a.o)
        block_tiles(kC, kBV, [&](auto& acc, int m0, int n0) {
          warp_mma<false, true>(acc, s.qg, ldk, s.sb, kLdBV, m0, n0, a.dkp);
          warp_mma<false, true>(acc, s.p, kLdC, s.vn, kLdBV, m0, n0, kC);
        }, [&](int r, int j, float v) { if (a.valid(c, r) && v0 + j < a.Dv) a.o[a.gate(c, r) * a.Dv + v0 + j] = bf16(v); });
      block_tiles(a.dkp, kBV, [&](auto& acc, int m0, int n0) { warp_mma<true, true>(acc, s.ke, ldk, s.vn, kLdBV, m0, n0, kC); }, update);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < a.dkp * kBV; i += kThreads) s.sb[i / kBV * kLdBV + i % kBV] = bf16(s.s[i]);
  }
  __syncthreads();
  if (Backward ? a.ds0 : a.s_final) state_tile(a, s, nullptr, Backward ? a.ds0 : a.s_final);
}

// The backward's per-chunk part: first its terms through the states and P, then (its shared memory reused) through the solve.
struct GradSmem {
  float *gates, *dgam, *part, *red, *x, *kk, *L;  bf16 *k, *dout, *vn, *dvn, *s0, *ds, *q, *dpm, *w, *u, *de, *db, *gm;
  __host__ __device__ GradSmem(Carve& m, int dkp, int dvp) {
    gates = m.take<float>(4 * kC), dgam = m.take<float>(kC), part = m.take<float>(kC * kWarps), red = m.take<float>(kWarps), k = m.tile(kC, dkp);
    Carve wy = m;  // the solve's pieces over the first part's
    x = m.take<float>(kC * kLdL), dout = m.tile(kC, dvp), vn = m.tile(kC, dvp), dvn = m.tile(kC, dvp), s0 = m.tile(dkp, dvp);
    ds = m.tile(dkp, dvp), q = m.tile(kC, dkp), dpm = m.tile(kC, kC);
    kk = wy.take<float>(kC * kLdL), L = wy.take<float>(kC * kLdL), w = wy.tile(kC, dkp), u = wy.tile(kC, dvp), de = wy.tile(kC, dkp);
    db = wy.tile(kC, dvp), gm = wy.tile(kC, kC);
    m.at = m.at > wy.at ? m.at : wy.at;
  }
};

// A chunk's gradients. Through its state terms and P: dQ = diag(G) dO S0^T + dPm K, dK = dPm^T Q + diag(E) Vn dS^T, dW = -dVn S0^T
// (dP = dO Vn^T, dPm = dP * M) and d gamma's terms from these: rows of dQ's first term dotted with Q, E's part, P's decays, G_63's
// <S0, dS>. Then through the solve: dE = (I + L)^-T dW, dB = (I + L)^-T dVn (a column a thread), dV = diag(beta) dB,
// dL = -(dB U^T + dE W^T), dbeta, dK += diag(beta G) dE + Gm K + Gm^T K (Gm = dL * M times beta_i), and dg, the reverse
// cumulative sum of d gamma.
__global__ void __launch_bounds__(kThreads) grad_kernel(Args a) {
  const GradSmem s = carve<GradSmem>(a.dkp, a.dvp);
  const int c = blockIdx.x, ldk = a.dkp + 8, ldv = a.dvp + 8, lane = threadIdx.x % 32, tiles = a.dkp / 32;
  const int64_t r0 = a.row(c, 0);
  const float* gt = s.gates;
  begin_after_previous_grid();
  load_gates(a, c, s.gates);
  fill(s.dout, ldv, kC, a.dvp, [&](int r, int j) { return a.valid(c, r) && j < a.Dv ? float(a.dout[a.gate(c, r) * a.Dv + j]) : 0.f; });
  load(s.vn, a.x.vn + r0 * a.dvp, kC, a.dvp);
  load(s.dvn, a.x.dvn + r0 * a.dvp, kC, a.dvp);
  load(s.s0, a.x.states + a.state(c), a.dkp, a.dvp);
  load(s.ds, a.x.dstates + a.state(c), a.dkp, a.dvp);
  load(s.q, a.x.qn + r0 * a.dkp, kC, a.dkp);
  load(s.k, a.x.kn + r0 * a.dkp, kC, a.dkp);
  __syncthreads();
  block_tiles(kC, kC, [&](auto& acc, int m0, int n0) { warp_mma<false, false>(acc, s.dout, ldv, s.vn, ldv, m0, n0, a.dvp); },
              [&](int r, int j, float v) {  // x = dP * P below the diagonal
                s.dpm[r * kLdC + j] = bf16(j <= r ? v * expf(gt[r] - gt[j]) : 0.f);
                s.x[r * kLdL + j] = j < r ? v * float(a.x.p[(r0 + r) * kC + j]) : 0.f;
              });
  __syncthreads();
  block_tiles(kC, a.dkp, [&](auto& acc, int m0, int n0) {
    warp_mma<false, false>(acc, s.dout, ldv, s.s0, ldv, m0, n0, a.dvp);
    scale_and_dot(acc, m0, n0, gt + kG, s.q, ldk, s.part);
    warp_mma<false, true>(acc, s.dpm, kLdC, s.k, ldk, m0, n0, kC);
  }, [&](int r, int i, float v) { a.x.dq[(r0 + r) * a.dkp + i] = v; });
  block_tiles(kC, a.dkp, [&](auto& acc, int m0, int n0) {
    warp_mma<false, false>(acc, s.vn, ldv, s.ds, ldv, m0, n0, a.dvp);
    scale_and_dot(acc, m0, n0, gt + kE, s.k, ldk, s.part + 4 * kC);
    warp_mma<true, true>(acc, s.dpm, kLdC, s.q, ldk, m0, n0, kC);
  }, [&](int r, int i, float v) { a.x.dk[(r0 + r) * a.dkp + i] = v; });
  block_tiles(kC, a.dkp, [&](auto& acc, int m0, int n0) { warp_mma<false, false>(acc, s.dvn, ldv, s.s0, ldv, m0, n0, a.dvp); },
              [&](int r, int i, float v) { a.x.dw[(r0 + r) * a.dkp + i] = -v; });
  float sd = 0;
  for (int i = threadIdx.x, at; i < a.dkp * a.dvp; i += kThreads) at = i / a.dvp * ldv + i % a.dvp, sd += float(s.s0[at]) * float(s.ds[at]);
  sd = warp_sum(sd);
  if (lane == 0) s.red[threadIdx.x / 32] = sd;
  __syncthreads();
  if (threadIdx.x < kC) {
    const int r = threadIdx.x;
    float d = 0;
    for (int i = 0; i < tiles; ++i) d += s.part[r * 4 + i] - s.part[4 * kC + r * 4 + i];
    for (int j = 0; j < kC; ++j) d += s.x[r * kLdL + j] - s.x[j * kLdL + r];
    for (int w = 0; r == kC - 1 && w < kWarps; ++w) d += gt[kG + kC - 1] * s.red[w];  // d gamma_63: the state's and E's
    for (int i = 0; r == kC - 1 && i < kC * tiles; ++i) d += s.part[4 * kC + i / tiles * 4 + i % tiles];
    s.dgam[r] = d;
  }
  __syncthreads();  // the first part's tiles are done with
  load(s.w, a.x.w + r0 * a.dkp, kC, a.dkp);
  load(s.u, a.x.u + r0 * a.dvp, kC, a.dvp);
  block_tiles(kC, kC, [&](auto& acc, int m0, int n0) { warp_mma<false, false>(acc, s.k, ldk, s.k, ldk, m0, n0, a.dkp); },
              [&](int r, int j, float v) {  // L transposed
                s.kk[r * kLdL + j] = v, s.L[j * kLdL + r] = j < r ? gt[kBeta + r] * v * expf(gt[r] - gt[j]) : 0.f;
              });
  __syncthreads();
  if (threadIdx.x < a.dkp + a.dvp) {
    const bool is_e = threadIdx.x < a.dkp;
    const int j = is_e ? threadIdx.x : threadIdx.x - a.dkp;
    float x[kC];
#pragma unroll
    for (int i = 0; i < kC; ++i) x[i] = is_e ? a.x.dw[(r0 + i) * a.dkp + j] : a.x.dvn[(r0 + i) * a.dvp + j];
    solve_column<true>(x, s.L);
#pragma unroll
    for (int i = 0; i < kC; ++i) {  // per row: dE . diag(G) K (warps below dkp / 32) and dB . V (the others)
      const bool v_ok = a.valid(c, i) && j < a.Dv;
      const float d = warp_sum(x[i] * (is_e ? gt[kG + i] * float(s.k[i * ldk + j]) : v_ok ? float(a.qkv[a.qkv_v(c, i) + j]) : 0.f));
      if (lane == 0) s.part[i * kWarps + threadIdx.x / 32] = d;
      if (is_e) s.de[i * ldk + j] = bf16(x[i]), a.x.dk[(r0 + i) * a.dkp + j] += gt[kBeta + i] * gt[kG + i] * x[i];
      else s.db[i * ldv + j] = bf16(x[i]);
      if (!is_e && v_ok) a.dqkv[a.qkv_v(c, i) + j] = bf16(gt[kBeta + i] * x[i]);
    }
  }
  __syncthreads();
  block_tiles(kC, kC, [&](auto& acc, int m0, int n0) {
    warp_mma<false, false>(acc, s.db, ldv, s.u, ldv, m0, n0, a.dvp);
    warp_mma<false, false>(acc, s.de, ldk, s.w, ldk, m0, n0, a.dkp);
  }, [&](int r, int j, float v) {  // L's place now holds H = dL * M * kk below the diagonal
    const float dlm = j < r ? -v * expf(gt[r] - gt[j]) : 0.f;
    s.L[r * kLdL + j] = dlm * s.kk[r * kLdL + j];
    s.gm[r * kLdC + j] = bf16(dlm * gt[kBeta + r]);
  });
  __syncthreads();
  block_tiles(kC, a.dkp, [&](auto& acc, int m0, int n0) {
    warp_mma<false, true>(acc, s.gm, kLdC, s.k, ldk, m0, n0, kC);
    warp_mma<true, true>(acc, s.gm, kLdC, s.k, ldk, m0, n0, kC);
  }, [&](int r, int i, float v) { a.x.dk[(r0 + r) * a.dkp + i] += v; });
  if (threadIdx.x < kC) {
    const int r = threadIdx.x;
    float kde = 0, dbv = 0, h = 0, h_col = 0;
    for (int w = 0; w < (a.dkp + a.dvp) / 32; ++w) (w < a.dkp / 32 ? kde : dbv) += s.part[r * kWarps + w];
    for (int j = 0; j < kC; ++j) h += s.L[r * kLdL + j], h_col += gt[kBeta + j] * s.L[j * kLdL + r];
    if (a.valid(c, r)) a.dbeta[a.gate(c, r)] = dbv + kde + h;
    s.dgam[r] += gt[kBeta + r] * (kde + h) - h_col;
  }
  __syncthreads();
  float sum = 0;
  for (int r = kC - 1; threadIdx.x == 0 && r >= 0; --r) {
    sum += s.dgam[r];
    if (a.valid(c, r)) a.dg[a.gate(c, r)] = sum;
  }
}

// dqkv's q and k parts, a warp a (token, key head): its value heads' gradients summed in head
// order, then the l2norm's backward dx = c r (dy - (y . dy) y / c^2), y = c r x (c = Dk^-0.5 for q).
__global__ void __launch_bounds__(kThreads) finish_qk_kernel(Args a, int64_t items) {
  begin_after_previous_grid();
  const int64_t item = (blockIdx.x * int64_t(kThreads) + threadIdx.x) / 32;
  if (item >= items) return;
  const int lane = threadIdx.x % 32, group = a.Hv / a.Hk, hk = int(item % a.Hk);
  const int64_t bt = item / a.Hk, b = bt / a.S, t = bt % a.S;
  for (int side = 0; side < 2; ++side) {
    const int64_t at = bt * a.width + (side * a.Hk + hk) * a.Dk;
    const float* grad = (side ? a.x.dk : a.x.dq) + ((b * a.Hv + hk * group) * a.chunks * kC + t) * a.dkp + lane;
    float x[4], dy[4] = {}, ss = 0, xy = 0;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      x[l] = lane + 32 * l < a.Dk ? float(a.qkv[at + lane + 32 * l]) : 0.f, ss += x[l] * x[l];
      for (int h = 0; h < group && lane + 32 * l < a.Dk; ++h) dy[l] += grad[int64_t(h) * a.chunks * kC * a.dkp + 32 * l];
    }
    const float cs = side ? 1.f : rsqrtf(float(a.Dk)), r = rsqrtf(warp_sum(ss) + float(kNormEps));
#pragma unroll
    for (int l = 0; l < 4; ++l) x[l] *= cs * r, xy += x[l] * dy[l];
    xy = warp_sum(xy) / (cs * cs);
#pragma unroll
    for (int l = 0; l < 4 && lane + 32 * l < a.Dk; ++l) a.dqkv[at + lane + 32 * l] = bf16(cs * r * (dy[l] - xy * x[l]));
  }
}

// A chunk or scan kernel's launch with the shared memory Smem's carving of dims takes.
template <class Smem, typename... Dims> void launch(void (*kernel)(Args), dim3 grid, const Args& a, Stream stream, Dims... dims) {
  Carve m;
  Smem(m, dims...);
  MARROW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(m.at)));
  launch_dependent(kernel, grid, kThreads, size_t(m.at), stream, a);
}

// The kernels' arguments and their scratch, carved from one allocation of ScratchSize's bytes (every array a multiple of 16
// bytes), freed (stream-ordered) with the Buffer.
std::pair<Args, Buffer> gpu_args(const GatedDeltaShape& s, Tensor qkv, Tensor g, Tensor beta, bool backward, Stream stream) {
  const ScratchSize z(s);
  Buffer scratch(DType::f32, Device::cuda, {(backward ? z.backward_bytes() : z.forward_bytes()) / 4}, stream);
  Carve b{reinterpret_cast<uintptr_t>(scratch.view().data)};
  Args a{};
  a.qkv = bf16_ptr(qkv), a.g = g.ptr<float>(), a.beta = beta.ptr<float>();
  a.S = int(s.seq), a.Hk = int(s.key_heads), a.Dk = int(s.key_dim), a.Hv = int(s.value_heads), a.Dv = int(s.value_dim);
  a.dkp = int(z.dkp), a.dvp = int(z.dvp), a.chunks = int(z.chunks), a.width = int(Layout{s}.width());
  Scratch& x = a.x;
  const int64_t rows = z.rows, dk = z.dkp, dv = z.dvp;
  x.qn = b.take<bf16>(rows * dk), x.kn = b.take<bf16>(rows * dk), x.w = b.take<bf16>(rows * dk), x.u = b.take<float>(rows * dv);
  x.p = b.take<bf16>(rows * kC);
  if (!backward) return {a, std::move(scratch)};
  x.states = b.take<bf16>(rows / kC * dk * dv), x.dstates = b.take<bf16>(rows / kC * dk * dv), x.vn = b.take<bf16>(rows * dv);
  x.dvn = b.take<float>(rows * dv), x.dq = b.take<float>(rows * dk), x.dk = b.take<float>(rows * dk), x.dw = b.take<float>(rows * dk);
  return {a, std::move(scratch)};
}

dim3 grid(int64_t x, const GatedDeltaShape& s) { return dim3(unsigned(x), unsigned(s.value_heads), unsigned(s.batch)); }

void launch_forward(Tensor o, Tensor final_state, Tensor qkv, Tensor g, Tensor beta, Tensor initial_state, const GatedDeltaShape& s,
                    Stream stream) {
  if (s.batch * s.value_heads == 0) return;
  auto [a, scratch] = gpu_args(s, qkv, g, beta, false, stream);
  a.o = bf16_ptr(o), a.s0 = ptr_or_null<float>(initial_state), a.s_final = ptr_or_null<float>(final_state);
  if (a.chunks) launch<PrepareSmem>(prepare_kernel, grid(a.chunks, s), a, stream, a.dkp);
  launch<ScanSmem>(scan_kernel<false>, grid(a.dvp / kBV, s), a, stream, a.dkp);
}

void launch_backward(Tensor dqkv, Tensor dg, Tensor dbeta, Tensor d_initial_state, Tensor d_out, Tensor qkv, Tensor g, Tensor beta,
                     Tensor initial_state, Tensor d_final_state, const GatedDeltaShape& s, Stream stream) {
  if (s.batch * s.value_heads == 0) return;
  auto [a, scratch] = gpu_args(s, qkv, g, beta, true, stream);
  a.dout = bf16_ptr(d_out), a.dqkv = bf16_ptr(dqkv), a.dg = dg.ptr<float>(), a.dbeta = dbeta.ptr<float>();
  a.s0 = ptr_or_null<float>(initial_state), a.ds_final = ptr_or_null<float>(d_final_state), a.ds0 = ptr_or_null<float>(d_initial_state);
  if (a.chunks == 0) return launch<ScanSmem>(scan_kernel<true>, grid(a.dvp / kBV, s), a, stream, a.dkp);  // d_initial = d_final
  launch<PrepareSmem>(prepare_kernel, grid(a.chunks, s), a, stream, a.dkp);
  launch<ScanSmem>(scan_kernel<false>, grid(a.dvp / kBV, s), a, stream, a.dkp);
  launch<ScanSmem>(scan_kernel<true>, grid(a.dvp / kBV, s), a, stream, a.dkp);
  launch<GradSmem>(grad_kernel, grid(a.chunks, s), a, stream, a.dkp, a.dvp);
  const int64_t items = s.batch * s.seq * s.key_heads;
  launch_dependent(finish_qk_kernel, grid_stride_blocks(items * 32, kThreads, 1 << 30), kThreads, 0, stream, a, items);
}
#endif

void forward(const char* op, Tensor o, Tensor final_state, Tensor qkv, Tensor g, Tensor beta, int64_t key_heads, int64_t key_dim,
             Tensor initial_state, int64_t chunk, Stream stream) {
  const GatedDeltaShape s = check_shapes(op, "o", o, key_heads, key_dim, {{"qkv", &qkv}}, {{"g", &g}, {"beta", &beta}},
                                         {{"initial_state", &initial_state}, {"final_state", &final_state}});
  if (on_gpu(op, {{"qkv", &qkv, DType::bf16}, {"o", &o, DType::bf16}, {"g", &g, DType::f32}, {"beta", &beta, DType::f32},
                  state_operand("initial_state", initial_state, qkv), state_operand("final_state", final_state, qkv)})) {
    check_gpu_sizes(op, s, chunk);
    MARROW_GPU_RETURN(op, stream, launch_forward(o, final_state, qkv, g, beta, initial_state, s, stream));
  }
  with_cpu_scalar(op, qkv, [&](auto z) {
    using T = decltype(z);
    forward_cpu<T>({{s}, qkv.ptr<T>(), g.ptr<T>(), beta.ptr<T>(), ptr_or_null<T>(initial_state)}, o.ptr<T>(), ptr_or_null<T>(final_state), chunk);
  });
}

void backward(const char* op, Tensor dqkv, Tensor dg, Tensor dbeta, Tensor d_initial_state, Tensor d_out, Tensor qkv, Tensor g, Tensor beta,
              int64_t key_heads, int64_t key_dim, Tensor initial_state, Tensor d_final_state, int64_t chunk, Stream stream) {
  const GatedDeltaShape s = check_shapes(op, "d_out", d_out, key_heads, key_dim, {{"qkv", &qkv}, {"dqkv", &dqkv}},
                                         {{"g", &g}, {"beta", &beta}, {"dg", &dg}, {"dbeta", &dbeta}},
                                         {{"initial_state", &initial_state}, {"d_final_state", &d_final_state},
                                          {"d_initial_state", &d_initial_state}});
  if (on_gpu(op, {{"qkv", &qkv, DType::bf16}, {"d_out", &d_out, DType::bf16}, {"dqkv", &dqkv, DType::bf16}, {"g", &g, DType::f32},
                  {"beta", &beta, DType::f32}, {"dg", &dg, DType::f32}, {"dbeta", &dbeta, DType::f32},
                  state_operand("initial_state", initial_state, qkv), state_operand("d_final_state", d_final_state, qkv),
                  state_operand("d_initial_state", d_initial_state, qkv)})) {
    check_gpu_sizes(op, s, chunk);
    MARROW_GPU_RETURN(op, stream, launch_backward(dqkv, dg, dbeta, d_initial_state, d_out, qkv, g, beta, initial_state, d_final_state, s, stream));
  }
  with_cpu_scalar(op, qkv, [&](auto z) {
    using T = decltype(z);
    backward_cpu<T>({{s}, qkv.ptr<T>(), g.ptr<T>(), beta.ptr<T>(), ptr_or_null<T>(initial_state)}, dqkv.ptr<T>(), dg.ptr<T>(), dbeta.ptr<T>(),
                    ptr_or_null<T>(d_initial_state), d_out.ptr<T>(), ptr_or_null<T>(d_final_state), chunk);
  });
}

}  // namespace

void gated_delta_forward(Tensor o, Tensor final_state, Tensor qkv, Tensor g, Tensor beta, int64_t key_heads, int64_t key_dim,
                         Tensor initial_state, int64_t chunk, Stream stream) {
  MARROW_CHECK(chunk > 0, "gated_delta_forward: chunk must be positive, got {}", chunk);
  forward("gated_delta_forward", o, final_state, qkv, g, beta, key_heads, key_dim, initial_state, chunk, stream);
}

void gated_delta_backward(Tensor dqkv, Tensor dg, Tensor dbeta, Tensor d_initial_state, Tensor d_out, Tensor qkv, Tensor g, Tensor beta,
                          int64_t key_heads, int64_t key_dim, Tensor initial_state, Tensor d_final_state, int64_t chunk, Stream stream) {
  MARROW_CHECK(chunk > 0, "gated_delta_backward: chunk must be positive, got {}", chunk);
  backward("gated_delta_backward", dqkv, dg, dbeta, d_initial_state, d_out, qkv, g, beta, key_heads, key_dim, initial_state, d_final_state,
           chunk, stream);
}

// chunk 0: the recurrence (the public chunked ops take positive chunks only).
void gated_delta_recurrent_forward(Tensor o, Tensor final_state, Tensor qkv, Tensor g, Tensor beta, int64_t key_heads, int64_t key_dim,
                                   Tensor initial_state) {
  forward("gated_delta_recurrent_forward", o, final_state, qkv, g, beta, key_heads, key_dim, initial_state, 0, {});
}

void gated_delta_recurrent_backward(Tensor dqkv, Tensor dg, Tensor dbeta, Tensor d_initial_state, Tensor d_out, Tensor qkv, Tensor g,
                                    Tensor beta, int64_t key_heads, int64_t key_dim, Tensor initial_state, Tensor d_final_state) {
  backward("gated_delta_recurrent_backward", dqkv, dg, dbeta, d_initial_state, d_out, qkv, g, beta, key_heads, key_dim, initial_state,
           d_final_state, 0, {});
}

int64_t gated_delta_backward_scratch(const GatedDeltaShape& shape) { return ScratchSize(shape).backward_bytes(); }

}  // namespace marrow
