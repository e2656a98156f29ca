// cuDNN's fused SDPA behind attention.h's causal op (see attention_cudnn.h): the deterministic
// backward's plan of calls (host arithmetic, also in CPU builds for the memory estimate), then the
// frontend graphs (header-only) that run cuDNN's own kernels. Invariants: a graph is built once per
// GraphKey, which holds every field that changes it (chunk shapes included), and one mutex guards
// the handles, the graphs and their executions. Gotcha: cuDNN refuses s_q = s_kv = 1, so a one-row
// first query chunk joins the next (query_chunks) and a one-position sequence runs on the own kernels.
// The cuDNN frontend (header-only, included by this file alone) comes from its PyPI wheel:
// tools/setup.sh keeps its headers in .cache/cudnn-frontend and tools/gpu_prepare.sh carries them to
// the GPU machine. CUDNN_FRONTEND_SKIP_JSON_LIB keeps its bundled nlohmann/json from meeting ours.
#include "ops/attention_cudnn.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "core/errors.h"
#include "ops/common.h"

namespace marrow {

namespace {

int64_t round_up_64(int64_t n) { return (n + 63) / 64 * 64; }

int64_t workspace_cap_setting = kCudnnAttentionWorkspaceCap, chunk_setting = 0;  // the hooks' values

// The deterministic backward's dP workspace for one call: `q_rows` queries of `q_heads` heads
// against `kv_rows` keys. The cap bounds this part.
int64_t dp_workspace_bytes(int64_t batch, int64_t q_rows, int64_t kv_rows, int64_t q_heads) {
  return batch * q_heads * round_up_64(q_rows) * round_up_64(kv_rows) * 2;
}

// cuDNN's whole workspace for that call (its get_workspace_size on an H200, cuDNN 9.14, to 256
// bytes): dP; with grouped-query heads, dK and dV per query head (bf16), which it sums into the
// key/value heads (512 MiB for 32 heads at 32,768 keys); the row sums of dO * O (f32).
int64_t call_workspace_bytes(int64_t batch, int64_t q_rows, int64_t kv_rows, int64_t q_heads, int64_t kv_heads,
                             int64_t head_dim) {
  const int64_t per_head_dkv = q_heads > kv_heads ? batch * q_heads * kv_rows * head_dim * 2 * 2 : 0;
  return dp_workspace_bytes(batch, q_rows, kv_rows, q_heads) + per_head_dkv + batch * q_heads * q_rows * 4 + 256;
}

// Query chunks [q0, q1) of `rows` each, aligned to the end of the sequence and listed from the last:
// the first call covers every key row, and only the first chunk of the sequence may be short (one
// row would be s_q = s_kv = 1, which cuDNN refuses, so it joins the next chunk).
std::vector<std::pair<int64_t, int64_t>> query_chunks(int64_t seq, int64_t rows) {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (int64_t end = seq; end > 0;) {
    int64_t begin = std::max<int64_t>(0, end - rows);
    if (begin == 1) begin = 0;
    chunks.push_back({begin, end});
    end = begin;
  }
  return chunks;
}

// The deterministic backward's calls: `splits` key/value head groups (a divisor of kv_heads), each
// in query chunks of `rows`; splits = 0 when no plan fits the cap.
struct BackwardPlan {
  int64_t splits = 0, rows = 0;
};

int64_t largest_dp_workspace(int64_t batch, int64_t seq, int64_t q_heads, const BackwardPlan& plan) {
  int64_t bytes = 0;
  for (auto [begin, end] : query_chunks(seq, plan.rows))
    bytes = std::max(bytes, dp_workspace_bytes(batch, end - begin, end, q_heads / plan.splits));
  return bytes;
}

// The fewest calls within the cap; at equal counts, whole sequences in head groups, else query
// chunks over the most heads per call (the faster arrangement in each case measured). Without a
// forced chunk, a split's chunk is the most rows (a multiple of 64, or the whole sequence) whose
// last chunk, the largest workspace (rows x S), fits.
BackwardPlan backward_plan(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads) {
  const int64_t cap = workspace_cap_setting;
  BackwardPlan best;
  int64_t best_calls = 0;
  for (int64_t splits = 1; splits <= kv_heads; ++splits) {
    if (kv_heads % splits != 0) continue;
    // Bytes of dP per query row (at least 1: an empty batch runs whole).
    const int64_t per_row = std::max<int64_t>(1, batch * (q_heads / splits) * round_up_64(seq) * 2);
    const int64_t rows = chunk_setting > 0 ? std::min(chunk_setting, seq) : std::min(seq, cap / per_row / 64 * 64);
    const BackwardPlan plan{splits, rows};
    if (rows <= 0 || largest_dp_workspace(batch, seq, q_heads, plan) > cap) continue;
    const int64_t calls = splits * int64_t(query_chunks(seq, rows).size());
    if (best.splits == 0 || calls < best_calls || (calls == best_calls && rows == seq && best.rows < seq))
      best = plan, best_calls = calls;
  }
  return best;
}

}  // namespace

void set_cudnn_backward_workspace_cap(int64_t bytes) {
  workspace_cap_setting = bytes > 0 ? bytes : kCudnnAttentionWorkspaceCap;
}
void set_cudnn_backward_chunk(int64_t rows) { chunk_setting = std::max<int64_t>(rows, 0); }

// cuDNN refuses a single position (s_q = s_kv = 1); the own kernels take it.
bool cudnn_attention_forward_supports(int64_t seq, int64_t head_dim) {
  return seq > 1 && (head_dim == 64 || head_dim == 128);
}

bool cudnn_attention_backward_supports(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                       bool deterministic) {
  return cudnn_attention_forward_supports(seq, head_dim) && q_heads % kv_heads == 0 &&
         (!deterministic || backward_plan(batch, seq, q_heads, kv_heads).splits > 0);
}

int64_t cudnn_attention_backward_scratch(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                         bool deterministic) {
  // Not deterministic: the f32 dQ accumulator, the row sums of dO * O (f32) and cuDNN's own few MiB.
  if (!deterministic) return batch * seq * q_heads * (head_dim + 1) * 4 + (int64_t(16) << 20);
  const BackwardPlan plan = backward_plan(batch, seq, q_heads, kv_heads);
  if (plan.splits == 0) return 0;
  int64_t workspace = 0;
  for (auto [begin, end] : query_chunks(seq, plan.rows))
    workspace = std::max(workspace, call_workspace_bytes(batch, end - begin, end, q_heads / plan.splits,
                                                         kv_heads / plan.splits, head_dim));
  const bool chunked = plan.rows < seq;
  return workspace + (chunked ? 2 * batch * seq * kv_heads * head_dim * 4 : 0);
}

}  // namespace marrow

