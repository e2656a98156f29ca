#include "parallel/comm.h"

#include <mpi.h>

#include <algorithm>
#include <exception>
#include <mutex>
#include <numeric>

#include "core/memory.h"
#include "ops/add.h"
#include "parallel/process.h"
#include "parallel/watchdog.h"

#if MARROW_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include "core/cuda_check.h"

#define MARROW_NCCL_CHECK(call) MARROW_CHECK_RESULT(call, #call, ::marrow::nccl_failed, ncclGetErrorString)
#endif
#define MARROW_MPI_CHECK(call) MARROW_CHECK_RESULT(call, #call, ::marrow::mpi_failed, ::marrow::mpi_message)

namespace marrow {
namespace {

#if MARROW_CUDA
bool nccl_failed(ncclResult_t r) { return r != ncclSuccess; }
#endif
bool mpi_failed(int code) { return code != MPI_SUCCESS; }
std::string mpi_message(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return text;
}

}  // namespace

struct Comm::Handles {
  MPI_Comm mpi = MPI_COMM_NULL;
  std::vector<MPI_Request> sends;  // host send()s not yet waited for
#if MARROW_CUDA
  ncclComm_t nccl = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t before = nullptr, after = nullptr;
#endif
  ~Handles();
};

namespace {

// While a collective runs, the watchdog knows what the process waits for.
struct InFlight {
  explicit InFlight(const char* what) { watchdog::progress(what); }
  ~InFlight() { watchdog::progress("computing"); }
};

#if MARROW_CUDA
std::mutex g_nccl_mutex;
std::vector<ncclComm_t> g_nccl_comms;  // polled by nccl_async_error()

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::fp8_e4m3: return ncclUint8;
    case DType::u16: break;  // NCCL has no 16-bit integer; the master's low halves never travel
    case DType::u8: return ncclUint8;
  }
  fail("internal: NCCL has no type for {}", dtype_name(dtype));
  return ncclUint8;
}

void join_comm_stream(const Comm::Handles& h) {
  MARROW_CUDA_CHECK(cudaEventRecord(h.after, h.stream));
  MARROW_CUDA_CHECK(cudaStreamWaitEvent(nullptr, h.after, 0));
}

// NCCL work runs on the group's stream, after what the compute stream has queued and (join) before
// what it queues next.
template <typename Work> void on_comm_stream(const Comm::Handles& h, Work work, bool join = true) {
  MARROW_CUDA_CHECK(cudaEventRecord(h.before, nullptr));
  MARROW_CUDA_CHECK(cudaStreamWaitEvent(h.stream, h.before, 0));
  work(h.stream);
  if (join) join_comm_stream(h);
}
#endif

// Host sums: f32 tensors are summed in double in rank order, then rounded once.
template <typename T> void sum_in_rank_order(T* out, const char* parts, int64_t n, int ranks, size_t part_stride) {
  for (int64_t i = 0; i < n; ++i) {
    double s = 0;
    for (int r = 0; r < ranks; ++r) s += double(reinterpret_cast<const T*>(parts + size_t(r) * part_stride)[i]);
    out[i] = T(s);
  }
}

void sum_parts(Tensor out, const char* parts, int ranks, size_t part_stride, const char* what) {
  if (out.dtype == DType::f32) return sum_in_rank_order(out.ptr<float>(), parts, out.numel(), ranks, part_stride);
  if (out.dtype == DType::f64) return sum_in_rank_order(out.ptr<double>(), parts, out.numel(), ranks, part_stride);
  fail("{}: host reductions take f32 or f64 tensors, got {}", what, dtype_name(out.dtype));
}

int mpi_count(size_t bytes, const char* what) {
  MARROW_CHECK(bytes <= size_t(std::numeric_limits<int>::max()), "{}: {} bytes exceed one MPI message", what, bytes);
  return int(bytes);
}

void check_device(const Tensor& a, const Tensor& b, const char* what) {
  MARROW_CHECK(a.device == b.device, "{}: tensors on {} and {}", what, device_name(a.device), device_name(b.device));
}

}  // namespace

