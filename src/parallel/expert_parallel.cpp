#include "parallel/expert_parallel.h"

#include <chrono>
#include <numeric>

#include "ops/combine.h"
#include "ops/dispatch.h"
#include "ops/init.h"

#if MARROW_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#endif

namespace marrow {

namespace {

Buffer like(const Tensor& t, std::initializer_list<int64_t> dims) { return Buffer(t.dtype, t.device, dims); }

// On the host: send_row [T, P] and the expert slots of each sent row, [sent, K], local to the
// member it goes to (-1 where that slot's expert lives elsewhere); returns rows per member. owner[e]
// is the member holding expert e (a table: integer division per copy was most of the plan's time).
std::vector<int64_t> plan_sends(int32_t* send_row, std::vector<int32_t>& send_slots, const int32_t* topk_index, int64_t tokens,
                                int64_t k, int64_t members, int64_t local_experts, const int32_t* owner) {
  std::vector<int64_t> rows(size_t(members), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    int32_t* row = send_row + t * members;
    for (int64_t d = 0; d < members; ++d) row[d] = -1;
    for (int64_t j = 0; j < k; ++j) row[owner[topk_index[t * k + j]]] = 0;
    for (int64_t d = 0; d < members; ++d) rows[size_t(d)] += row[d] == 0;
  }
  std::vector<int64_t> next(size_t(members), 0);
  for (int64_t d = 1; d < members; ++d) next[size_t(d)] = next[size_t(d - 1)] + rows[size_t(d - 1)];
  send_slots.assign(size_t(next.back() + rows.back()) * size_t(k), -1);
  for (int64_t t = 0; t < tokens; ++t) {
    int32_t* row = send_row + t * members;
    for (int64_t d = 0; d < members; ++d)
      if (row[d] == 0) row[d] = int32_t(next[size_t(d)]++);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = topk_index[t * k + j], d = owner[e];
      send_slots[size_t(row[d] * k + j)] = int32_t(e - d * local_experts);
    }
  }
  return rows;
}

// On the host: the received rows' copies grouped by local expert, in (row, slot) order within an
// expert (a counting sort, as dispatch_plan does for one process); returns the number of copies.
int64_t plan_copies(int32_t* expert_offsets, int32_t* copy_row, const int32_t* slots, int64_t rows, int64_t k, int64_t local_experts) {
  std::vector<int32_t> next(size_t(local_experts) + 1, 0);
  for (int64_t i = 0; i < rows * k; ++i)
    if (slots[i] >= 0) ++next[size_t(slots[i]) + 1];
  for (int64_t e = 0; e < local_experts; ++e) next[size_t(e) + 1] += next[size_t(e)];
  std::copy(next.begin(), next.end(), expert_offsets);
  for (int64_t i = 0; i < rows * k; ++i) copy_row[i] = slots[i] >= 0 ? next[size_t(slots[i])]++ : -1;
  return expert_offsets[local_experts];
}

std::vector<int64_t> prefix_sums(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
  return offsets;
}

}  // namespace

ExpertParallel::ExpertParallel(const Comm& group, int64_t num_experts)
    : group_(group), num_experts_(num_experts), local_experts_(num_experts / group.size()) {
  MARROW_CHECK(num_experts % group.size() == 0, "num_experts ({}) is not a multiple of parallel.ep ({}): each expert-parallel rank must hold as many experts", num_experts,
               group.size());
  for (int64_t e = 0; e < num_experts; ++e) owner_.push_back(int32_t(e / local_experts_));
}

void ExpertParallel::read_routing(Tensor topk_index) const {
  MARROW_CHECK(topk_index.ndim == 2 && topk_index.dtype == DType::i32, "ExpertParallel::read_routing: topk_index must be [tokens, k] i32, got {} {}",
               topk_index.shape_string(), dtype_name(topk_index.dtype));
  const Tensor staged = host_.topk_index.tensor(DType::i32, {topk_index.size(0), topk_index.size(1)}, topk_index.device);
  host_.routing_arrived = copy_to_host_async(staged, topk_index);
  host_.routing = topk_index.data;
}