#if MARROW_CUDA
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <cudnn_frontend.h>

#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/add.h"
#include "ops/cast.h"

namespace marrow {

namespace {

namespace fe = cudnn_frontend;

// Why a cuDNN call (a status) or a frontend call (an error object) failed; empty when it did not.
std::string cudnn_failure(cudnnStatus_t status) { return status == CUDNN_STATUS_SUCCESS ? "" : cudnnGetErrorString(status); }
std::string cudnn_failure(fe::error_t error) { return error.is_bad() ? "cuDNN frontend: " + error.get_message() : ""; }

#define MARROW_CUDNN_CHECK(call)                                                           \
  do {                                                                                     \
    const std::string marrow_why_ = cudnn_failure(call);                                   \
    if (!marrow_why_.empty()) ::marrow::fail_call(__FILE__, __LINE__, #call, marrow_why_); \
  } while (0)

enum Uid : int64_t { kQ = 1, kK, kV, kOut, kLse, kDout, kDq, kDk, kDv, kSinks };

// One graph's shape: a call covers q_heads / splits query heads (a key/value head group) and query
// rows [q1 - q_rows, q1) against key rows [0, q1), q1 = kv_rows, of sequences of `seq` positions;
// the variant's window (0: none, nor when it spans the sequence) and whether sinks join the forward.
struct GraphKey {
  bool backward = false;
  bool deterministic = true;
  int64_t batch = 0, seq = 0, q_heads = 0, kv_heads = 0, head_dim = 0, splits = 1, q_rows = 0, kv_rows = 0;
  int64_t window = 0;
  bool sinks = false;
  auto operator<=>(const GraphKey&) const = default;
};

struct BuiltGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
};

std::mutex cudnn_mutex;  // held for every handle and graph

// Called with cudnn_mutex held: one handle per device, bound to the caller's stream.
cudnnHandle_t handle_locked(cudaStream_t stream) {
  static std::map<int, cudnnHandle_t> handles;
  int device = 0;
  MARROW_CUDA_CHECK(cudaGetDevice(&device));
  cudnnHandle_t& h = handles[device];
  if (h == nullptr) MARROW_CUDNN_CHECK(cudnnCreate(&h));
  MARROW_CUDNN_CHECK(cudnnSetStream(h, stream));
  return h;
}

// A [B, heads, rows, D] view of a [B, S, row_heads, D] tensor (the heads of one group, `rows` rows
// from the pointer the call passes).
void set_head_view(fe::graph::Tensor_attributes& t, Uid uid, const GraphKey& key, int64_t heads, int64_t row_heads, int64_t rows) {
  const int64_t d = key.head_dim;
  t.set_uid(uid).set_dim({key.batch, heads, rows, d}).set_stride({key.seq * row_heads * d, d, row_heads * d, 1});
}

std::shared_ptr<fe::graph::Tensor_attributes> head_view(fe::graph::Graph& g, const char* name, Uid uid, const GraphKey& key, int64_t heads,
                                                        int64_t row_heads, int64_t rows) {
  fe::graph::Tensor_attributes t;
  set_head_view(t.set_name(name), uid, key, heads, row_heads, rows);
  return g.tensor(t);
}

// lse as cuDNN's Stats: [B, heads, q_rows, 1] f32 inside lse[B, q_heads, S].
void set_lse_view(fe::graph::Tensor_attributes& t, const GraphKey& key, int64_t heads) {
  t.set_uid(kLse)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({key.batch, heads, key.q_rows, 1})
      .set_stride({key.q_heads * key.seq, key.seq, 1, 1});
}

void describe_forward(fe::graph::Graph& g, const GraphKey& key, int64_t hq, int64_t hkv, float scale) {
  auto q = head_view(g, "q", kQ, key, hq, key.q_heads, key.seq);
  auto k = head_view(g, "k", kK, key, hkv, key.kv_heads, key.seq);
  auto v = head_view(g, "v", kV, key, hkv, key.kv_heads, key.seq);
  auto options = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true).set_causal_mask(true).set_attn_scale(scale);
  if (key.window > 0) options.set_diagonal_band_left_bound(int(key.window));
  if (key.sinks) {
    fe::graph::Tensor_attributes sinks;
    sinks.set_name("sinks").set_uid(kSinks).set_data_type(fe::DataType_t::FLOAT).set_dim({1, hq, 1, 1}).set_stride({hq, 1, 1, 1});
    options.set_sink_token(g.tensor(sinks));
  }
  auto [out, lse] = g.sdpa(q, k, v, options);
  out->set_output(true);
  set_head_view(*out, kOut, key, hq, key.q_heads, key.seq);
  lse->set_output(true);
  set_lse_view(*lse, key, hq);
}

void describe_backward(fe::graph::Graph& g, const GraphKey& key, int64_t hq, int64_t hkv, float scale) {
  const int64_t qr = key.q_rows, kr = key.kv_rows;
  auto q = head_view(g, "q", kQ, key, hq, key.q_heads, qr);
  auto k = head_view(g, "k", kK, key, hkv, key.kv_heads, kr);
  auto v = head_view(g, "v", kV, key, hkv, key.kv_heads, kr);
  auto out = head_view(g, "out", kOut, key, hq, key.q_heads, qr);
  auto dout = head_view(g, "dout", kDout, key, hq, key.q_heads, qr);
  auto lse = g.tensor(fe::graph::Tensor_attributes().set_name("lse"));
  set_lse_view(*lse, key, hq);
  // A query chunk ends where its keys end: query q1 - q_rows + i sees keys 0 .. q1 - q_rows + i,
  // the causal diagonal aligned to the bottom right of the q_rows x kv_rows scores.
  auto options =
      fe::graph::SDPA_backward_attributes().set_name("attention_backward").set_attn_scale(scale).set_deterministic_algorithm(key.deterministic);
  if (qr == kr) options.set_causal_mask(true);
  else options.set_causal_mask_bottom_right(true);
  if (key.window > 0) options.set_diagonal_band_left_bound(int(key.window));
  auto [dq, dk, dv] = g.sdpa_backward(q, k, v, out, dout, lse, options);
  for (auto [t, uid, heads, row_heads, rows] :
       {std::tuple{dq, kDq, hq, key.q_heads, qr}, std::tuple{dk, kDk, hkv, key.kv_heads, kr},
        std::tuple{dv, kDv, hkv, key.kv_heads, kr}}) {
    t->set_output(true);
    set_head_view(*t, uid, key, heads, row_heads, rows);
  }
}

// The key's graph described and lowered, before any execution plan is chosen.
std::shared_ptr<fe::graph::Graph> described_graph(const GraphKey& key, cudnnHandle_t handle) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const int64_t hq = key.q_heads / key.splits, hkv = key.kv_heads / key.splits;
  const float scale = float(1 / std::sqrt(double(key.head_dim)));
  if (key.backward) describe_backward(*g, key, hq, hkv, scale);
  else describe_forward(*g, key, hq, hkv, scale);
  MARROW_CUDNN_CHECK(g->validate());
  MARROW_CUDNN_CHECK(g->build_operation_graph(handle));
  return g;
}

