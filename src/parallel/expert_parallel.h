// Expert parallelism (DESIGN.md §5): stages 2 (dispatch) and 4 (combine) of a layer whose E experts
// are spread over the P members of an expert-parallel group, member d holding experts
// [d * E / P, (d + 1) * E / P). Every member routes its own tokens.
//
// Both directions are deduplicated: dispatch sends token t once to each member holding any of its
// K experts, with its K routing weights, and the receiver expands the row to its local experts;
// combine sums a received row's weighted expert outputs and sends one row back per (token, member),
// which the sender adds to the residual in member order. The backward mirrors both, each member
// also returning the gradients of the routing weights it applied.
// All of it is the dispatch and combine ops twice (the P members as a token's "slots" on the sender,
// the local experts on the receiver, -1 marking a slot not there) plus the all-to-alls. The plan is
// computed on the device where the routing is (ops/expert_sends.h); only the 2P + 1 counts travel
// to the host, which needs them to size the buffers and all-to-alls (one wait per layer, the GPU
// free meanwhile), and go to the other members over MPI.
// An exchange started (start_*) must be finished by the same pass before its buffers are reused:
// its Exchange owns the send and receive buffers until finish_*, since the comm stream may still
// read them.
#pragma once
#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/memory.h"
#include "parallel/comm.h"

namespace marrow {

// One layer's routing over the group for one micro-batch (plan_sends and start_dispatch make it).
struct ExpertRoute {
  // Sender side, T tokens.
  Buffer send_row;     // [T, P] i32: the token's row in the block sent to member d, or -1
  Buffer send_slots;   // [T x P, K] i32: the sent rows' slots as local experts of their member (ops/expert_sends.h)
  Buffer counts;       // [2P + 1] i32: the blocks' first rows (P + 1), then the token copies sent to each member (P)
  Buffer unit_weight;  // [T, P] ones: the sender adds the members' rows unweighted
  std::vector<int64_t> send_rows, recv_rows;  // rows to and from each member
  // Receiver side, R rows received in member order.
  Buffer recv_slots;      // [R, K] i32: their slots as this member's local experts, or -1 (until finish_dispatch)
  Buffer recv_weight;     // [R, K] the routing weights of the received rows
  Buffer copy_row;        // [R, K] i32: row of slot j among this member's expert copies, or -1
  Buffer expert_offsets;  // [local experts + 1] i32, where the data is: the grouped GEMMs' row blocks
  int64_t sent = 0, received = 0, copies = 0;
  // Sent to other members: rows (deduplicated), and the token copies they stand for.
  int64_t remote_rows = 0, remote_copies = 0;
};

// Rows that left this member since the last reset, per all-to-all, for the bench's traffic figures.
struct ExpertTraffic {
  int64_t remote_rows = 0, remote_copies = 0, dispatches = 0;
  // Host time of the plans from the counts on the host to the all-to-alls queued (the GPU idles
  // unless another micro-batch's compute was queued before).
  double plan_ms = 0;
  double exchange_ms = 0;  // of which in the MPI exchange (the peers' counts arriving)
};

class ExpertParallel {
 public:
  ExpertParallel(const Comm& group, int64_t num_experts);
  int64_t local_experts() const { return local_experts_; }
  int64_t first_local_expert() const { return int64_t(group_.rank()) * local_experts_; }
  const Comm& group() const { return group_; }
  // Totals over the dispatches since the last call, which resets them.
  ExpertTraffic take_traffic() const { return std::exchange(traffic_, {}); }

  // Each exchange in two halves, so another micro-batch's stage can run between them: start_*
  // gathers the rows and queues the all-to-alls, finish_* waits for them and scatters what arrived
  // (on the host, start_* completes the exchange).
  struct Exchange {
    Buffer sent, sent_weights, received, received_weights;  // alive until finish_*
    Comm::Point done;
  };

  // Queues the sender's plan of a layer's routing (topk_index [T, K] i32) and the copy of its
  // counts to the host, and returns at once, so a schedule can queue other compute before
  // start_dispatch waits for the counts.
  void plan_sends(ExpertRoute& route, Tensor topk_index) const;
  // Stage 2 forward: from this member's x[T, H] and routing (topk_index [T, K] i32, topk_weight
  // [T, K]), trades the counts with the other members (after plan_sends, or planning now) and
  // queues the all-to-alls; finish_dispatch returns x_perm [copies, H], this member's expert inputs
  // grouped by local expert (route.expert_offsets).
  Exchange start_dispatch(ExpertRoute& route, Tensor x, Tensor topk_index, Tensor topk_weight) const;
  Buffer finish_dispatch(Exchange& exchange, ExpertRoute& route) const;
  // Stage 4 forward: out[T, H] = residual + sum over members of the weighted expert outputs they
  // computed for each token; y_perm [copies, H] are this member's expert outputs. out may alias residual.
  Exchange start_combine(Tensor y_perm, const ExpertRoute& route) const;
  void finish_combine(Tensor out, Tensor residual, Exchange& exchange, const ExpertRoute& route) const;
  // Stage 4 backward from dout[T, H]: dy_perm [copies, H] (overwritten) for this member's experts;
  // returns the gradient of the received rows' routing weights [R, K] for the dispatch backward.
  Exchange start_combine_backward(Tensor dout, const ExpertRoute& route) const;
  Buffer finish_combine_backward(Tensor dy_perm, Tensor y_perm, Exchange& exchange, const ExpertRoute& route) const;
  // Stage 2 backward: dx[T, H] and dtopk_weight[T, K] (overwritten) from this member's expert
  // input gradients dx_perm [copies, H] and the combine backward's weight gradients.
  Exchange start_dispatch_backward(Tensor dx_perm, Buffer dweight_recv, const ExpertRoute& route) const;
  void finish_dispatch_backward(Tensor dx, Tensor dtopk_weight, Exchange& exchange, const ExpertRoute& route) const;

 private:
  // The counts' page-locked host copy, one for all routes: one plan at a time is between
  // plan_sends and start_dispatch.
  struct HostCounts {
    PinnedHost counts;
    const ExpertRoute* planned = nullptr;  // the route whose counts are on their way
    StreamMark arrived;
    std::chrono::steady_clock::time_point counts_read;  // when start_dispatch found them (ExpertTraffic::plan_ms)
  };
  // From the counts on the host: route's rows and copies each way, over the group's MPI exchange.
  void trade_counts(ExpertRoute& route) const;
  // owner_ where the routing is (the first plan's device), for the plan's kernels.
  Tensor owner_on(Device device) const;
  Comm group_;
  int64_t num_experts_, local_experts_;
  std::vector<int32_t> owner_;  // the member holding each expert
  mutable Buffer owner_device_;
  mutable ExpertTraffic traffic_;
  mutable HostCounts host_;
};

}  // namespace marrow