Comm::Handles::~Handles() {
  // Unwinding towards an aborted job: freeing communicators could wait for peers that never come.
  if (std::uncaught_exceptions() > 0) return;
#if MARROW_CUDA
  if (nccl) {
    {
      std::lock_guard lock(g_nccl_mutex);
      g_nccl_comms.erase(std::remove(g_nccl_comms.begin(), g_nccl_comms.end(), nccl), g_nccl_comms.end());
    }
    // cleanup: statuses ignored (a destructor, which may run while an error unwinds)
    ncclCommDestroy(nccl);
    cudaEventDestroy(before);
    cudaEventDestroy(after);
    cudaStreamDestroy(stream);
  }
#endif
  if (mpi != MPI_COMM_NULL && process::launched()) MPI_Comm_free(&mpi);
}

std::string nccl_async_error() {
#if MARROW_CUDA
  std::lock_guard lock(g_nccl_mutex);
  for (ncclComm_t c : g_nccl_comms) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t queried = ncclCommGetAsyncError(c, &state);
    if (queried != ncclSuccess) return fmt::format("NCCL could not report a communicator's state: {}", ncclGetErrorString(queried));
    if (state != ncclSuccess && state != ncclInProgress) return fmt::format("NCCL reported an asynchronous error: {}", ncclGetErrorString(state));
  }
#endif
  return "";
}

Comm Comm::world(Device device) {
  Comm c;
  if (!process::launched()) return c;
  c.handles_ = std::make_shared<Handles>();
  MARROW_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &c.handles_->mpi));
  c.rank_ = process::rank();
  c.size_ = process::size();
  c.members_.resize(size_t(c.size_));
  std::iota(c.members_.begin(), c.members_.end(), 0);
  if (device == Device::cuda && c.size_ > 1) {
#if MARROW_CUDA
    ncclUniqueId id;
    if (c.rank_ == 0) MARROW_NCCL_CHECK(ncclGetUniqueId(&id));
    MARROW_MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, c.handles_->mpi));
    Handles& h = *c.handles_;
    MARROW_NCCL_CHECK(ncclCommInitRank(&h.nccl, c.size_, id, c.rank_));
    MARROW_CUDA_CHECK(cudaStreamCreateWithFlags(&h.stream, cudaStreamNonBlocking));
    MARROW_CUDA_CHECK(cudaEventCreateWithFlags(&h.before, cudaEventDisableTiming));
    MARROW_CUDA_CHECK(cudaEventCreateWithFlags(&h.after, cudaEventDisableTiming));
    std::lock_guard lock(g_nccl_mutex);
    g_nccl_comms.push_back(h.nccl);
#else
    fail("this build of marrow has no CUDA support (configure with -DMARROW_CUDA=ON)");
#endif
  }
  return c;
}

Comm Comm::split(int color, int key) const {
  if (size_ == 1) return *this;
  Comm c;
  c.handles_ = std::make_shared<Handles>();
  InFlight scope("split of a process group");
  MARROW_MPI_CHECK(MPI_Comm_split(handles_->mpi, color, key, &c.handles_->mpi));
  MARROW_MPI_CHECK(MPI_Comm_rank(c.handles_->mpi, &c.rank_));
  MARROW_MPI_CHECK(MPI_Comm_size(c.handles_->mpi, &c.size_));
  const int me = world_rank_of(rank_);
  c.members_.resize(size_t(c.size_));
  MARROW_MPI_CHECK(MPI_Allgather(&me, 1, MPI_INT, c.members_.data(), 1, MPI_INT, c.handles_->mpi));
#if MARROW_CUDA
  if (handles_->nccl && c.size_ > 1) {
    Handles& h = *c.handles_;
    MARROW_NCCL_CHECK(ncclCommSplit(handles_->nccl, color, key, &h.nccl, nullptr));
    MARROW_CUDA_CHECK(cudaStreamCreateWithFlags(&h.stream, cudaStreamNonBlocking));
    MARROW_CUDA_CHECK(cudaEventCreateWithFlags(&h.before, cudaEventDisableTiming));
    MARROW_CUDA_CHECK(cudaEventCreateWithFlags(&h.after, cudaEventDisableTiming));
    std::lock_guard lock(g_nccl_mutex);
    g_nccl_comms.push_back(h.nccl);
  }
#endif
  return c;
}

