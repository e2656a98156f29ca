#include "ops/expert_sends.h"

#include <algorithm>
#include <cstdint>

#include "core/cuda_check.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

constexpr int64_t kMaxMembers = 64;  // a token's members as the bits of one 64-bit mask on the GPU

void members_cpu(int32_t* member_index, int32_t* copies, const int32_t* topk_index, const int32_t* owner, int64_t tokens, int64_t k,
                 int64_t members) {
  std::fill(copies, copies + members, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    int32_t* row = member_index + t * members;
    std::fill(row, row + members, -1);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t d = owner[topk_index[t * k + j]];
      row[d] = d;
      ++copies[d];
    }
  }
}

void slots_cpu(int32_t* send_slots, int64_t rows, const int32_t* topk_index, const int32_t* owner, const int32_t* send_row, int64_t tokens,
               int64_t k, int64_t members, int64_t local_experts) {
  std::fill(send_slots, send_slots + rows * k, -1);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = topk_index[t * k + j], d = owner[e];
      send_slots[int64_t(send_row[t * members + d]) * k + j] = int32_t(e - d * local_experts);
    }
}

// The shapes and dtypes both ops share: topk_index [T, K], owner [E], i32. Returns (T, K).
std::pair<int64_t, int64_t> check_routing(const char* op, const Tensor& topk_index, const Tensor& owner) {
  MARROW_CHECK(topk_index.ndim == 2 && owner.ndim == 1, "{}: topk_index must be [tokens, k] and owner [experts], got {} and {}", op,
               topk_index.shape_string(), owner.shape_string());
  expect_dtype(op, "topk_index", topk_index, DType::i32);
  expect_dtype(op, "owner", owner, DType::i32);
  return {topk_index.size(0), topk_index.size(1)};
}

// The CPU's checks of the indices (the GPU takes them from the router): experts in the owner table,
// owners among the P members.
void expect_routing_indices(const char* op, const Tensor& topk_index, const Tensor& owner, int64_t members) {
  expect_indices_below(op, "topk_index", topk_index, owner.size(0));
  expect_indices_below(op, "owner", owner, members);
}

#ifdef __CUDACC__
constexpr int kThreads = 256;

// One thread a token: its members as mask bits, its copies per member counted in shared memory
// first, then one integer add per member and block.
__global__ void members_kernel(int32_t* member_index, int32_t* copies, const int32_t* topk_index, const int32_t* owner, int64_t tokens, int k,
                               int members) {
  __shared__ int32_t block_copies[kMaxMembers];
  for (int d = int(threadIdx.x); d < members; d += kThreads) block_copies[d] = 0;
  __syncthreads();
  const int64_t t = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (t < tokens) {
    uint64_t mask = 0;
    for (int j = 0; j < k; ++j) {
      const int d = owner[topk_index[t * k + j]];
      mask |= uint64_t(1) << d;
      atomicAdd(&block_copies[d], 1);
    }
    for (int d = 0; d < members; ++d) member_index[t * members + d] = (mask >> d) & 1 ? d : -1;
  }
  __syncthreads();
  for (int d = int(threadIdx.x); d < members; d += kThreads)
    if (block_copies[d] > 0) atomicAdd(&copies[d], block_copies[d]);
}

// One thread a copy (t, j): its slot in the row sent to its expert's member (the rows were set to
// -1 before).
__global__ void slots_kernel(int32_t* send_slots, const int32_t* topk_index, const int32_t* owner, const int32_t* send_row, int64_t copies,
                             int k, int members, int64_t local_experts) {
  const int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (i >= copies) return;
  const int64_t t = i / k, j = i % k;
  const int32_t e = topk_index[i], d = owner[e];
  send_slots[int64_t(send_row[t * members + d]) * k + j] = int32_t(e - d * local_experts);
}

unsigned blocks_for(int64_t n) { return unsigned((n + kThreads - 1) / kThreads); }

