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

// The head dims (q and k, v) the graphs here serve: the models' 64, 128 or 256 (Qwen3.5's) for all
// three, and DeepSeek-V2's 192 with 128 (cuDNN's Hopper kernels take these forward and backward).
bool served_head_dims(int64_t head_dim, int64_t v_head_dim) {
  return (head_dim == v_head_dim && (head_dim == 64 || head_dim == 128 || head_dim == 256)) || (head_dim == 192 && v_head_dim == 128);
}

int64_t workspace_cap_setting = kCudnnAttentionWorkspaceCap, chunk_setting = 0;  // the hooks' values

// The deterministic backward's dP workspace for one call: `q_rows` queries of `q_heads` heads
// against `kv_rows` keys. The cap bounds this part.
int64_t dp_workspace_bytes(int64_t batch, int64_t q_rows, int64_t kv_rows, int64_t q_heads) {
  return batch * q_heads * round_up_64(q_rows) * round_up_64(kv_rows) * 2;
}

// cuDNN's whole workspace for that call (its get_workspace_size on an H200, cuDNN 9.14, to 256
// bytes): dP; with grouped-query heads, dK and dV per query head (bf16, of D and Dv), which it sums
// into the key/value heads (512 MiB for 32 heads at 32,768 keys, D = Dv = 128); the row sums of dO * O (f32).
int64_t call_workspace_bytes(int64_t batch, int64_t q_rows, int64_t kv_rows, int64_t q_heads, int64_t kv_heads,
                             int64_t head_dim, int64_t v_dim) {
  const int64_t per_head_dkv = q_heads > kv_heads ? batch * q_heads * kv_rows * (head_dim + v_dim) * 2 : 0;
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
bool cudnn_attention_forward_supports(int64_t seq, int64_t head_dim, int64_t v_head_dim) {
  return seq > 1 && served_head_dims(head_dim, v_head_dim);
}

bool cudnn_attention_backward_supports(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                       int64_t v_head_dim, bool deterministic) {
  return cudnn_attention_forward_supports(seq, head_dim, v_head_dim) && q_heads % kv_heads == 0 &&
         (!deterministic || backward_plan(batch, seq, q_heads, kv_heads).splits > 0);
}

int64_t cudnn_attention_backward_scratch(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                         int64_t v_head_dim, bool deterministic) {
  // Not deterministic: the f32 dQ accumulator, the row sums of dO * O (f32) and cuDNN's own few MiB.
  if (!deterministic) return batch * seq * q_heads * (head_dim + 1) * 4 + (int64_t(16) << 20);
  const BackwardPlan plan = backward_plan(batch, seq, q_heads, kv_heads);
  if (plan.splits == 0) return 0;
  int64_t workspace = 0;
  for (auto [begin, end] : query_chunks(seq, plan.rows))
    workspace = std::max(workspace, call_workspace_bytes(batch, end - begin, end, q_heads / plan.splits,
                                                         kv_heads / plan.splits, head_dim, v_head_dim));
  const bool chunked = plan.rows < seq;
  return workspace + (chunked ? batch * seq * kv_heads * (head_dim + v_head_dim) * 4 : 0);
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

// One graph's shape: a call covers q_heads / splits query heads (a key/value head group) and q_rows
// query rows against kv_rows key rows from the rows its pointers give, in tensors of q_seq (q, out,
// dout, dq, lse) and kv_seq (k, v, dk, dv) positions; the causal op's backward chunk is query rows
// [q1 - q_rows, q1) against key rows [0, q1), q1 = kv_rows. head_dim is q's and k's, v_dim v's and
// out's; causal: the causal mask (aligned bottom right where q_rows < kv_rows), else none (a full
// block); the variant's window (0: none, nor when it spans the sequence) and whether sinks join the forward.
struct GraphKey {
  bool backward = false;
  bool deterministic = true;
  int64_t batch = 0, q_seq = 0, kv_seq = 0, q_heads = 0, kv_heads = 0, head_dim = 0, v_dim = 0, splits = 1, q_rows = 0,
          kv_rows = 0;
  bool causal = true;
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

// A bf16 tensor [B, seq, row_heads, d] of the caller's, and the rows of it a call covers.
struct Layout {
  int64_t seq, row_heads, d, rows;
};

Layout layout_of(const GraphKey& key, Uid uid) {
  const bool kv_side = uid == kK || uid == kV || uid == kDk || uid == kDv;
  const bool v_like = uid == kV || uid == kOut || uid == kDout || uid == kDv;
  return {kv_side ? key.kv_seq : key.q_seq, kv_side ? key.kv_heads : key.q_heads, v_like ? key.v_dim : key.head_dim,
          kv_side ? key.kv_rows : key.q_rows};
}

// A [B, heads, rows, d] view of the tensor `uid` names (the heads of one group, from the pointer the
// call passes).
void set_head_view(fe::graph::Tensor_attributes& t, Uid uid, const GraphKey& key) {
  const Layout l = layout_of(key, uid);
  t.set_uid(uid)
      .set_dim({key.batch, l.row_heads / key.splits, l.rows, l.d})
      .set_stride({l.seq * l.row_heads * l.d, l.d, l.row_heads * l.d, 1});
}

std::shared_ptr<fe::graph::Tensor_attributes> head_view(fe::graph::Graph& g, const char* name, Uid uid, const GraphKey& key) {
  fe::graph::Tensor_attributes t;
  set_head_view(t.set_name(name), uid, key);
  return g.tensor(t);
}

// lse as cuDNN's Stats: [B, heads, q_rows, 1] f32 inside lse[B, q_heads, q_seq].
void set_lse_view(fe::graph::Tensor_attributes& t, const GraphKey& key, int64_t heads) {
  t.set_uid(kLse)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({key.batch, heads, key.q_rows, 1})
      .set_stride({key.q_heads * key.q_seq, key.q_seq, 1, 1});
}

void describe_forward(fe::graph::Graph& g, const GraphKey& key, int64_t hq, float scale) {
  auto q = head_view(g, "q", kQ, key);
  auto k = head_view(g, "k", kK, key);
  auto v = head_view(g, "v", kV, key);
  auto options =
      fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true).set_causal_mask(key.causal).set_attn_scale(scale);
  if (key.window > 0) options.set_diagonal_band_left_bound(int(key.window));
  if (key.sinks) {
    fe::graph::Tensor_attributes sinks;
    sinks.set_name("sinks").set_uid(kSinks).set_data_type(fe::DataType_t::FLOAT).set_dim({1, hq, 1, 1}).set_stride({hq, 1, 1, 1});
    options.set_sink_token(g.tensor(sinks));
  }
  auto [out, lse] = g.sdpa(q, k, v, options);
  out->set_output(true);
  set_head_view(*out, kOut, key);
  lse->set_output(true);
  set_lse_view(*lse, key, hq);
}

void describe_backward(fe::graph::Graph& g, const GraphKey& key, int64_t hq, float scale) {
  auto q = head_view(g, "q", kQ, key);
  auto k = head_view(g, "k", kK, key);
  auto v = head_view(g, "v", kV, key);
  auto out = head_view(g, "out", kOut, key);
  auto dout = head_view(g, "dout", kDout, key);
  auto lse = g.tensor(fe::graph::Tensor_attributes().set_name("lse"));
  set_lse_view(*lse, key, hq);
  // A query chunk ends where its keys end: query q1 - q_rows + i sees keys 0 .. q1 - q_rows + i,
  // the causal diagonal aligned to the bottom right of the q_rows x kv_rows scores.
  auto options =
      fe::graph::SDPA_backward_attributes().set_name("attention_backward").set_attn_scale(scale).set_deterministic_algorithm(key.deterministic);
  if (key.causal && key.q_rows == key.kv_rows) options.set_causal_mask(true);
  else if (key.causal) options.set_causal_mask_bottom_right(true);
  if (key.window > 0) options.set_diagonal_band_left_bound(int(key.window));
  auto [dq, dk, dv] = g.sdpa_backward(q, k, v, out, dout, lse, options);
  for (auto [t, uid] : {std::pair{dq, kDq}, std::pair{dk, kDk}, std::pair{dv, kDv}}) {
    t->set_output(true);
    set_head_view(*t, uid, key);
  }
}

// The key's graph described and lowered, before any execution plan is chosen.
std::shared_ptr<fe::graph::Graph> described_graph(const GraphKey& key, cudnnHandle_t handle) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const int64_t hq = key.q_heads / key.splits;
  const float scale = float(1 / std::sqrt(double(key.head_dim)));
  if (key.backward) describe_backward(*g, key, hq, scale);
  else describe_forward(*g, key, hq, scale);
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
  const int64_t hq = key.q_heads / key.splits;
  for (int64_t group = 0; group < key.splits; ++group) {
    std::unordered_map<int64_t, void*> pack;
    for (auto [uid, ptr] : base) {
      const Layout l = layout_of(key, Uid(uid));
      const int64_t offset =
          uid == kLse ? group * hq * key.q_seq * 4 : uid == kSinks ? group * hq * 4 : group * (l.row_heads / key.splits) * l.d * 2;
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

// The causal op's key: q [B, S, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv], out [B, S, Hq, Dv].
GraphKey key_of(const char* op, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool backward,
                bool deterministic, const AttentionVariant& variant) {
  MARROW_CHECK(q.ndim == 4 && k.ndim == 4 && v.ndim == 4, "{}: q, k and v must be [batch, seq, heads, head_dim], got {}, {} and {}",
               op, q.shape_string(), k.shape_string(), v.shape_string());
  MARROW_CHECK(variant.window >= 0, "{}: the sliding window must be 0 (none) or positive, got {}", op, variant.window);
  const int64_t s = q.size(1);
  GraphKey key{backward, deterministic, q.size(0), s, s, q.size(2), k.size(2), q.size(3), v.size(3), 1, s, s};
  key.window = variant.window < s ? variant.window : 0;
  key.sinks = !backward && variant.sinks.data;
  expect_shape(op, "k", k, {key.batch, s, key.kv_heads, key.head_dim});
  expect_shape(op, "v", v, {key.batch, s, key.kv_heads, key.v_dim});
  expect_shape(op, "out", out, {key.batch, s, key.q_heads, key.v_dim});
  expect_shape(op, "lse", lse, {key.batch, key.q_heads, s});
  const bool served = backward && deterministic
                          ? cudnn_attention_backward_supports(key.batch, s, key.q_heads, key.kv_heads, key.head_dim, key.v_dim)
                          : cudnn_attention_forward_supports(s, key.head_dim, key.v_dim);
  MARROW_CHECK(served, "{}: cuDNN attention does not serve batch {}, sequence {}, {} / {} heads, head dims {} (q, k) and {} (v)",
               op, key.batch, s, key.q_heads, key.kv_heads, key.head_dim, key.v_dim);
  expect_dtype(op, "lse", lse, DType::f32);
  expect_device(op, "lse", lse, Device::cuda);
  return key;
}

// The causal op's gradients and dout: dq like q, dk like k, dv like v, dout like out.
void expect_grad_shapes(const char* op, const GraphKey& key, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout) {
  const int64_t b = key.batch, s = key.q_seq;
  expect_shape(op, "dq", dq, {b, s, key.q_heads, key.head_dim});
  expect_shape(op, "dout", dout, {b, s, key.q_heads, key.v_dim});
  expect_shape(op, "dk", dk, {b, s, key.kv_heads, key.head_dim});
  expect_shape(op, "dv", dv, {b, s, key.kv_heads, key.v_dim});
}

// Row `row` of a bf16 [B, S, H, d] tensor (of batch row 0: the views' strides reach the others).
void* row_at(const Tensor& t, int64_t row) { return static_cast<char*>(t.data) + row * t.size(2) * t.size(3) * 2; }
void* lse_row_at(const Tensor& lse, int64_t row) { return static_cast<char*>(lse.data) + row * 4; }

// Rows [begin, end) of each batch row of sum[B, S, H, d] (f32) += those of share (bf16).
void add_rows(Tensor sum, Tensor share, int64_t begin, int64_t end, Stream stream) {
  for (int64_t b = 0; b < sum.size(0); ++b) {
    auto rows = [&](const Tensor& t) { return t.rows(b, b + 1).reshape({t.size(1), t.size(2), t.size(3)}).rows(begin, end); };
    add_into(rows(sum), rows(share), stream);
  }
}

// A block's key (attention.cu has checked its shapes and ranges): one call per key/value head group
// over the block's rows, the causal mask or none.
GraphKey block_key(const char* op, Tensor q, Tensor k, Tensor v, Tensor lse, const AttentionBlock& block, bool backward,
                   bool deterministic) {
  GraphKey key{backward, deterministic, q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3), 1,
               block.q_end - block.q_begin, block.k_end - block.k_begin};
  key.causal = block.mask == AttentionMask::causal;
  MARROW_CHECK(served_head_dims(key.head_dim, key.v_dim) && block.window == 0 && key.q_rows * key.kv_rows != 1,
               "{}: cuDNN attention does not serve a block of {} queries and {} keys at window {}, head dims {} (q, k) and {} (v)",
               op, key.q_rows, key.kv_rows, block.window, key.head_dim, key.v_dim);
  expect_dtype(op, "lse", lse, DType::f32);
  expect_device(op, "lse", lse, Device::cuda);
  return key;
}

// The fewest key/value head groups whose deterministic dP workspace for one call over the block's
// rows fits the cap (blocks take no query chunks); 0 where none does.
int64_t block_splits(const GraphKey& key) {
  for (int64_t splits = 1; splits <= key.kv_heads; ++splits)
    if (key.kv_heads % splits == 0 &&
        dp_workspace_bytes(key.batch, key.q_rows, key.kv_rows, key.q_heads / splits) <= workspace_cap_setting)
      return splits;
  return 0;
}

}  // namespace

void cudnn_attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionVariant& variant,
                             Stream stream) {
  const char* op = "cudnn_attention_forward";
  expect_bf16_gpu(op, {{"out", &out}, {"q", &q}, {"k", &k}, {"v", &v}});
  const GraphKey key = key_of(op, q, k, v, out, lse, false, true, variant);
  if (key.batch * key.q_seq == 0) return;
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
  expect_grad_shapes(op, key, dq, dk, dv, dout);
  const int64_t b = key.batch, s = key.q_seq;
  if (b * s == 0) return;
  const BackwardPlan plan = deterministic ? backward_plan(b, s, key.q_heads, key.kv_heads) : BackwardPlan{1, s};
  key.splits = plan.splits;
  const auto chunks = query_chunks(s, plan.rows);
  // Several chunks: each call writes its share of dK, dV into rows [0, q1) of dk, dv, which the
  // f32 accumulators then take (the first call, the last chunk, covers every row).
  Buffer dk_sum, dv_sum;
  if (chunks.size() > 1) {
    dk_sum = Buffer(DType::f32, Device::cuda, {b, s, key.kv_heads, key.head_dim}, stream);
    dv_sum = Buffer(DType::f32, Device::cuda, {b, s, key.kv_heads, key.v_dim}, stream);
  }
  for (size_t i = 0; i < chunks.size(); ++i) {
    const int64_t q0 = chunks[i].first, q1 = chunks[i].second;
    key.q_rows = q1 - q0;
    key.kv_rows = q1;
    run_graph(key,
              {{kQ, row_at(q, q0)}, {kK, k.data}, {kV, v.data}, {kOut, row_at(out, q0)}, {kLse, lse_row_at(lse, q0)},
               {kDout, row_at(dout, q0)}, {kDq, row_at(dq, q0)}, {kDk, dk.data}, {kDv, dv.data}},
              stream);
    if (chunks.size() == 1) return;
    for (auto [sum, share] : {std::pair{&dk_sum, dk}, std::pair{&dv_sum, dv}}) {
      if (i == 0) cast(*sum, share, stream);
      else add_rows(*sum, share, 0, q1, stream);
    }
  }
  cast(dk, dk_sum, stream);
  cast(dv, dv_sum, stream);
}

void cudnn_attention_block_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionBlock& block, Stream stream) {
  const char* op = "cudnn_attention_block_forward";
  expect_bf16_gpu(op, {{"out", &out}, {"q", &q}, {"k", &k}, {"v", &v}});
  const GraphKey key = block_key(op, q, k, v, lse, block, false, true);
  if (key.batch * key.q_rows == 0) return;
  run_graph(key,
            {{kQ, row_at(q, block.q_begin)}, {kK, row_at(k, block.k_begin)}, {kV, row_at(v, block.k_begin)},
             {kOut, row_at(out, block.q_begin)}, {kLse, lse_row_at(lse, block.q_begin)}},
            stream);
}