void Comm::join() const {
#if MARROW_CUDA
  if (handles_ && handles_->nccl) join_comm_stream(*handles_);
#endif
}

void Comm::all_reduce_sum(Tensor t, const char* what, [[maybe_unused]] bool join) const {
  if (size_ == 1 || t.numel() == 0) return;
  InFlight scope(what);
  if (t.device == Device::cuda) {
#if MARROW_CUDA
    on_comm_stream(*handles_, [&](cudaStream_t s) {
      MARROW_NCCL_CHECK(ncclAllReduce(t.data, t.data, size_t(t.numel()), nccl_type(t.dtype), ncclSum, handles_->nccl, s));
    }, join);
    return;
#endif
  }
  // Each rank sums one chunk of every rank's tensor in rank order, then every rank gathers the chunks.
  const int64_t n = t.numel(), chunk = (n + size_ - 1) / size_;
  const size_t elem = dtype_size(t.dtype);
  std::vector<int> counts(static_cast<size_t>(size_)), offsets(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) {
    const int64_t begin = std::min(n, r * chunk), end = std::min(n, begin + chunk);
    counts[size_t(r)] = mpi_count(size_t(end - begin) * elem, what);
    offsets[size_t(r)] = mpi_count(size_t(begin) * elem, what);
  }
  const int mine = counts[size_t(rank_)];
  std::vector<char> parts(size_t(mine) * size_t(size_));
  std::vector<int> part_counts(size_t(size_), mine), part_offsets(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) part_offsets[size_t(r)] = r * mine;
  MARROW_MPI_CHECK(MPI_Alltoallv(t.data, counts.data(), offsets.data(), MPI_BYTE, parts.data(), part_counts.data(),
                                 part_offsets.data(), MPI_BYTE, handles_->mpi));
  std::vector<char> summed(static_cast<size_t>(mine));
  Tensor out(summed.data(), t.dtype, Device::cpu, {int64_t(mine / int(elem))});
  sum_parts(out, parts.data(), size_, size_t(mine), what);
  MARROW_MPI_CHECK(MPI_Allgatherv(summed.data(), mine, MPI_BYTE, t.data, counts.data(), offsets.data(), MPI_BYTE, handles_->mpi));
}

void Comm::all_gather(Tensor out, Tensor in, const char* what, [[maybe_unused]] bool join) const {
  check_device(out, in, what);
  MARROW_CHECK(out.numel() == in.numel() * size_ && out.dtype == in.dtype, "{}: all_gather of {} {} into {} {} over {} ranks", what,
               in.shape_string(), dtype_name(in.dtype), out.shape_string(), dtype_name(out.dtype), size_);
  const size_t block = in.bytes();
  const bool in_place = in.data == static_cast<char*>(out.data) + size_t(rank_) * block;
  if (size_ == 1) return in_place ? void() : copy(out, in);
  InFlight scope(what);
  if (in.device == Device::cuda) {
#if MARROW_CUDA
    on_comm_stream(*handles_, [&](cudaStream_t s) {
      MARROW_NCCL_CHECK(ncclAllGather(in.data, out.data, size_t(in.numel()), nccl_type(in.dtype), handles_->nccl, s));
    }, join);
    return;
#endif
  }
  const int bytes = mpi_count(block, what);
  MARROW_MPI_CHECK(MPI_Allgather(in_place ? MPI_IN_PLACE : in.data, bytes, MPI_BYTE, out.data, bytes, MPI_BYTE, handles_->mpi));
}