BuiltGraph build_graph(const GraphKey& key, cudnnHandle_t handle) {
  std::shared_ptr<fe::graph::Graph> g = described_graph(key, handle);
  MARROW_CUDNN_CHECK(g->create_execution_plans({fe::HeurMode_t::A}));
  MARROW_CUDNN_CHECK(g->check_support(handle));
  MARROW_CUDNN_CHECK(g->build_plans(handle));
  BuiltGraph built{g, 0};
  MARROW_CUDNN_CHECK(g->get_workspace_size(built.workspace_bytes));
  return built;
}

// Runs the key's graph once per key/value head group, each call on its group's slices; `base` holds
// the first row each tensor's view starts at.
void run_graph(const GraphKey& key, std::unordered_map<int64_t, void*> base, Stream stream) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  std::lock_guard<std::mutex> lock(cudnn_mutex);
  cudnnHandle_t handle = handle_locked(s);
  static std::map<GraphKey, BuiltGraph> graphs;
  auto it = graphs.find(key);
  if (it == graphs.end()) it = graphs.emplace(key, build_graph(key, handle)).first;
  const BuiltGraph& built = it->second;
  Buffer workspace(DType::f32, Device::cuda, {std::max<int64_t>(1, (built.workspace_bytes + 3) / 4)}, stream);
  const int64_t hq = key.q_heads / key.splits, hkv = key.kv_heads / key.splits, d = key.head_dim;
  for (int64_t group = 0; group < key.splits; ++group) {
    std::unordered_map<int64_t, void*> pack;
    for (auto [uid, ptr] : base) {
      const bool kv = uid == kK || uid == kV || uid == kDk || uid == kDv;
      const int64_t offset = uid == kLse ? group * hq * key.seq * 4 : uid == kSinks ? group * hq * 4 : group * (kv ? hkv : hq) * d * 2;
      pack[uid] = static_cast<char*>(ptr) + offset;
    }
    MARROW_CUDNN_CHECK(built.graph->execute(handle, pack, workspace.ptr<float>()));
  }
}

