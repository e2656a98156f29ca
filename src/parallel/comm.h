// Process groups and their collectives: the one communication API of the parallel layer.
//
// A Comm is a group of processes (the job, or one axis of the mesh: mesh.h). Each collective takes
// Tensor views and picks NCCL for CUDA tensors, MPI for host tensors; a group of one needs neither.
// Invariants:
// - Host reductions sum in rank order (in double for f32), so numbers never depend on timing.
// - NCCL collectives run on the group's stream, after the work queued on the compute stream and
//   before what is queued there later: callers never synchronise by hand.
// - Every collective tells the watchdog (watchdog.h) it started and returned, so one that never
//   completes ends the job after parallel.timeout_s.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace marrow {

class Comm {
 public:
  Comm() = default;  // the group of this process alone
  int rank() const { return rank_; }
  int size() const { return size_; }
  // The rank in the job of this group's member `rank` (for messages).
  int world_rank_of(int rank) const { return members_.empty() ? rank : members_[size_t(rank)]; }

  // t = sum over the group of every member's t (f32 or f64; on the GPU also bf16). With join =
  // false the GPU work that follows overlaps the sum until join() (t untouched meanwhile).
  void all_reduce_sum(Tensor t, const char* what, bool join = true) const;
  // The compute stream waits for every collective queued on this group so far.
  void join() const;
  // out[size * n] = every member's in[n], in rank order. in may be out's own block
  // out[rank * n, (rank + 1) * n) (in place). join as for all_reduce_sum.
  void all_gather(Tensor out, Tensor in, const char* what, bool join = true) const;
  // out[n] = sum over members of their in[rank * n, (rank + 1) * n); with accumulate, out += that
  // sum instead, and in's own block is overwritten on the way. join as for all_reduce_sum.
  void reduce_scatter_sum(Tensor out, Tensor in, const char* what, bool accumulate = false, bool join = true) const;
  // A point in this group's queue of collectives: wait_for(point) makes the compute stream wait
  // for those queued before it (host collectives are done on return: empty points).
  struct Point {
    std::shared_ptr<void> event;
  };
  Point queued() const;
  void wait_for(const Point& point) const;
  // Rows (the first dimension) in blocks by member: send_rows[d] go to member d, recv_rows[s] come
  // from member s, both sides agreeing on the counts (exchange_counts). join as for all_reduce_sum.
  void all_to_all_v(Tensor recv, const std::vector<int64_t>& recv_rows, Tensor send, const std::vector<int64_t>& send_rows,
                    const char* what, bool join = true) const;
  // Host integers: sent[d] goes to member d; returns what each member sent to this one.
  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& sent, const char* what) const;
  // Host doubles summed over the group in rank order (losses, squared norms).
  std::vector<double> sum(std::vector<double> values, const char* what) const;
  double sum(double value, const char* what) const { return sum(std::vector<double>{value}, what)[0]; }
  // Every member's text, in rank order.
  std::vector<std::string> all_gather_text(const std::string& text, const char* what) const;
  // Sends `send` to member dst and receives `recv` from member src as one exchange (a ring cannot
  // deadlock); an empty tensor skips that half. join as for all_reduce_sum.
  void send_recv(Tensor send, int dst, Tensor recv, int src, const char* what, bool join = true) const;
  // A pipeline link: send() queues t for member dst and returns (t alive and unchanged until
  // wait_sends()); recv() fills t from src before the compute stream goes on. Messages arrive in
  // the order sent: give each kind its own group, so a receiver never waits behind another kind.
  void send(Tensor t, int dst, const char* what) const;
  void recv(Tensor t, int src, const char* what) const;
  void wait_sends() const;
  void barrier(const char* what) const;

  // The subgroup of members with the same color, ordered by key (every member calls it).
  Comm split(int color, int key) const;
  // The whole job (MPI_COMM_WORLD under mpirun/srun, else a group of one); with device = cuda every
  // group split from it has an NCCL communicator too.
  static Comm world(Device device);

  struct Handles;  // MPI and NCCL communicators, the communication stream (comm.cpp)

 private:
  std::shared_ptr<Handles> handles_;
  int rank_ = 0, size_ = 1;
  std::vector<int> members_;  // world rank of each member
};

// The first asynchronous error any NCCL communicator reports, or "" (the watchdog polls it).
std::string nccl_async_error();

}  // namespace marrow