void Comm::reduce_scatter_sum(Tensor out, Tensor in, const char* what, bool accumulate, [[maybe_unused]] bool join) const {
  check_device(out, in, what);
  MARROW_CHECK(in.numel() == out.numel() * size_ && out.dtype == in.dtype, "{}: reduce_scatter of {} {} into {} {} over {} ranks", what,
               in.shape_string(), dtype_name(in.dtype), out.shape_string(), dtype_name(out.dtype), size_);
  const Tensor own = in.reshape({in.numel()}).rows(out.numel() * rank_, out.numel() * (rank_ + 1));
  if (size_ == 1) return accumulate ? add(out, out, own) : copy(out, own);
  InFlight scope(what);
  if (in.device == Device::cuda) {
#if MARROW_CUDA
    on_comm_stream(*handles_, [&](cudaStream_t s) {
      // Accumulating: the sum lands in in's own block (NCCL's in-place form), then adds into out
      // on the same stream, so the compute stream never waits for it.
      MARROW_NCCL_CHECK(ncclReduceScatter(in.data, accumulate ? own.data : out.data, size_t(out.numel()), nccl_type(in.dtype), ncclSum,
                                          handles_->nccl, s));
      if (accumulate) add(out, out, own, Stream{s});
    }, join);
    return;
#endif
  }
  const int bytes = mpi_count(out.bytes(), what);
  std::vector<char> parts(size_t(bytes) * size_t(size_));
  MARROW_MPI_CHECK(MPI_Alltoall(in.data, bytes, MPI_BYTE, parts.data(), bytes, MPI_BYTE, handles_->mpi));
  if (!accumulate) return sum_parts(out, parts.data(), size_, size_t(bytes), what);
  sum_parts(own, parts.data(), size_, size_t(bytes), what);
  add(out, out, own);
}

Comm::Point Comm::queued() const {
#if MARROW_CUDA
  if (handles_ && handles_->nccl) {
    cudaEvent_t event = nullptr;
    MARROW_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    Point point{std::shared_ptr<void>(event, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); })};
    MARROW_CUDA_CHECK(cudaEventRecord(event, handles_->stream));
    return point;
  }
#endif
  return {};
}

void Comm::wait_for([[maybe_unused]] const Point& point) const {
#if MARROW_CUDA
  if (point.event) MARROW_CUDA_CHECK(cudaStreamWaitEvent(nullptr, static_cast<cudaEvent_t>(point.event.get()), 0));
#endif
}

void Comm::all_to_all_v(Tensor recv, const std::vector<int64_t>& recv_rows, Tensor send, const std::vector<int64_t>& send_rows,
                        const char* what, [[maybe_unused]] bool join) const {
  check_device(recv, send, what);
  MARROW_CHECK(recv.dtype == send.dtype, "{}: all_to_all_v of {} into {}", what, dtype_name(send.dtype), dtype_name(recv.dtype));
  MARROW_CHECK(int(recv_rows.size()) == size_ && int(send_rows.size()) == size_, "{}: {} receive and {} send counts for {} ranks", what,
               recv_rows.size(), send_rows.size(), size_);
  std::vector<int64_t> send_at(size_t(size_) + 1, 0), recv_at(size_t(size_) + 1, 0);  // each member's first row
  for (size_t p = 0; p < size_t(size_); ++p) {
    send_at[p + 1] = send_at[p] + send_rows[p];
    recv_at[p + 1] = recv_at[p] + recv_rows[p];
  }
  const int64_t recv_total = recv_at.back(), send_total = send_at.back();
  MARROW_CHECK(recv.ndim >= 1 && send.ndim >= 1 && recv.size(0) == recv_total && send.size(0) == send_total,
               "{}: all_to_all_v sends {} rows from {} and receives {} rows into {}", what, send_total, send.shape_string(), recv_total,
               recv.shape_string());
  const size_t row_bytes = send.size(0) > 0 ? send.bytes() / size_t(send.size(0)) : recv.size(0) > 0 ? recv.bytes() / size_t(recv.size(0)) : 0;
  if (size_ == 1) return recv_total > 0 ? copy(recv, send) : void();
  InFlight scope(what);
  if (send.device == Device::cuda) {
#if MARROW_CUDA
    const size_t row_elems = row_bytes / dtype_size(send.dtype);
    on_comm_stream(*handles_, [&](cudaStream_t s) {
      MARROW_NCCL_CHECK(ncclGroupStart());
      for (int peer = 0; peer < size_; ++peer) {
        const size_t p = size_t(peer);
        const auto* src = static_cast<const char*>(send.data) + size_t(send_at[p]) * row_bytes;
        auto* dst = static_cast<char*>(recv.data) + size_t(recv_at[p]) * row_bytes;
        if (send_rows[p] > 0) MARROW_NCCL_CHECK(ncclSend(src, size_t(send_rows[p]) * row_elems, nccl_type(send.dtype), peer, handles_->nccl, s));
        if (recv_rows[p] > 0) MARROW_NCCL_CHECK(ncclRecv(dst, size_t(recv_rows[p]) * row_elems, nccl_type(send.dtype), peer, handles_->nccl, s));
      }
      MARROW_NCCL_CHECK(ncclGroupEnd());
    }, join);
    return;
#endif
  }
  std::vector<int> sc(static_cast<size_t>(size_)), so(static_cast<size_t>(size_)), rc(static_cast<size_t>(size_)), ro(static_cast<size_t>(size_));
  for (size_t p = 0; p < size_t(size_); ++p) {
    sc[p] = mpi_count(size_t(send_rows[p]) * row_bytes, what);
    so[p] = mpi_count(size_t(send_at[p]) * row_bytes, what);
    rc[p] = mpi_count(size_t(recv_rows[p]) * row_bytes, what);
    ro[p] = mpi_count(size_t(recv_at[p]) * row_bytes, what);
  }
  MARROW_MPI_CHECK(MPI_Alltoallv(send.data, sc.data(), so.data(), MPI_BYTE, recv.data, rc.data(), ro.data(), MPI_BYTE, handles_->mpi));
}