void expect_bf16_gpu(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  for (auto [name, t] : tensors) {
    expect_dtype(op, name, *t, DType::bf16);
    expect_device(op, name, *t, Device::cuda);
  }
}

GraphKey key_of(const char* op, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool backward,
                bool deterministic, const AttentionVariant& variant) {
  MARROW_CHECK(q.ndim == 4 && k.ndim == 4, "{}: q and k must be [batch, seq, heads, head_dim], got {} and {}", op,
               q.shape_string(), k.shape_string());
  MARROW_CHECK(variant.window >= 0, "{}: the sliding window must be 0 (none) or positive, got {}", op, variant.window);
  GraphKey key{backward, deterministic, q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), 1, q.size(1), q.size(1)};
  key.window = variant.window < key.seq ? variant.window : 0;
  key.sinks = !backward && variant.sinks.data;
  expect_shape(op, "k", k, {key.batch, key.seq, key.kv_heads, key.head_dim});
  expect_shape(op, "v", v, {key.batch, key.seq, key.kv_heads, key.head_dim});
  expect_shape(op, "out", out, {key.batch, key.seq, key.q_heads, key.head_dim});
  expect_shape(op, "lse", lse, {key.batch, key.q_heads, key.seq});
  const bool served = backward && deterministic
                          ? cudnn_attention_backward_supports(key.batch, key.seq, key.q_heads, key.kv_heads, key.head_dim)
                          : cudnn_attention_forward_supports(key.seq, key.head_dim);
  MARROW_CHECK(served, "{}: cuDNN attention does not serve batch {}, sequence {}, {} / {} heads of {}", op, key.batch,
               key.seq, key.q_heads, key.kv_heads, key.head_dim);
  expect_dtype(op, "lse", lse, DType::f32);
  expect_device(op, "lse", lse, Device::cuda);
  return key;
}

}  // namespace

