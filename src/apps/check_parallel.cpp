// marrow check --only expert_parallel, under `mpirun -np P`: the expert-parallel dispatch and combine
// (parallel/expert_parallel.h) on the GPUs over NCCL, bf16 rows, against the closed form on the host.
// Each rank routes its own tokens to K of E experts; the "experts" scale their rows by
// s(e) = 1 + e / 8 (exact in bf16), so a row at the wrong expert shows. For token t:
//   out[t] = residual[t] + sum_j w_j s(e_j) x[t],  dx[t] = sum_j w_j s(e_j) dout[t],
//   dtopk_weight[t, j] = s(e_j) dot(dout[t], x[t]).
// The CPU path of the same code is checked exactly in f64 by tests/tools/expert_parallel_check.
#include <algorithm>
#include <random>
#include <tuple>

#include "apps/check.h"
#include "parallel/comm.h"
#include "parallel/expert_parallel.h"
#include "parallel/process.h"

namespace marrow {

namespace {

double scale_of(int64_t expert) { return 1.0 + double(expert) / 8.0; }

// Rows of each local expert scaled by s(e), on the host: the check is of the exchange, not of a GEMM.
Buffer run_experts(Tensor rows, const ExpertRoute& route, int64_t first_expert) {
  Buffer host = to_host_f32(rows);
  const int64_t h = rows.ndim == 2 ? rows.size(1) : 0;
  const int32_t* offsets = route.expert_offsets.ptr<int32_t>();
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
  Buffer x = random_host({T, H}, 11 + uint64_t(rank)), residual = random_host({T, H}, 12 + uint64_t(rank)),
         dout = random_host({T, H}, 13 + uint64_t(rank));
  for (Tensor t : {x.view(), residual.view(), dout.view()}) round_to_bf16(t);

  ExpertRoute route;
  Buffer topk_d = to_device(topk, DType::i32), weight_d = to_device(weight, DType::f32);
  Buffer x_d = to_device(x, DType::bf16), residual_d = to_device(residual, DType::bf16), dout_d = to_device(dout, DType::bf16);
  Buffer x_perm = ep.dispatch_forward(route, x_d.view().reshape({T, H}), topk_d.view().reshape({T, K}), weight_d.view().reshape({T, K}));
  Buffer y_perm = run_experts(x_perm, route, ep.first_local_expert());
  Buffer out = poisoned(DType::bf16, {T, H});
  ep.combine_forward(out, residual_d.view().reshape({T, H}), y_perm.view().reshape({route.copies, H}), route);
  Buffer dy_perm = poisoned(DType::bf16, {route.copies, H});
  Buffer dweight_recv = ep.combine_backward(dy_perm, dout_d.view().reshape({T, H}), y_perm.view().reshape({route.copies, H}), route);
  Buffer dx_perm = run_experts(dy_perm, route, ep.first_local_expert());
  Buffer dx = poisoned(DType::bf16, {T, H}), dtopk = poisoned(DType::f32, {T, K});
  ep.dispatch_backward(dx, dtopk, dx_perm.view().reshape({route.copies, H}), dweight_recv, route);

  Buffer out_ref(DType::f32, Device::cpu, {T, H}), dx_ref(DType::f32, Device::cpu, {T, H}), dtopk_ref(DType::f32, Device::cpu, {T, K});
  for (int64_t t = 0; t < T; ++t) {
    double mix = 0, dot = 0;
    for (int64_t j = 0; j < K; ++j) mix += weight.ptr<float>()[t * K + j] * scale_of(topk.ptr<int32_t>()[t * K + j]);
    for (int64_t c = 0; c < H; ++c) {
      out_ref.ptr<float>()[t * H + c] = float(residual.ptr<float>()[t * H + c] + mix * x.ptr<float>()[t * H + c]);
      dx_ref.ptr<float>()[t * H + c] = float(mix * dout.ptr<float>()[t * H + c]);
      dot += double(dout.ptr<float>()[t * H + c]) * x.ptr<float>()[t * H + c];
    }
    for (int64_t j = 0; j < K; ++j) dtopk_ref.ptr<float>()[t * K + j] = float(scale_of(topk.ptr<int32_t>()[t * K + j]) * dot);
  }
  const std::string name = fmt::format("expert_parallel rank {}/{} T{} H{} E{} K{}", rank, world.size(), T, H, E, K);
  // bf16 rows: inputs exact, the expert outputs and the sums rounded once or twice.
  report.compare(name + " combine fwd", out, out_ref, 1.6e-2);
  report.compare(name + " dispatch bwd dx", dx, dx_ref, 1.6e-2);
  report.compare(name + " dtopk_weight", dtopk, dtopk_ref, 1.6e-2);
}

}  // namespace

void check_expert_parallel(CheckReport& report) {
  use_gpu(process::local_rank());
  const Comm world = Comm::world(Device::cuda);
  for (const auto& [T, H, E, K] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{37, 72, 8, 2}, {61, 75, 4 * world.size(), 3},
                                   {4096, 2048, 128, 8}})
    check_case(report, world, T, H, E, K);
  // Rank 0 prints the table; the other ranks' rows count through this one.
  const double failed = world.sum(double(std::count_if(report.rows().begin(), report.rows().end(), [](const CheckRow& r) { return !r.passed; })),
                                  "failed checks (sum)");
  report.add({fmt::format("expert_parallel: failed rows on all {} ranks", world.size()), failed, 0.0, failed == 0});
}

}  // namespace marrow
