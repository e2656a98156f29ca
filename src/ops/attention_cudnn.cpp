// cuDNN's fused SDPA behind attention.h's causal op (see attention_cudnn.h). Host code only: the
// graphs are described with the cuDNN frontend (header-only) and run cuDNN's own kernels.
#include "ops/attention_cudnn.h"

#include <cmath>

#include "core/errors.h"

namespace marrow {

namespace {

int64_t round_up_64(int64_t n) { return (n + 63) / 64 * 64; }

// The deterministic backward's dP workspace for one call over `q_heads` query heads.
int64_t dp_workspace_bytes(int64_t batch, int64_t seq, int64_t q_heads) {
  return batch * q_heads * round_up_64(seq) * round_up_64(seq) * 2;
}

// The fewest calls (a divisor of kv_heads) whose dP workspace each fits the cap; 0 when none does.
int64_t backward_splits(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads) {
  for (int64_t splits = 1; splits <= kv_heads; ++splits)
    if (kv_heads % splits == 0 && dp_workspace_bytes(batch, seq, q_heads / splits) <= kCudnnAttentionWorkspaceCap)
      return splits;
  return 0;
}

}  // namespace

// cuDNN refuses a single position (s_q = s_kv = 1); the own kernels take it.
bool cudnn_attention_forward_supports(int64_t seq, int64_t head_dim) {
  return seq > 1 && (head_dim == 64 || head_dim == 128);
}

bool cudnn_attention_backward_supports(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                       bool deterministic) {
  return cudnn_attention_forward_supports(seq, head_dim) && q_heads % kv_heads == 0 &&
         (!deterministic || backward_splits(batch, seq, q_heads, kv_heads) > 0);
}

int64_t cudnn_attention_backward_scratch(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                         bool deterministic) {
  // Besides dP (deterministic) or the f32 dQ accumulator (not): the row sums of dO * O (f32) and
  // cuDNN's own few MiB.
  const int64_t small = batch * q_heads * seq * 4 + (int64_t(16) << 20);
  if (!deterministic) return batch * seq * q_heads * head_dim * 4 + small;
  const int64_t splits = backward_splits(batch, seq, q_heads, kv_heads);
  return splits == 0 ? 0 : dp_workspace_bytes(batch, seq, q_heads / splits) + small / splits;
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

#define MARROW_CUDNN_CHECK(call)                                                           \
  do {                                                                                     \
    cudnnStatus_t marrow_status_ = (call);                                                 \
    if (marrow_status_ != CUDNN_STATUS_SUCCESS)                                            \
      ::marrow::fail_call(__FILE__, __LINE__, #call, cudnnGetErrorString(marrow_status_)); \
  } while (0)

#define MARROW_CUDNN_FE_CHECK(call)                                                          \
  do {                                                                                       \
    auto marrow_fe_error_ = (call);                                                          \
    if (marrow_fe_error_.is_bad())                                                           \
      ::marrow::fail_call(__FILE__, __LINE__, #call, marrow_fe_error_.get_message());        \
  } while (0)

namespace marrow {

namespace {

namespace fe = cudnn_frontend;

enum Uid : int64_t { kQ = 1, kK, kV, kOut, kLse, kDout, kDq, kDk, kDv };

// One graph's shape: a call covers `heads` query heads of q_heads (a key/value head group).
struct GraphKey {
  bool backward = false;
  bool deterministic = true;
  int64_t batch = 0, seq = 0, q_heads = 0, kv_heads = 0, head_dim = 0, splits = 1;
  auto operator<=>(const GraphKey&) const = default;
};

struct BuiltGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
};

std::mutex& cudnn_mutex() {
  static std::mutex m;
  return m;
}

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

// A [B, heads, S, D] view of a [B, S, row_heads, D] tensor (the heads of one group).
std::shared_ptr<fe::graph::Tensor_attributes> head_view(fe::graph::Graph& g, const char* name, Uid uid,
                                                        const GraphKey& key, int64_t heads, int64_t row_heads) {
  const int64_t d = key.head_dim;
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({key.batch, heads, key.seq, d})
                      .set_stride({key.seq * row_heads * d, d, row_heads * d, 1}));
}

void set_head_view(fe::graph::Tensor_attributes& t, Uid uid, const GraphKey& key, int64_t heads, int64_t row_heads) {
  const int64_t d = key.head_dim;
  t.set_uid(uid).set_dim({key.batch, heads, key.seq, d}).set_stride({key.seq * row_heads * d, d, row_heads * d, 1});
}

// lse as cuDNN's Stats: [B, heads, S, 1] f32 inside lse[B, q_heads, S].
void set_lse_view(fe::graph::Tensor_attributes& t, const GraphKey& key, int64_t heads) {
  t.set_uid(kLse)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({key.batch, heads, key.seq, 1})
      .set_stride({key.q_heads * key.seq, key.seq, 1, 1});
}

void describe_forward(fe::graph::Graph& g, const GraphKey& key, int64_t hq, int64_t hkv, float scale) {
  auto q = head_view(g, "q", kQ, key, hq, key.q_heads);
  auto k = head_view(g, "k", kK, key, hkv, key.kv_heads);
  auto v = head_view(g, "v", kV, key, hkv, key.kv_heads);
  auto options =
      fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true).set_causal_mask(true).set_attn_scale(
          scale);
  auto [out, lse] = g.sdpa(q, k, v, options);
  out->set_output(true);
  set_head_view(*out, kOut, key, hq, key.q_heads);
  lse->set_output(true);
  set_lse_view(*lse, key, hq);
}

void describe_backward(fe::graph::Graph& g, const GraphKey& key, int64_t hq, int64_t hkv, float scale) {
  auto q = head_view(g, "q", kQ, key, hq, key.q_heads);
  auto k = head_view(g, "k", kK, key, hkv, key.kv_heads);
  auto v = head_view(g, "v", kV, key, hkv, key.kv_heads);
  auto out = head_view(g, "out", kOut, key, hq, key.q_heads);
  auto dout = head_view(g, "dout", kDout, key, hq, key.q_heads);
  auto lse = g.tensor(fe::graph::Tensor_attributes().set_name("lse"));
  set_lse_view(*lse, key, hq);
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("attention_backward")
                     .set_causal_mask(true)
                     .set_attn_scale(scale)
                     .set_deterministic_algorithm(key.deterministic);
  auto [dq, dk, dv] = g.sdpa_backward(q, k, v, out, dout, lse, options);
  for (auto [t, uid, heads, row_heads] : {std::tuple{dq, kDq, hq, key.q_heads}, std::tuple{dk, kDk, hkv, key.kv_heads},
                                          std::tuple{dv, kDv, hkv, key.kv_heads}}) {
    t->set_output(true);
    set_head_view(*t, uid, key, heads, row_heads);
  }
}

BuiltGraph build_graph(const GraphKey& key, cudnnHandle_t handle) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const int64_t hq = key.q_heads / key.splits, hkv = key.kv_heads / key.splits;
  const float scale = float(1 / std::sqrt(double(key.head_dim)));
  if (key.backward) describe_backward(*g, key, hq, hkv, scale);
  else describe_forward(*g, key, hq, hkv, scale);
  MARROW_CUDNN_FE_CHECK(g->validate());
  MARROW_CUDNN_FE_CHECK(g->build_operation_graph(handle));
  MARROW_CUDNN_FE_CHECK(g->create_execution_plans({fe::HeurMode_t::A}));
  MARROW_CUDNN_FE_CHECK(g->check_support(handle));
  MARROW_CUDNN_FE_CHECK(g->build_plans(handle));
  BuiltGraph built{g, 0};
  MARROW_CUDNN_FE_CHECK(g->get_workspace_size(built.workspace_bytes));
  return built;
}

// Runs the key's graph once per key/value head group, each call on its group's slices.
void run_graph(const GraphKey& key, std::unordered_map<int64_t, void*> base, Stream stream) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  std::lock_guard<std::mutex> lock(cudnn_mutex());
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
      const int64_t offset = uid == kLse ? group * hq * key.seq * 4 : group * (kv ? hkv : hq) * d * 2;
      pack[uid] = static_cast<char*>(ptr) + offset;
    }
    MARROW_CUDNN_FE_CHECK(built.graph->execute(handle, pack, workspace.ptr<float>()));
  }
}