void cudnn_attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionVariant& variant,
                             Stream stream) {
  const char* op = "cudnn_attention_forward";
  expect_bf16_gpu(op, {{"out", &out}, {"q", &q}, {"k", &k}, {"v", &v}});
  const GraphKey key = key_of(op, q, k, v, out, lse, false, true, variant);
  if (key.batch * key.seq == 0) return;
  std::unordered_map<int64_t, void*> pack{{kQ, q.data}, {kK, k.data}, {kV, v.data}, {kOut, out.data}, {kLse, lse.data}};
  Buffer sinks;  // cuDNN's sink token is f32
  if (key.sinks) {
    expect_bf16_gpu(op, {{"sinks", &variant.sinks}});
    expect_shape(op, "sinks", variant.sinks, {key.q_heads});
    sinks = Buffer(DType::f32, Device::cuda, {key.q_heads}, stream);
    cast(sinks, variant.sinks, stream);
    pack[kSinks] = sinks.ptr<float>();
  }
  run_graph(key, pack, stream);
}

void cudnn_attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                              Tensor lse, const AttentionVariant& variant, Stream stream, bool deterministic) {
  const char* op = "cudnn_attention_backward";
  expect_bf16_gpu(op, {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}, {"dout", &dout}, {"q", &q}, {"k", &k}, {"v", &v},
                       {"out", &out}});
  GraphKey key = key_of(op, q, k, v, out, lse, true, deterministic, variant);
  const int64_t b = key.batch, s = key.seq, d = key.head_dim;
  expect_shape(op, "dq", dq, {b, s, key.q_heads, d});
  expect_shape(op, "dout", dout, {b, s, key.q_heads, d});
  expect_shape(op, "dk", dk, {b, s, key.kv_heads, d});
  expect_shape(op, "dv", dv, {b, s, key.kv_heads, d});
  if (key.batch * key.seq == 0) return;
  const BackwardPlan plan = deterministic ? backward_plan(b, s, key.q_heads, key.kv_heads) : BackwardPlan{1, s};
  key.splits = plan.splits;
  const auto chunks = query_chunks(s, plan.rows);
  // Several chunks: each call writes its share of dK, dV into rows [0, q1) of dk, dv, which the
  // f32 accumulators then take (the first call, the last chunk, covers every row).
  Buffer dk_sum, dv_sum;
  if (chunks.size() > 1) {
    dk_sum = Buffer(DType::f32, Device::cuda, {b, s, key.kv_heads, d}, stream);
    dv_sum = Buffer(DType::f32, Device::cuda, {b, s, key.kv_heads, d}, stream);
  }
  for (size_t i = 0; i < chunks.size(); ++i) {
    const int64_t q0 = chunks[i].first, q1 = chunks[i].second;
    key.q_rows = q1 - q0;
    key.kv_rows = q1;
    auto rows_at = [&](const Tensor& t) { return static_cast<char*>(t.data) + q0 * key.q_heads * d * 2; };
    run_graph(key,
              {{kQ, rows_at(q)}, {kK, k.data}, {kV, v.data}, {kOut, rows_at(out)}, {kLse, static_cast<char*>(lse.data) + q0 * 4},
               {kDout, rows_at(dout)}, {kDq, rows_at(dq)}, {kDk, dk.data}, {kDv, dv.data}},
              stream);
    if (chunks.size() == 1) return;
    for (auto [sum, share] : {std::pair{&dk_sum, dk}, std::pair{&dv_sum, dv}}) {
      if (i == 0) {
        cast(*sum, share, stream);
        continue;
      }
      for (int64_t row = 0; row < b; ++row)
        add_into(sum->view().rows(row, row + 1).reshape({s, key.kv_heads, d}).rows(0, q1),
                 share.rows(row, row + 1).reshape({s, key.kv_heads, d}).rows(0, q1), stream);
    }
  }
  cast(dk, dk_sum, stream);
  cast(dv, dv_sum, stream);
}

