// Expert parallelism (DESIGN.md §5): stages 2 (dispatch) and 4 (combine) of a layer whose E experts
// are spread over the P members of an expert-parallel group, member d holding experts
// [d * E / P, (d + 1) * E / P). Every member routes its own tokens.
//
// Both directions are deduplicated:
// - dispatch sends token t to member d once if any of its K experts lives there (not once per
//   expert), with its K routing weights; the receiver expands the row to its local experts;
// - combine: the receiver sums its experts' weighted outputs per received row and sends back one
//   row per (token, member); the sender adds the rows of its token, in member order, to the residual.
// The backward mirrors both: the output gradient of token t goes once to each member that got t,
// and each member returns one input-gradient row per (token, member) plus the gradients of the
// routing weights it applied (zero for slots whose expert lives elsewhere), summed on the sender.
//
// All of it is the dispatch and combine ops (ops/dispatch.h, ops/combine.h) twice: once with the P
// members as the "slots" of a token (sender side), once with the local experts (receiver side),
// with -1 marking a slot that is not there; plus four all-to-alls per direction. The plan (who
// sends what where) is computed on the host from the routing, as the grouped GEMM needs the
// per-expert row counts there anyway: one wait per layer for the routing (its copy queued early by
// read_routing, so the GPU can run other work while the host waits and plans); the counts and the received
// rows' expert slots travel over MPI, the rows themselves over NCCL.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "core/memory.h"
#include "parallel/comm.h"

namespace marrow {

// One layer's routing over the group for one micro-batch: made by dispatch_forward, read by the
// other three, dropped with the micro-batch.
struct ExpertRoute {
  // Sender side, T tokens.
  Buffer send_row;     // [T, P] i32: the token's row in the block sent to member d, or -1
  Buffer unit_weight;  // [T, P] ones: the sender adds the members' rows unweighted
  std::vector<int64_t> send_rows, recv_rows;  // rows to and from each member
  // Receiver side, R rows received in member order.
  Buffer recv_weight;     // [R, K] the routing weights of the received rows
  Buffer copy_row;        // [R, K] i32: row of slot j among this member's expert copies, or -1
  Buffer expert_offsets;  // [local experts + 1] i32 on the host: the grouped GEMMs' row blocks
  int64_t sent = 0, received = 0, copies = 0;
  // Sent to other members: rows (deduplicated), and the token copies they stand for (what sending
  // one row per routed expert would move).
  int64_t remote_rows = 0, remote_copies = 0;
};

// Rows that left this member since the last reset, per direction of one all-to-all (dispatch and
// combine each move them twice: forward and backward), for the bench's traffic figures.
struct ExpertTraffic {
  int64_t remote_rows = 0, remote_copies = 0, dispatches = 0;
  // Host time of the plans from the moment the routing reached the host to the upload of the
  // plan, waiting for the peers' counts too: the GPU idles for it unless another micro-batch's
  // compute was queued before the plan (engine/step.h's forward_backward).
  double plan_ms = 0;
  double exchange_ms = 0;  // of which in the MPI exchanges (the peers' plans arriving)
  double upload_ms = 0;    // and in copying the plan to the GPU
};

class ExpertParallel {
 public:
  ExpertParallel(const Comm& group, int64_t num_experts);
  int64_t local_experts() const { return local_experts_; }
  int64_t first_local_expert() const { return int64_t(group_.rank()) * local_experts_; }
  const Comm& group() const { return group_; }
  // Totals over the dispatches since the last call, which resets them.
  ExpertTraffic take_traffic() const { return std::exchange(traffic_, {}); }

  // Each exchange in two halves, so that the compute stream is free between them (another
  // micro-batch's stage can run there while the all-to-all is in flight, engine/step.h): start_*
  // gathers the rows to send and queues the all-to-alls; finish_* makes the compute stream wait for
  // them and scatters what arrived. On the host the exchange is done when start_* returns.
  struct Exchange {
    Buffer sent, sent_weights, received, received_weights;  // alive until finish_*
    Comm::Point done;
  };

  // Queues the copy of a layer's routing (topk_index [T, K] i32) to the host, which the plan of
  // start_dispatch needs, and returns at once: called as soon as the router has been queued, it
  // lets a schedule queue another micro-batch's compute before start_dispatch waits for the
  // routing, so the GPU runs that compute while the host plans (engine/step.h).
  void read_routing(Tensor topk_index) const;
  // Stage 2 forward: from this member's x[T, H] and routing (topk_index [T, K] i32, topk_weight
  // [T, K]), plans the route (from read_routing's copy of topk_index, or reading it now);
  // finish_dispatch returns x_perm [copies, H], this member's expert inputs grouped by local
  // expert (route.expert_offsets).
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
  void plan(ExpertRoute& route, Tensor topk_index, Device device) const;
  // The plan's host arrays, kept from one plan to the next (see plan()). The three that travel
  // between host and GPU are page-locked, so neither copy waits for the GPU's queue; each is
  // rewritten only after the copy that used it has run (the next plan waits for a routing that
  // the GPU computes after the previous plan's uploads).
  struct HostPlan {
    PinnedHost topk_index, send_row, copy_row;
    std::vector<int32_t> send_slots, recv_slots;
    const void* routing = nullptr;  // the topk_index read_routing copied last, and when it arrives
    StreamMark routing_arrived;
  };
  Comm group_;
  int64_t num_experts_, local_experts_;
  std::vector<int32_t> owner_;  // the member holding each expert
  mutable ExpertTraffic traffic_;
  mutable HostPlan host_;
};

}  // namespace marrow