std::vector<int64_t> Comm::exchange_counts(const std::vector<int64_t>& sent, const char* what) const {
  MARROW_CHECK(int(sent.size()) == size_, "{}: {} counts for {} ranks", what, sent.size(), size_);
  if (size_ == 1) return sent;
  InFlight scope(what);
  std::vector<int64_t> received(static_cast<size_t>(size_));
  MARROW_MPI_CHECK(MPI_Alltoall(sent.data(), 1, MPI_INT64_T, received.data(), 1, MPI_INT64_T, handles_->mpi));
  return received;
}

std::vector<double> Comm::sum(std::vector<double> values, const char* what) const {
  if (size_ == 1) return values;
  InFlight scope(what);
  const int n = int(values.size());
  std::vector<double> all(values.size() * size_t(size_));
  MARROW_MPI_CHECK(MPI_Allgather(values.data(), n, MPI_DOUBLE, all.data(), n, MPI_DOUBLE, handles_->mpi));
  for (int i = 0; i < n; ++i) {
    double s = 0;
    for (int r = 0; r < size_; ++r) s += all[size_t(r) * size_t(n) + size_t(i)];
    values[size_t(i)] = s;
  }
  return values;
}

std::vector<std::string> Comm::all_gather_text(const std::string& text, const char* what) const {
  if (size_ == 1) return {text};
  InFlight scope(what);
  const int length = mpi_count(text.size(), what);
  std::vector<int> lengths(static_cast<size_t>(size_)), offsets(size_t(size_), 0);
  MARROW_MPI_CHECK(MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, handles_->mpi));
  for (size_t r = 1; r < size_t(size_); ++r) offsets[r] = offsets[r - 1] + lengths[r - 1];
  std::string all(size_t(offsets.back() + lengths.back()), '\0');
  MARROW_MPI_CHECK(MPI_Allgatherv(text.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(), MPI_CHAR, handles_->mpi));
  std::vector<std::string> texts;
  for (size_t r = 0; r < size_t(size_); ++r) texts.push_back(all.substr(size_t(offsets[r]), size_t(lengths[r])));
  return texts;
}