void launch_members(Tensor member_index, Tensor copies, Tensor topk_index, Tensor owner, int64_t tokens, int64_t k, int64_t members,
                    Stream stream) {
  MARROW_CUDA_CHECK(cudaMemsetAsync(copies.data, 0, copies.bytes(), cuda_stream(stream)));
  if (tokens > 0)
    launch_plain(members_kernel, blocks_for(tokens), kThreads, 0, stream, member_index.ptr<int32_t>(), copies.ptr<int32_t>(),
                 topk_index.ptr<int32_t>(), owner.ptr<int32_t>(), tokens, int(k), int(members));
}

void launch_slots(Tensor send_slots, Tensor topk_index, Tensor owner, Tensor send_row, int64_t copies, int64_t k, int64_t members,
                  int64_t local_experts, Stream stream) {
  MARROW_CUDA_CHECK(cudaMemsetAsync(send_slots.data, 0xff, send_slots.bytes(), cuda_stream(stream)));  // every int32 -1
  if (copies > 0)
    launch_plain(slots_kernel, blocks_for(copies), kThreads, 0, stream, send_slots.ptr<int32_t>(), topk_index.ptr<int32_t>(), owner.ptr<int32_t>(),
                 send_row.ptr<int32_t>(), copies, int(k), int(members), local_experts);
}
#endif

}  // namespace

void expert_send_members(Tensor member_index, Tensor copies, Tensor topk_index, Tensor owner, Stream stream) {
  const char* op = "expert_send_members";
  const auto [T, K] = check_routing(op, topk_index, owner);
  MARROW_CHECK(copies.ndim == 1 && copies.size(0) >= 1 && copies.size(0) <= kMaxMembers, "{}: copies must be [members] with 1 to {} members, got {}",
               op, kMaxMembers, copies.shape_string());
  const int64_t P = copies.size(0);
  expect_shape(op, "member_index", member_index, {T, P});
  expect_dtype(op, "member_index", member_index, DType::i32);
  expect_dtype(op, "copies", copies, DType::i32);
  if (common_device(op, {{"member_index", &member_index}, {"copies", &copies}, {"topk_index", &topk_index}, {"owner", &owner}}) == Device::cuda)
    MARROW_GPU_RETURN(op, stream, launch_members(member_index, copies, topk_index, owner, T, K, P, stream));
  expect_routing_indices(op, topk_index, owner, P);
  members_cpu(member_index.ptr<int32_t>(), copies.ptr<int32_t>(), topk_index.ptr<int32_t>(), owner.ptr<int32_t>(), T, K, P);
}

void expert_send_slots(Tensor send_slots, Tensor topk_index, Tensor owner, Tensor send_row, int64_t local_experts, Stream stream) {
  const char* op = "expert_send_slots";
  const auto [T, K] = check_routing(op, topk_index, owner);
  MARROW_CHECK(send_row.ndim == 2 && send_row.size(0) == T, "{}: send_row must be [{}, members], got {}", op, T, send_row.shape_string());
  MARROW_CHECK(send_slots.ndim == 2 && send_slots.size(1) == K, "{}: send_slots must be [rows, {}], got {}", op, K, send_slots.shape_string());
  expect_dtype(op, "send_row", send_row, DType::i32);
  expect_dtype(op, "send_slots", send_slots, DType::i32);
  const int64_t P = send_row.size(1);
  if (common_device(op, {{"send_slots", &send_slots}, {"topk_index", &topk_index}, {"owner", &owner}, {"send_row", &send_row}}) == Device::cuda)
    MARROW_GPU_RETURN(op, stream, launch_slots(send_slots, topk_index, owner, send_row, T * K, K, P, local_experts, stream));
  expect_routing_indices(op, topk_index, owner, P);
  const int32_t* rows = send_row.ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const int32_t d = owner.ptr<int32_t>()[topk_index.ptr<int32_t>()[t * K + j]];
      MARROW_CHECK(0 <= rows[t * P + d] && rows[t * P + d] < send_slots.size(0), "{}: send_row[{}, {}] = {} is outside send_slots' {} rows", op,
                   t, d, rows[t * P + d], send_slots.size(0));
    }
  slots_cpu(send_slots.ptr<int32_t>(), send_slots.size(0), topk_index.ptr<int32_t>(), owner.ptr<int32_t>(), rows, T, K, P, local_experts);
}

}  // namespace marrow