std::vector<CudnnAttentionPlan> cudnn_attention_plans(bool backward, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q,
                                                      Tensor k, Tensor v, Tensor out, Tensor lse) {
  const char* op = "cudnn_attention_plans";
  GraphKey key = key_of(op, q, k, v, out, lse, backward, true, AttentionVariant{});
  expect_bf16_gpu(op, {{"out", &out}, {"q", &q}, {"k", &k}, {"v", &v}});
  if (backward) {
    expect_bf16_gpu(op, {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}, {"dout", &dout}});
    expect_shape(op, "dq", dq, {key.batch, key.seq, key.q_heads, key.head_dim});
    expect_shape(op, "dout", dout, {key.batch, key.seq, key.q_heads, key.head_dim});
    for (auto [name, t] : {std::pair{"dk", &dk}, std::pair{"dv", &dv}}) expect_shape(op, name, *t, {key.batch, key.seq, key.kv_heads, key.head_dim});
    const BackwardPlan plan = backward_plan(key.batch, key.seq, key.q_heads, key.kv_heads);
    MARROW_CHECK(plan.splits == 1 && plan.rows == key.seq, "{}: the backward of these sizes runs in {} head groups of query chunks of {} rows, not one call",
                 op, plan.splits, plan.rows);
  }
  std::unordered_map<int64_t, void*> pack{{kQ, q.data}, {kK, k.data}, {kV, v.data}, {kOut, out.data}, {kLse, lse.data}};
  if (backward) pack.insert({{kDout, dout.data}, {kDq, dq.data}, {kDk, dk.data}, {kDv, dv.data}});
  std::lock_guard<std::mutex> lock(cudnn_mutex);
  cudnnHandle_t handle = handle_locked(nullptr);
  std::shared_ptr<fe::graph::Graph> g = described_graph(key, handle);
  MARROW_CUDNN_CHECK(g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::B, fe::HeurMode_t::FALLBACK}));
  std::vector<CudnnAttentionPlan> plans;
  for (int64_t i = 0; i < g->get_execution_plan_count(); ++i) {
    CudnnAttentionPlan plan;
    MARROW_CUDNN_CHECK(g->get_plan_name_at_index(i, plan.name));
    // A plan cuDNN cannot build for this shape is listed without a run (the bench prints it as such), its
    // reason appended to its name.
    auto built = g->build_plan_at_index(i);
    if (!built.is_good()) plan.name += " (not built: " + built.get_message() + ")";
    if (built.is_good()) {
      MARROW_CUDNN_CHECK(g->get_workspace_size_plan_at_index(i, plan.workspace_bytes));
      auto workspace = std::make_shared<Buffer>(DType::f32, Device::cuda, std::initializer_list<int64_t>{std::max<int64_t>(1, (plan.workspace_bytes + 3) / 4)});
      plan.run = [g, i, pack, workspace] {
        std::unordered_map<int64_t, void*> uids = pack;
        std::lock_guard<std::mutex> lock(cudnn_mutex);
        MARROW_CUDNN_CHECK(g->execute_plan_at_index(handle_locked(nullptr), uids, workspace->ptr<float>(), i));
      };
    }
    plans.push_back(std::move(plan));
  }
  return plans;
}

}  // namespace marrow

#else

namespace marrow {

void cudnn_attention_forward(Tensor, Tensor, Tensor, Tensor, Tensor, const AttentionVariant&, Stream) {
  no_cuda_kernel("cudnn_attention_forward");
}
void cudnn_attention_backward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, const AttentionVariant&, Stream, bool) {
  no_cuda_kernel("cudnn_attention_backward");
}

}  // namespace marrow
#endif  // MARROW_CUDA