void cudnn_attention_block_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                                    Tensor lse, const AttentionBlock& block, AttentionGrads grads, Stream stream, bool deterministic) {
  const char* op = "cudnn_attention_block_backward";
  expect_bf16_gpu(op, {{"dout", &dout}, {"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}});
  for (auto [name, g] : {std::pair{"dq", &dq}, std::pair{"dk", &dk}, std::pair{"dv", &dv}}) expect_dtype(op, name, *g, DType::f32);
  GraphKey key = block_key(op, q, k, v, lse, block, true, deterministic);
  key.splits = deterministic ? block_splits(key) : 1;
  MARROW_CHECK(key.splits > 0,
               "{}: the deterministic backward of a block of {} queries and {} keys over {} batch rows and {} / {} heads "
               "passes the {}-byte workspace cap",
               op, key.q_rows, key.kv_rows, key.batch, key.q_heads, key.kv_heads, workspace_cap_setting);
  if (key.batch * key.q_rows == 0) return;
  // cuDNN writes bf16 gradients and overwrites them: the block's share lands in bf16 buffers shaped
  // like dq, dk, dv (its rows only), and is added from there into the f32 sums.
  auto like = [&](const Tensor& t) { return Buffer(DType::bf16, Device::cuda, {t.size(0), t.size(1), t.size(2), t.size(3)}, stream); };
  const Buffer share[3] = {like(dq), like(dk), like(dv)};
  run_graph(key,
            {{kQ, row_at(q, block.q_begin)}, {kK, row_at(k, block.k_begin)}, {kV, row_at(v, block.k_begin)},
             {kOut, row_at(out, block.q_begin)}, {kLse, lse_row_at(lse, block.q_begin)}, {kDout, row_at(dout, block.q_begin)},
             {kDq, row_at(share[0], block.q_begin)}, {kDk, row_at(share[1], block.k_begin)}, {kDv, row_at(share[2], block.k_begin)}},
            stream);
  if (grads != AttentionGrads::kv) add_rows(dq, share[0], block.q_begin, block.q_end, stream);
  if (grads == AttentionGrads::q) return;
  add_rows(dk, share[1], block.k_begin, block.k_end, stream);
  add_rows(dv, share[2], block.k_begin, block.k_end, stream);
}

std::vector<CudnnAttentionPlan> cudnn_attention_plans(bool backward, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q,
                                                      Tensor k, Tensor v, Tensor out, Tensor lse) {
  const char* op = "cudnn_attention_plans";
  GraphKey key = key_of(op, q, k, v, out, lse, backward, true, AttentionVariant{});
  expect_bf16_gpu(op, {{"out", &out}, {"q", &q}, {"k", &k}, {"v", &v}});
  if (backward) {
    expect_bf16_gpu(op, {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}, {"dout", &dout}});
    expect_grad_shapes(op, key, dq, dk, dv, dout);
    const BackwardPlan plan = backward_plan(key.batch, key.q_seq, key.q_heads, key.kv_heads);
    MARROW_CHECK(plan.splits == 1 && plan.rows == key.q_seq, "{}: the backward of these sizes runs in {} head groups of query chunks of {} rows, not one call",
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
void cudnn_attention_block_forward(Tensor, Tensor, Tensor, Tensor, Tensor, const AttentionBlock&, Stream) {
  no_cuda_kernel("cudnn_attention_block_forward");
}
void cudnn_attention_block_backward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, const AttentionBlock&,
                                    AttentionGrads, Stream, bool) {
  no_cuda_kernel("cudnn_attention_block_backward");
}

}  // namespace marrow
#endif  // MARROW_CUDA
