// marrow check --only expert_parallel, under `mpirun -np P`: the expert-parallel dispatch and combine
// (parallel/expert_parallel.h) on the GPUs over NCCL, bf16 rows, against the closed form on the host.
// Each rank routes its own tokens to K of E experts; the "experts" scale their rows by
// s(e) = 1 + e / 8 (exact in bf16), so a row at the wrong expert shows. For token t:
//   out[t] = residual[t] + sum_j w_j s(e_j) x[t],  dx[t] = sum_j w_j s(e_j) dout[t],
//   dtopk_weight[t, j] = s(e_j) dot(dout[t], x[t]).
// The collectives of comm.h are checked too (check_collectives: exact sums of small halves, uneven
// all_to_all_v blocks, a send_recv ring); tests/tools/parallel_check runs them and the expert
// exchange (in f64) on the CPU path.
#include <algorithm>
#include <random>
#include <tuple>

#include "gpu_check/check.h"
#include "ops/cast.h"
#include "parallel/comm.h"
#include "parallel/expert_parallel.h"
#include "parallel/process.h"

namespace marrow {

namespace {

double scale_of(int64_t expert) { return 1.0 + double(expert) / 8.0; }

// Device memory of a receive buffer set to NaN, host memory to zero, so unwritten rows show on the GPU.
void poison_or_zero(Tensor t) {
  if (t.device == Device::cuda) poison(t);
  else fill_zero(t);
}

void check_exchange_counts(CheckReport& report, const Comm& group, const std::vector<int64_t>& sent, const std::vector<int64_t>& want,
                           const std::string& on) {
  report.expect("comm exchange_counts " + on, group.exchange_counts(sent, "check exchange_counts") == want);
}

// Rows of each local expert scaled by s(e), on the host: the check is of the exchange, not of a GEMM.
Buffer run_experts(Tensor rows, const ExpertRoute& route, int64_t first_expert) {
  Buffer host = to_host_f32(rows);
  const int64_t h = rows.ndim == 2 ? rows.size(1) : 0;
  const Buffer offsets_on_host = to_host(route.expert_offsets);  // the plan keeps them where the routing is
  const int32_t* offsets = offsets_on_host.ptr<int32_t>();
  for (int64_t e = 0; e + 1 < route.expert_offsets.numel(); ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
      for (int64_t c = 0; c < h; ++c) host.ptr<float>()[r * h + c] *= float(scale_of(first_expert + e));
  return to_device(host, DType::bf16);
}

void check_case(CheckReport& report, const Comm& world, int64_t T, int64_t H, int64_t E, int64_t K) {
  const int rank = world.rank();
  ExpertParallel ep(world, E);
  std::mt19937_64 rng(99 + uint64_t(rank));
  Buffer topk(DType::i32, Device::cpu, {T, K}), weight(DType::f32, Device::cpu, {T, K});
  std::uniform_real_distribution<float> uniform(0.25f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> chosen;
    while (int64_t(chosen.size()) < K) {
      const int32_t e = int32_t(rng() % uint64_t(E));
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    for (int64_t j = 0; j < K; ++j) {
      topk.ptr<int32_t>()[t * K + j] = chosen[size_t(j)];
      weight.ptr<float>()[t * K + j] = uniform(rng);
    }
  }
  const Both x(random_bf16({T, H}, 11 + uint64_t(rank)), DType::bf16), residual(random_bf16({T, H}, 12 + uint64_t(rank)), DType::bf16);
  const Both dout(random_bf16({T, H}, 13 + uint64_t(rank)), DType::bf16), topk_d(topk, DType::i32), weight_d(weight, DType::f32);
  ExpertRoute route;
  ExpertParallel::Exchange exchange = ep.start_dispatch(route, x.gpu, topk_d.gpu, weight_d.gpu);
  Buffer x_perm = ep.finish_dispatch(exchange, route);
  Buffer y_perm = run_experts(x_perm, route, ep.first_local_expert());
  Buffer out = poisoned(DType::bf16, {T, H});
  exchange = ep.start_combine(y_perm.view().reshape({route.copies, H}), route);
  ep.finish_combine(out, residual.gpu, exchange, route);
  Buffer dy_perm = poisoned(DType::bf16, {route.copies, H});
  exchange = ep.start_combine_backward(dout.gpu, route);
  Buffer dweight_recv = ep.finish_combine_backward(dy_perm, y_perm.view().reshape({route.copies, H}), exchange, route);
  Buffer dx_perm = run_experts(dy_perm, route, ep.first_local_expert());
  Buffer dx = poisoned(DType::bf16, {T, H}), dtopk = poisoned(DType::f32, {T, K});
  exchange = ep.start_dispatch_backward(dx_perm.view().reshape({route.copies, H}), std::move(dweight_recv), route);
  ep.finish_dispatch_backward(dx, dtopk, exchange, route);

  Buffer out_ref(DType::f32, Device::cpu, {T, H}), dx_ref(DType::f32, Device::cpu, {T, H}), dtopk_ref(DType::f32, Device::cpu, {T, K});
  const float *xs = x.cpu.ptr<float>(), *rs = residual.cpu.ptr<float>(), *ds = dout.cpu.ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    double mix = 0, dot = 0;
    for (int64_t j = 0; j < K; ++j) mix += weight.ptr<float>()[t * K + j] * scale_of(topk.ptr<int32_t>()[t * K + j]);
    for (int64_t c = 0; c < H; ++c) {
      out_ref.ptr<float>()[t * H + c] = float(rs[t * H + c] + mix * xs[t * H + c]);
      dx_ref.ptr<float>()[t * H + c] = float(mix * ds[t * H + c]);
      dot += double(ds[t * H + c]) * xs[t * H + c];
    }
    for (int64_t j = 0; j < K; ++j) dtopk_ref.ptr<float>()[t * K + j] = float(scale_of(topk.ptr<int32_t>()[t * K + j]) * dot);
  }
  const std::string name = fmt::format("expert_parallel rank {}/{} T{} H{} E{} K{}", rank, world.size(), T, H, E, K);
  // bf16 rows: inputs exact, the expert outputs and the sums rounded once or twice.
  report.compare(name + " combine fwd", out, out_ref, 1.6e-2);
  report.compare(name + " dispatch bwd dx", dx, dx_ref, 1.6e-2);
  report.compare(name + " dtopk_weight", dtopk, dtopk_ref, 1.6e-2);
}

// The host tensor on device, as dtype.
Buffer place(const Buffer& host, DType dtype, Device device) {
  if (device == Device::cuda) return to_device(host, dtype);
  Buffer out(dtype, Device::cpu, {host.numel()});
  cast(out, host);
  return out;
}

// Host f32 [n] with element i = (rank + 1) * (i % 7 + 1) / 2: sums over ranks are exact in bf16 too.
Buffer rank_values(int rank, int64_t n) {
  Buffer b(DType::f32, Device::cpu, {n});
  for (int64_t i = 0; i < n; ++i) b.ptr<float>()[i] = float(rank + 1) * float(i % 7 + 1) / 2;
  return b;
}

// The forms fully sharded data parallelism uses: an in-place all_gather (the shard is the
// member's block of the whole copy), and a reduce_scatter that adds to what the shard holds,
// without joining, waited for through a queued point.
void check_sharding_collectives(CheckReport& report, const Comm& group, Device device, const Buffer& gather_want,
                                const Buffer& scatter_want) {
  const int P = group.size(), r = group.rank();
  const int64_t n = gather_want.numel() / P;
  const std::string on = fmt::format("{} rank {}/{}", device_name(device), r, P);
  Buffer whole = place(rank_values(0, n * P), DType::f32, device);
  copy(whole.view().rows(r * n, (r + 1) * n), place(rank_values(r, n), DType::f32, device));
  group.all_gather(whole, whole.view().rows(r * n, (r + 1) * n), "check all_gather (in place)", false);
  group.wait_for(group.queued());
  report.compare("comm all_gather in place " + on, whole, gather_want, 0.0);

  Buffer shard = place(rank_values(r, n), DType::f32, device), want = rank_values(r, n);
  for (int64_t i = 0; i < n; ++i) want.ptr<float>()[i] += scatter_want.ptr<float>()[r * n + i];
  group.reduce_scatter_sum(shard, place(rank_values(r, n * P), DType::f32, device), "check reduce_scatter (accumulate)", true, false);
  group.wait_for(group.queued());
  report.compare("comm reduce_scatter_sum accumulate " + on, shard, want, 0.0);
}

}  // namespace

void check_collectives(CheckReport& report, const Comm& group, Device device) {
  const int P = group.size(), r = group.rank();
  const int64_t n = 1000 + 3;  // not a multiple of the rank count: uneven chunks
  const float ranks_sum = float(P * (P + 1) / 2);
  const std::string on = fmt::format("{} rank {}/{}", device_name(device), r, P);
  for (const DType dtype : {DType::f32, DType::bf16}) {
    if (dtype == DType::bf16 && device == Device::cpu) continue;  // host reductions are f32/f64
    Buffer t = place(rank_values(r, n), dtype, device), want = rank_values(0, n);
    for (int64_t i = 0; i < n; ++i) want.ptr<float>()[i] *= ranks_sum;
    group.all_reduce_sum(t, "check all_reduce");
    report.compare(fmt::format("comm all_reduce_sum {} {}", dtype_name(dtype), on), t, want, 0.0);
  }
  Buffer gathered = place(rank_values(0, n * P), DType::f32, device), gather_want(DType::f32, Device::cpu, {n * P});
  for (int q = 0; q < P; ++q) copy(gather_want.view().rows(q * n, (q + 1) * n), rank_values(q, n));
  group.all_gather(gathered, place(rank_values(r, n), DType::f32, device), "check all_gather");
  report.compare("comm all_gather " + on, gathered, gather_want, 0.0);

  Buffer scattered = place(rank_values(0, n), DType::f32, device), scatter_want = rank_values(0, n * P);
  group.reduce_scatter_sum(scattered, place(rank_values(r, n * P), DType::f32, device), "check reduce_scatter");
  for (int64_t i = 0; i < n * P; ++i) scatter_want.ptr<float>()[i] *= ranks_sum;
  report.compare("comm reduce_scatter_sum " + on, scattered, Tensor(scatter_want.view().rows(r * n, (r + 1) * n)), 0.0);
  check_sharding_collectives(report, group, device, gather_want, scatter_want);

  // all_to_all_v: member s sends (s + d) % 3 rows of 5 to member d; row c of that block holds
  // s * 64 + d * 4 + c (exact in f32).
  const int64_t width = 5;
  auto rows_between = [](int s, int d) { return int64_t((s + d) % 3); };
  std::vector<int64_t> send_rows, recv_rows;
  for (int q = 0; q < P; ++q) {
    send_rows.push_back(rows_between(r, q));
    recv_rows.push_back(rows_between(q, r));
  }
  check_exchange_counts(report, group, send_rows, recv_rows, on);
  int64_t sent = 0, received = 0;
  for (int q = 0; q < P; ++q) sent += send_rows[size_t(q)], received += recv_rows[size_t(q)];
  Buffer send_host(DType::f32, Device::cpu, {std::max<int64_t>(sent, 1), width}), want(DType::f32, Device::cpu, {std::max<int64_t>(received, 1), width});
  int64_t at = 0, got_at = 0;
  for (int q = 0; q < P; ++q) {
    for (int64_t c = 0; c < send_rows[size_t(q)]; ++c, ++at)
      for (int64_t k = 0; k < width; ++k) send_host.ptr<float>()[at * width + k] = float(r * 64 + q * 4 + c) + float(k) / 8;
    for (int64_t c = 0; c < recv_rows[size_t(q)]; ++c, ++got_at)
      for (int64_t k = 0; k < width; ++k) want.ptr<float>()[got_at * width + k] = float(q * 64 + r * 4 + c) + float(k) / 8;
  }
  Buffer send_d = place(send_host, DType::f32, device), recv_d = place(want, DType::f32, device);
  poison_or_zero(recv_d);
  group.all_to_all_v(recv_d.view().reshape({std::max<int64_t>(received, 1), width}).rows(0, received), recv_rows,
                     send_d.view().reshape({std::max<int64_t>(sent, 1), width}).rows(0, sent), send_rows, "check all_to_all_v");
  report.compare("comm all_to_all_v " + on, recv_d.view().reshape({std::max<int64_t>(received, 1), width}).rows(0, received),
                 want.view().rows(0, received), 0.0);

  if (P > 1) {  // a ring: each member sends to the next and receives from the previous one
    Buffer ring = place(rank_values(0, n), DType::f32, device);
    poison_or_zero(ring);
    group.send_recv(place(rank_values(r, n), DType::f32, device), (r + 1) % P, ring, (r + P - 1) % P, "check send_recv ring");
    report.compare("comm send_recv ring " + on, ring, rank_values((r + P - 1) % P, n), 0.0);
  }
  const std::vector<std::string> texts = group.all_gather_text(std::string(size_t(r + 1), char('a' + r)), "check all_gather_text");
  bool texts_ok = int(texts.size()) == P;
  for (int q = 0; q < P && texts_ok; ++q) texts_ok = texts[size_t(q)] == std::string(size_t(q + 1), char('a' + q));
  report.expect("comm all_gather_text " + on, texts_ok);
  const double total = group.sum(double(r + 1) / 3, "check sum");
  report.add({"comm sum in rank order " + on, std::abs(total - double(ranks_sum) / 3), 1e-15, std::abs(total - double(ranks_sum) / 3) <= 1e-15});
}

void check_expert_parallel(CheckReport& report) {
  use_gpu(process::local_rank());
  const Comm world = Comm::world(Device::cuda);
  for (const auto& [T, H, E, K] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{37, 72, 8, 2}, {61, 75, 4 * world.size(), 3},
                                   {4096, 2048, 128, 8}})
    check_case(report, world, T, H, E, K);
  check_collectives(report, world, Device::cuda);
  add_failed_rows_of_all_ranks(report, world, "expert_parallel");
}

void add_failed_rows_of_all_ranks(CheckReport& report, const Comm& world, const char* group) {
  // Rank 0 prints the table; the other ranks' rows count through this one.
  const double failed = world.sum(double(std::count_if(report.rows().begin(), report.rows().end(), [](const CheckRow& r) { return !r.passed; })),
                                  "failed checks (sum)");
  report.add({fmt::format("{}: failed rows on all {} ranks", group, world.size()), failed, 0.0, failed == 0});
}

}  // namespace marrow
