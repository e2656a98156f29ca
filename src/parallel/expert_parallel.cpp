#include "parallel/expert_parallel.h"

#include <chrono>
#include <numeric>

#include "ops/combine.h"
#include "ops/dispatch.h"
#include "ops/expert_sends.h"
#include "ops/init.h"

namespace marrow {

namespace {

Buffer like(const Tensor& t, std::initializer_list<int64_t> dims) { return Buffer(t.dtype, t.device, dims); }

}  // namespace

ExpertParallel::ExpertParallel(const Comm& group, int64_t num_experts)
    : group_(group), num_experts_(num_experts), local_experts_(num_experts / group.size()) {
  MARROW_CHECK(num_experts % group.size() == 0, "num_experts ({}) is not a multiple of parallel.ep ({}): each expert-parallel rank must hold as many experts", num_experts,
               group.size());
  for (int64_t e = 0; e < num_experts; ++e) owner_.push_back(int32_t(e / local_experts_));
}

Tensor ExpertParallel::owner_on(Device device) const {
  if (owner_device_.view().data == nullptr || owner_device_.view().device != device) {
    owner_device_ = Buffer(DType::i32, device, {num_experts_});
    copy(owner_device_, Tensor(const_cast<int32_t*>(owner_.data()), DType::i32, Device::cpu, {num_experts_}));  // only read
  }
  return owner_device_.view();
}

void ExpertParallel::plan_sends(ExpertRoute& route, Tensor topk_index) const {
  MARROW_CHECK(topk_index.ndim == 2 && topk_index.dtype == DType::i32, "ExpertParallel::plan_sends: topk_index must be [tokens, k] i32, got {} {}",
               topk_index.shape_string(), dtype_name(topk_index.dtype));
  const int64_t T = topk_index.size(0), K = topk_index.size(1), P = group_.size();
  const Device device = topk_index.device;
  const Tensor owner = owner_on(device);
  route.counts = Buffer(DType::i32, device, {2 * P + 1});
  const Tensor counts = route.counts.view();
  Buffer member_index(DType::i32, device, {T, P});
  expert_send_members(member_index, counts.rows(P + 1, 2 * P + 1), topk_index, owner);
  route.send_row = Buffer(DType::i32, device, {T, P});
  dispatch_plan(counts.rows(0, P + 1), route.send_row, member_index);
  route.send_slots = Buffer(DType::i32, device, {T * P, K});
  expert_send_slots(route.send_slots, topk_index, owner, route.send_row, local_experts_);
  host_.arrived = copy_to_host_async(host_.counts.tensor(DType::i32, {2 * P + 1}, device), counts);
  host_.planned = &route;
}

ExpertParallel::Exchange ExpertParallel::start_dispatch(ExpertRoute& route, Tensor x, Tensor topk_index, Tensor topk_weight) const {
  const char* op = "ExpertParallel::start_dispatch";
  MARROW_CHECK(x.ndim == 2 && topk_index.ndim == 2, "{}: x must be [tokens, hidden] and topk_index [tokens, k], got {} and {}", op,
               x.shape_string(), topk_index.shape_string());
  const int64_t T = x.size(0), H = x.size(1), K = topk_index.size(1), P = group_.size();
  expect_shape(op, "topk_index", topk_index, {T, K});
  expect_shape(op, "topk_weight", topk_weight, {T, K});
  if (host_.planned != &route) plan_sends(route, topk_index);
  host_.planned = nullptr;
  host_.arrived.wait();  // the GPU's queue after the plan may still run
  trade_counts(route);
  route.unit_weight = like(topk_weight, {T, P});
  fill_constant(route.unit_weight, 1.0);
  Exchange e{like(x, {route.sent, H}), like(topk_weight, {route.sent, K}), like(x, {route.received, H}), like(topk_weight, {route.received, K}), {}};
  route.recv_slots = Buffer(DType::i32, x.device, {route.received, K});
  marrow::dispatch_forward(e.sent, x, route.send_row);
  marrow::dispatch_forward(e.sent_weights, topk_weight, route.send_row);
  group_.all_to_all_v(e.received, route.recv_rows, e.sent, route.send_rows, "expert-parallel dispatch of hidden states (all_to_all_v)", false);
  group_.all_to_all_v(e.received_weights, route.recv_rows, e.sent_weights, route.send_rows,
                      "expert-parallel dispatch of routing weights (all_to_all_v)", false);
  group_.all_to_all_v(route.recv_slots, route.recv_rows, route.send_slots.view().rows(0, route.sent), route.send_rows,
                      "expert-parallel expert slots (all_to_all_v)", false);
  e.done = group_.queued();
  traffic_.plan_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - host_.counts_read).count();
  return e;
}

void ExpertParallel::trade_counts(ExpertRoute& route) const {
  const int64_t P = group_.size();
  host_.counts_read = std::chrono::steady_clock::now();
  const int32_t* counts = host_.counts.tensor(DType::i32, {2 * P + 1}, route.counts.view().device).ptr<int32_t>();
  // Rows and token copies to each member, as one integer each way: rows << 32 | copies.
  std::vector<int64_t> packed(static_cast<size_t>(P));
  route.send_rows.assign(size_t(P), 0);
  route.remote_copies = 0;
  for (int64_t d = 0; d < P; ++d) {
    route.send_rows[size_t(d)] = counts[d + 1] - counts[d];
    packed[size_t(d)] = route.send_rows[size_t(d)] << 32 | int64_t(counts[P + 1 + d]);
    if (d != group_.rank()) route.remote_copies += counts[P + 1 + d];
  }
  const auto exchange_start = std::chrono::steady_clock::now();
  const std::vector<int64_t> received = group_.exchange_counts(packed, "expert-parallel row and copy counts (exchange_counts)");
  traffic_.exchange_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - exchange_start).count();
  route.recv_rows.assign(size_t(P), 0);
  route.copies = 0;
  for (int64_t d = 0; d < P; ++d) {
    route.recv_rows[size_t(d)] = received[size_t(d)] >> 32;
    route.copies += received[size_t(d)] & 0xffffffff;
  }
  route.sent = std::accumulate(route.send_rows.begin(), route.send_rows.end(), int64_t(0));
  route.received = std::accumulate(route.recv_rows.begin(), route.recv_rows.end(), int64_t(0));
  route.remote_rows = route.sent - route.send_rows[size_t(group_.rank())];
  traffic_.remote_rows += route.remote_rows;
  traffic_.remote_copies += route.remote_copies;
  ++traffic_.dispatches;
}

Buffer ExpertParallel::finish_dispatch(Exchange& e, ExpertRoute& route) const {
  group_.wait_for(e.done);
  const Device device = e.received.view().device;
  route.send_slots = Buffer{};
  route.expert_offsets = Buffer(DType::i32, device, {local_experts_ + 1});
  route.copy_row = Buffer(DType::i32, device, {route.received, route.recv_slots.view().size(1)});
  dispatch_plan(route.expert_offsets, route.copy_row, route.recv_slots);
  route.recv_slots = Buffer{};
  if (device == Device::cpu)
    MARROW_CHECK(route.expert_offsets.ptr<int32_t>()[local_experts_] == route.copies,
                 "expert-parallel dispatch: {} expert copies arrived, the senders counted {}", route.expert_offsets.ptr<int32_t>()[local_experts_],
                 route.copies);
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