void ExpertParallel::plan(ExpertRoute& route, Tensor topk_index, Device device) const {
  const int64_t T = topk_index.size(0), K = topk_index.size(1), P = group_.size();
  // Host arrays are reused from plan to plan: fresh ones of this size would be new pages, and page
  // faults made the plan ~1 ms per layer on the GPU machine.
  HostPlan& h = host_;
  if (h.routing != topk_index.data) read_routing(topk_index);
  h.routing = nullptr;
  h.routing_arrived.wait();  // the GPU's queue after the router may still run
  const auto start = std::chrono::steady_clock::now();
  const int32_t* experts = h.topk_index.tensor(DType::i32, {T, K}, device).ptr<int32_t>();
  for (int64_t i = 0; i < T * K; ++i) {
    MARROW_CHECK(experts[i] >= 0 && experts[i] < num_experts_, "expert-parallel dispatch: topk_index holds expert {} outside [0, {})",
                 experts[i], num_experts_);
    route.remote_copies += owner_[size_t(experts[i])] != group_.rank();
  }
  const Tensor send_row = h.send_row.tensor(DType::i32, {T, P}, device);
  route.send_rows = plan_sends(send_row.ptr<int32_t>(), h.send_slots, experts, T, K, P, local_experts_, owner_.data());
  const auto exchange_start = std::chrono::steady_clock::now();
  route.recv_rows = group_.exchange_counts(route.send_rows, "expert-parallel row counts (exchange_counts)");
  route.sent = prefix_sums(route.send_rows).back();
  route.remote_rows = route.sent - route.send_rows[size_t(group_.rank())];
  traffic_.remote_rows += route.remote_rows;
  traffic_.remote_copies += route.remote_copies;
  ++traffic_.dispatches;
  route.received = prefix_sums(route.recv_rows).back();
  // The slots travel on the host: the receiver plans its grouped GEMM rows without waiting for its GPU.
  h.recv_slots.resize(size_t(route.received * K));
  group_.all_to_all_v(Tensor(h.recv_slots.data(), DType::i32, Device::cpu, {route.received, K}), route.recv_rows,
                      Tensor(h.send_slots.data(), DType::i32, Device::cpu, {route.sent, K}), route.send_rows,
                      "expert-parallel expert slots (all_to_all_v)");
  traffic_.exchange_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - exchange_start).count();
  route.expert_offsets = Buffer(DType::i32, Device::cpu, {local_experts_ + 1});
  const Tensor copy_row = h.copy_row.tensor(DType::i32, {route.received, K}, device);
  route.copies = plan_copies(route.expert_offsets.ptr<int32_t>(), copy_row.ptr<int32_t>(), h.recv_slots.data(), route.received, K, local_experts_);
  const auto upload_start = std::chrono::steady_clock::now();
  route.send_row = Buffer(DType::i32, device, {T, P});
  route.copy_row = Buffer(DType::i32, device, {route.received, K});
  copy(route.send_row, send_row);
  copy(route.copy_row, copy_row);
  const auto end = std::chrono::steady_clock::now();
  traffic_.upload_ms += std::chrono::duration<double, std::milli>(end - upload_start).count();
  traffic_.plan_ms += std::chrono::duration<double, std::milli>(end - start).count();
}

ExpertParallel::Exchange ExpertParallel::start_dispatch(ExpertRoute& route, Tensor x, Tensor topk_index, Tensor topk_weight) const {
  const char* op = "ExpertParallel::start_dispatch";
  MARROW_CHECK(x.ndim == 2 && topk_index.ndim == 2, "{}: x must be [tokens, hidden] and topk_index [tokens, k], got {} and {}", op,
               x.shape_string(), topk_index.shape_string());
  const int64_t T = x.size(0), H = x.size(1), K = topk_index.size(1), P = group_.size();
  expect_shape(op, "topk_index", topk_index, {T, K});
  expect_shape(op, "topk_weight", topk_weight, {T, K});
  plan(route, topk_index, x.device);
  route.unit_weight = like(topk_weight, {T, P});
  fill_constant(route.unit_weight, 1.0);
  Exchange e{like(x, {route.sent, H}), like(topk_weight, {route.sent, K}), like(x, {route.received, H}), like(topk_weight, {route.received, K}), {}};
  marrow::dispatch_forward(e.sent, x, route.send_row);
  marrow::dispatch_forward(e.sent_weights, topk_weight, route.send_row);
  group_.all_to_all_v(e.received, route.recv_rows, e.sent, route.send_rows, "expert-parallel dispatch of hidden states (all_to_all_v)", false);
  group_.all_to_all_v(e.received_weights, route.recv_rows, e.sent_weights, route.send_rows,
                      "expert-parallel dispatch of routing weights (all_to_all_v)", false);
  e.done = group_.queued();
  return e;
}

