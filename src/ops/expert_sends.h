// The sender's half of the expert-parallel plan (parallel/expert_parallel.h), computed where the
// routing is, so that only 2P + 1 counts travel to the host. Member d of P holds the experts e with
// owner[e] = d, as local expert e - d * local_experts.
//   expert_send_members: member_index[t, d] = d if any of token t's K experts lives on member d,
//     else -1 (dispatch_plan over it gives each token's row in the block sent to each member,
//     grouped by member, in token order); copies[d] = how many of the T x K copies go to member d.
//   expert_send_slots: for each sent row, its K slots as the receiver's local experts: row
//     send_row[t, owner[e]] gets slot j = e - owner[e] * local_experts for e = topk_index[t, j], and
//     -1 in the slots whose expert lives on another member. Rows that no token sends are -1.
// Integers only, each a pure function of topk_index: the same on every run, CPU and GPU alike (the
// GPU's counts add integers, in any order). topk_index entries must be experts in [0, E); the CPU
// checks them, the GPU takes them from the router.
#pragma once
#include "core/tensor.h"

namespace marrow {

// member_index [T, P], copies [P], all i32; topk_index [T, K] i32, owner [E] i32. P <= 64.
void expert_send_members(Tensor member_index, Tensor copies, Tensor topk_index, Tensor owner, Stream stream = {});

// send_slots [rows, K] i32, overwritten (rows: at least the rows send_row names, e.g. T x P);
// send_row [T, P] i32 from dispatch_plan over member_index.
void expert_send_slots(Tensor send_slots, Tensor topk_index, Tensor owner, Tensor send_row, int64_t local_experts, Stream stream = {});

}  // namespace marrow