void Comm::send_recv(Tensor send, int dst, Tensor recv, int src, const char* what, [[maybe_unused]] bool join) const {
  const bool sending = send.data != nullptr && send.numel() > 0, receiving = recv.data != nullptr && recv.numel() > 0;
  MARROW_CHECK(!sending || (dst >= 0 && dst < size_ && dst != rank_), "{}: no rank {} to send to in a group of {}", what, dst, size_);
  MARROW_CHECK(!receiving || (src >= 0 && src < size_ && src != rank_), "{}: no rank {} to receive from in a group of {}", what, src, size_);
  if (sending && receiving) check_device(send, recv, what);
  if (!sending && !receiving) return;
  InFlight scope(what);
  if ((sending ? send : recv).device == Device::cuda) {
#if MARROW_CUDA
    on_comm_stream(*handles_, [&](cudaStream_t s) {
      MARROW_NCCL_CHECK(ncclGroupStart());
      if (sending) MARROW_NCCL_CHECK(ncclSend(send.data, size_t(send.numel()), nccl_type(send.dtype), dst, handles_->nccl, s));
      if (receiving) MARROW_NCCL_CHECK(ncclRecv(recv.data, size_t(recv.numel()), nccl_type(recv.dtype), src, handles_->nccl, s));
      MARROW_NCCL_CHECK(ncclGroupEnd());
    }, join);
    return;
#endif
  }
  MPI_Request requests[2];
  int pending = 0;
  if (receiving)
    MARROW_MPI_CHECK(MPI_Irecv(recv.data, mpi_count(recv.bytes(), what), MPI_BYTE, src, 0, handles_->mpi, &requests[pending++]));
  if (sending)
    MARROW_MPI_CHECK(MPI_Isend(send.data, mpi_count(send.bytes(), what), MPI_BYTE, dst, 0, handles_->mpi, &requests[pending++]));
  MARROW_MPI_CHECK(MPI_Waitall(pending, requests, MPI_STATUSES_IGNORE));
}

void Comm::send(Tensor t, int dst, const char* what) const {
  MARROW_CHECK(dst >= 0 && dst < size_ && dst != rank_, "{}: no rank {} to send to in a group of {}", what, dst, size_);
  if (t.numel() == 0) return;
  InFlight scope(what);
  if (t.device == Device::cuda) {
#if MARROW_CUDA
    on_comm_stream(*handles_, [&](cudaStream_t s) {
      MARROW_NCCL_CHECK(ncclSend(t.data, size_t(t.numel()), nccl_type(t.dtype), dst, handles_->nccl, s));
    }, false);
    return;
#endif
  }
  MPI_Request request;
  MARROW_MPI_CHECK(MPI_Isend(t.data, mpi_count(t.bytes(), what), MPI_BYTE, dst, 0, handles_->mpi, &request));
  handles_->sends.push_back(request);
}

void Comm::recv(Tensor t, int src, const char* what) const {
  MARROW_CHECK(src >= 0 && src < size_ && src != rank_, "{}: no rank {} to receive from in a group of {}", what, src, size_);
  if (t.numel() == 0) return;
  InFlight scope(what);
  if (t.device == Device::cuda) {
#if MARROW_CUDA
    on_comm_stream(*handles_, [&](cudaStream_t s) {
      MARROW_NCCL_CHECK(ncclRecv(t.data, size_t(t.numel()), nccl_type(t.dtype), src, handles_->nccl, s));
    });
    return;
#endif
  }
  MARROW_MPI_CHECK(MPI_Recv(t.data, mpi_count(t.bytes(), what), MPI_BYTE, src, 0, handles_->mpi, MPI_STATUS_IGNORE));
}

void Comm::wait_sends() const {
  if (size_ == 1) return;
  join();
  if (handles_->sends.empty()) return;
  InFlight scope("pipeline sends (wait)");
  MARROW_MPI_CHECK(MPI_Waitall(int(handles_->sends.size()), handles_->sends.data(), MPI_STATUSES_IGNORE));
  handles_->sends.clear();
}

void Comm::barrier(const char* what) const {
  if (size_ == 1) return;
  InFlight scope(what);
  MARROW_MPI_CHECK(MPI_Barrier(handles_->mpi));
}

}  // namespace marrow