Buffer ExpertParallel::finish_dispatch(Exchange& e, ExpertRoute& route) const {
  group_.wait_for(e.done);
  Buffer x_perm = like(e.received, {route.copies, e.received.view().size(1)});
  marrow::dispatch_forward(x_perm, e.received, route.copy_row);
  route.recv_weight = std::move(e.received_weights);
  e = Exchange{};
  return x_perm;
}

ExpertParallel::Exchange ExpertParallel::start_combine(Tensor y_perm, const ExpertRoute& route) const {
  const int64_t H = y_perm.size(1);
  expect_shape("ExpertParallel::start_combine", "y_perm", y_perm, {route.copies, H});
  Exchange e{like(y_perm, {route.received, H}), {}, like(y_perm, {route.sent, H}), {}, {}};
  marrow::combine_forward(e.sent, Tensor{}, y_perm, route.recv_weight, route.copy_row);
  group_.all_to_all_v(e.received, route.send_rows, e.sent, route.recv_rows, "expert-parallel combine of expert outputs (all_to_all_v)", false);
  e.done = group_.queued();
  return e;
}

void ExpertParallel::finish_combine(Tensor out, Tensor residual, Exchange& e, const ExpertRoute& route) const {
  group_.wait_for(e.done);
  marrow::combine_forward(out, residual, e.received, route.unit_weight, route.send_row);
  e = Exchange{};
}

ExpertParallel::Exchange ExpertParallel::start_combine_backward(Tensor dout, const ExpertRoute& route) const {
  const int64_t H = dout.size(1);
  Exchange e{like(dout, {route.sent, H}), {}, like(dout, {route.received, H}), {}, {}};
  marrow::dispatch_forward(e.sent, dout, route.send_row);
  group_.all_to_all_v(e.received, route.recv_rows, e.sent, route.send_rows, "expert-parallel output gradients (all_to_all_v)", false);
  e.done = group_.queued();
  return e;
}

Buffer ExpertParallel::finish_combine_backward(Tensor dy_perm, Tensor y_perm, Exchange& e, const ExpertRoute& route) const {
  const int64_t H = y_perm.size(1), K = route.recv_weight.view().size(1);
  expect_shape("ExpertParallel::finish_combine_backward", "dy_perm", dy_perm, {route.copies, H});
  group_.wait_for(e.done);
  Buffer dweight_recv = like(route.recv_weight, {route.received, K});
  marrow::combine_backward(dy_perm, dweight_recv, e.received, y_perm, route.recv_weight, route.copy_row);
  e = Exchange{};
  return dweight_recv;
}

ExpertParallel::Exchange ExpertParallel::start_dispatch_backward(Tensor dx_perm, Buffer dweight_recv, const ExpertRoute& route) const {
  const int64_t H = dx_perm.size(1), K = dweight_recv.view().size(1);
  expect_shape("ExpertParallel::start_dispatch_backward", "dx_perm", dx_perm, {route.copies, H});
  expect_shape("ExpertParallel::start_dispatch_backward", "dweight_recv", dweight_recv, {route.received, K});
  Buffer weights_back = like(dweight_recv.view(), {route.sent, K});
  Exchange e{like(dx_perm, {route.received, H}), std::move(dweight_recv), like(dx_perm, {route.sent, H}), std::move(weights_back), {}};
  marrow::dispatch_backward(e.sent, dx_perm, route.copy_row);
  group_.all_to_all_v(e.received, route.send_rows, e.sent, route.recv_rows, "expert-parallel input gradients (all_to_all_v)", false);
  group_.all_to_all_v(e.received_weights, route.send_rows, e.sent_weights, route.recv_rows,
                      "expert-parallel routing-weight gradients (all_to_all_v)", false);
  e.done = group_.queued();
  return e;
}

void ExpertParallel::finish_dispatch_backward(Tensor dx, Tensor dtopk_weight, Exchange& e, const ExpertRoute& route) const {
  group_.wait_for(e.done);
  marrow::dispatch_backward(dx, e.received, route.send_row);
  marrow::dispatch_backward(dtopk_weight, e.received_weights, route.send_row);
  e = Exchange{};
}

}  // namespace marrow