void expect_bf16_gpu(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  for (auto [name, t] : tensors) {
    expect_dtype(op, name, *t, DType::bf16);
    expect_device(op, name, *t, Device::cuda);
  }
}

GraphKey key_of(const char* op, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool backward,
                bool deterministic) {
  MARROW_CHECK(q.ndim == 4 && k.ndim == 4, "{}: q and k must be [batch, seq, heads, head_dim], got {} and {}", op,
               q.shape_string(), k.shape_string());
  GraphKey key{backward, deterministic, q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), 1};
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
  key.splits = backward && deterministic ? backward_splits(key.batch, key.seq, key.q_heads, key.kv_heads) : 1;
  return key;
}

}  // namespace

void cudnn_attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, Stream stream) {
  const char* op = "cudnn_attention_forward";
  expect_bf16_gpu(op, {{"out", &out}, {"q", &q}, {"k", &k}, {"v", &v}});
  const GraphKey key = key_of(op, q, k, v, out, lse, false, true);
  if (key.batch * key.seq == 0) return;
  run_graph(key, {{kQ, q.data}, {kK, k.data}, {kV, v.data}, {kOut, out.data}, {kLse, lse.data}}, stream);
}

void cudnn_attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                              Tensor lse, Stream stream, bool deterministic) {
  const char* op = "cudnn_attention_backward";
  expect_bf16_gpu(op, {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}, {"dout", &dout}, {"q", &q}, {"k", &k}, {"v", &v},
                       {"out", &out}});
  const GraphKey key = key_of(op, q, k, v, out, lse, true, deterministic);
  const int64_t b = key.batch, s = key.seq, d = key.head_dim;
  expect_shape(op, "dq", dq, {b, s, key.q_heads, d});
  expect_shape(op, "dout", dout, {b, s, key.q_heads, d});
  expect_shape(op, "dk", dk, {b, s, key.kv_heads, d});
  expect_shape(op, "dv", dv, {b, s, key.kv_heads, d});
  if (key.batch * key.seq == 0) return;
  run_graph(key,
            {{kQ, q.data},
             {kK, k.data},
             {kV, v.data},
             {kOut, out.data},
             {kLse, lse.data},
             {kDout, dout.data},
             {kDq, dq.data},
             {kDk, dk.data},
             {kDv, dv.data}},
            stream);
}

}  // namespace marrow
#endif  // MARROW_CUDA
