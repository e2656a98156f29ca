// The parallel layer on the CPU path over the processes of an mpirun job: every collective of
// parallel/comm.h against exactly known results (check_collectives, shared with marrow check's GPU
// group), and the expert-parallel dispatch/combine in f64 against the closed form of one process.
// Run as `mpirun -np P parallel_check`; prints PASS or FAIL.
//
// Each rank routes its own tokens (a different count per rank) to K of E experts. The "experts"
// scale their rows by s(e) = 1 + e / 8 (global index e), so a row sent to the wrong expert shows. For
// token t with experts e_j and weights w_j:
//   out[t]  = residual[t] + sum_j w_j s(e_j) x[t]
//   dx[t]   = sum_j w_j s(e_j) dout[t],   dw[t, j] = s(e_j) dot(dout[t], x[t])
// Routings: random (tokens that skip members, tokens whose experts all live on one member), and all
// tokens of every rank on member 0's experts (the other members receive nothing).
// Then fully sharded parameters (every unit over all P processes, shards padded) with the split master
// weights (core/split_f32.h) against an fp32 master, bf16 compute on the CPU: the same gathered bf16
// weights bit for bit after initialisation and after each of three optimizer steps on the same
// reduced gradients, and the same master as stored.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <random>

#include <omp.h>

#include "gpu_check/check.h"
#include "core/memory.h"
#include "mpi_check.h"
#include "parallel/comm.h"
#include "core/split_f32.h"
#include "parallel/expert_parallel.h"
#include "parallel/mesh.h"
#include "parallel/sharded_params.h"
#include "sharded_table.h"

namespace {

using namespace marrow;

double scale_of(int64_t expert) { return 1.0 + double(expert) / 8.0; }

struct Case {
  int64_t tokens, hidden = 6, k = 2;
  std::vector<int32_t> topk;
  std::vector<double> x, residual, weight, dout;
};

Case make_case(int rank, int64_t experts, bool all_on_member0, int64_t local_experts) {
  std::mt19937_64 rng(1234 + uint64_t(rank) * 7919);
  std::uniform_real_distribution<double> uniform(-1, 1);
  Case c;
  c.tokens = 5 + 3 * rank;
  for (int64_t t = 0; t < c.tokens; ++t) {
    // Two distinct experts; token 0 keeps both on one member, the rest are random.
    const int64_t range = all_on_member0 ? local_experts : experts;
    int32_t a = int32_t(rng() % uint64_t(range)), b = int32_t(rng() % uint64_t(range));
    if (t == 0 && local_experts > 1) b = int32_t(a / local_experts * local_experts + (a + 1) % local_experts);
    while (b == a) b = int32_t(rng() % uint64_t(range));
    c.topk.push_back(a);
    c.topk.push_back(b);
  }
  for (int64_t i = 0; i < c.tokens * c.hidden; ++i) {
    c.x.push_back(uniform(rng));
    c.residual.push_back(uniform(rng));
    c.dout.push_back(uniform(rng));
  }
  for (int64_t i = 0; i < c.tokens * c.k; ++i) c.weight.push_back(0.5 + uniform(rng) / 4);
  return c;
}

Tensor view(std::vector<double>& v, int64_t rows, int64_t cols) { return Tensor(v.data(), DType::f64, Device::cpu, {rows, cols}); }

double worst = 0;
void expect_close(const char* what, double got, double want) {
  const double error = std::abs(got - want) / std::max(1.0, std::abs(want));
  worst = std::max(worst, error);
  if (error > 1e-12) marrow::fail("{}: got {} but want {}", what, got, want);
}

// The expert rows of this member scaled by their expert's s(e), per route.expert_offsets.
void apply_experts(Tensor out, Tensor in, const ExpertRoute& route, int64_t first_expert) {
  const int32_t* offsets = route.expert_offsets.ptr<int32_t>();
  const int64_t h = in.size(1);
  for (int64_t e = 0; e + 1 < route.expert_offsets.numel(); ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
      for (int64_t c = 0; c < h; ++c) out.ptr<double>()[r * h + c] = scale_of(first_expert + e) * in.ptr<double>()[r * h + c];
}

void run_case(const Comm& group, int64_t experts, bool all_on_member0) {
  ExpertParallel ep(group, experts);
  Case c = make_case(group.rank(), experts, all_on_member0, ep.local_experts());
  const int64_t T = c.tokens, H = c.hidden, K = c.k;
  Buffer topk(DType::i32, Device::cpu, {T, K});
  std::copy(c.topk.begin(), c.topk.end(), topk.ptr<int32_t>());
  ExpertRoute route;
  ExpertParallel::Exchange exchange = ep.start_dispatch(route, view(c.x, T, H), topk, view(c.weight, T, K));
  Buffer x_perm = ep.finish_dispatch(exchange, route);
  Buffer y_perm(DType::f64, Device::cpu, {route.copies, H});
  apply_experts(y_perm, x_perm, route, ep.first_local_expert());
  Buffer out(DType::f64, Device::cpu, {T, H});
  exchange = ep.start_combine(y_perm, route);
  ep.finish_combine(out, view(c.residual, T, H), exchange, route);

  Buffer dy_perm(DType::f64, Device::cpu, {route.copies, H});
  exchange = ep.start_combine_backward(view(c.dout, T, H), route);
  Buffer dweight_recv = ep.finish_combine_backward(dy_perm, y_perm, exchange, route);
  Buffer dx_perm(DType::f64, Device::cpu, {route.copies, H});
  apply_experts(dx_perm, dy_perm, route, ep.first_local_expert());
  Buffer dx(DType::f64, Device::cpu, {T, H}), dtopk(DType::f64, Device::cpu, {T, K});
  exchange = ep.start_dispatch_backward(dx_perm, std::move(dweight_recv), route);
  ep.finish_dispatch_backward(dx, dtopk, exchange, route);

  for (int64_t t = 0; t < T; ++t) {
    double dot = 0;
    for (int64_t h = 0; h < H; ++h) dot += c.dout[size_t(t * H + h)] * c.x[size_t(t * H + h)];
    for (int64_t j = 0; j < K; ++j) expect_close("dtopk_weight", dtopk.ptr<double>()[t * K + j], scale_of(c.topk[size_t(t * K + j)]) * dot);
    for (int64_t h = 0; h < H; ++h) {
      double mix = 0;
      for (int64_t j = 0; j < K; ++j) mix += c.weight[size_t(t * K + j)] * scale_of(c.topk[size_t(t * K + j)]);
      expect_close("out", out.ptr<double>()[t * H + h], c.residual[size_t(t * H + h)] + mix * c.x[size_t(t * H + h)]);
      expect_close("dx", dx.ptr<double>()[t * H + h], mix * c.dout[size_t(t * H + h)]);
    }
  }
  // Deduplication: one row per (token, member) holding any of its experts, never more than its copies.
  int64_t rows = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t a = c.topk[size_t(2 * t)] / ep.local_experts(), b = c.topk[size_t(2 * t + 1)] / ep.local_experts();
    rows += a == b ? 1 : 2;
  }
  MARROW_CHECK(route.sent == rows, "rank {} sent {} rows but its tokens need {} (one per token and member)", group.rank(), route.sent, rows);
  int64_t remote_copies = 0;
  for (int64_t i = 0; i < T * K; ++i) remote_copies += c.topk[size_t(i)] / ep.local_experts() != group.rank();
  const ExpertTraffic traffic = ep.take_traffic();
  MARROW_CHECK(traffic.dispatches == 1 && traffic.remote_copies == remote_copies && traffic.remote_rows == route.remote_rows &&
                   route.remote_rows <= remote_copies && route.remote_rows == rows - route.send_rows[size_t(group.rank())],
               "rank {}: traffic of {} dispatches: {} remote rows for {} remote copies (want {} copies)", group.rank(), traffic.dispatches,
               traffic.remote_rows, traffic.remote_copies, remote_copies);
  if (all_on_member0 && group.rank() != 0)
    MARROW_CHECK(route.received == 0 && route.copies == 0, "rank {} received {} rows though no token routes to it", group.rank(),
                 route.received);
}

}  // namespace

double pseudo_random(uint64_t i, uint64_t seed) {
  std::mt19937_64 rng(seed * 1000003 + i);
  return std::uniform_real_distribution<double>(-1, 1)(rng);
}

std::vector<uint16_t> gathered_weights(ShardedParameters& s, const std::vector<TensorSpec>& specs) {
  std::vector<uint16_t> all;
  for (int64_t stage = -1; stage <= 2; ++stage) s.before_forward(stage);
  for (const TensorSpec& spec : specs) {
    const Tensor t = s.weights().slice(spec.offset, {spec.numel});
    const auto* bits = static_cast<const uint16_t*>(t.data);
    all.insert(all.end(), bits, bits + spec.numel);
  }
  return all;
}

void check_split_master_sharded(const Comm& world) {
  const std::vector<TensorSpec> specs = testing::sharded_table();
  const Mesh mesh = Mesh::create(mesh_shape(world.size(), 1, 1, 1), Device::cpu);
  const std::vector<int64_t> stages(4, 0);
  ShardedParameters whole(specs, 2, stages, mesh, true, true, false, Device::cpu, DType::bf16, DType::f32, false);
  ShardedParameters split(specs, 2, stages, mesh, true, true, false, Device::cpu, DType::bf16, DType::f32, true);
  MARROW_CHECK(split.split_master() && split.params().all().dtype == DType::u16, "the split master's low halves are not u16");
  auto init = [](Tensor out, const TensorSpec& spec, int64_t first) {
    for (int64_t i = 0; i < out.numel(); ++i) out.ptr<float>()[i] = float(0.1 * pseudo_random(uint64_t(spec.offset + first + i), 1));
  };
  for (ShardedParameters* s : {&whole, &split}) {
    s->initialize(init);
    s->master_changed();
  }
  MARROW_CHECK(gathered_weights(split, specs) == gathered_weights(whole, specs), "sharded split master: the initial bf16 weights differ from an fp32 master's");
  for (int64_t step = 1; step <= 3; ++step) {
    for (ShardedParameters* s : {&whole, &split}) {
      s->start_step();
      for (const TensorSpec& spec : specs) {  // each rank its own gradient: the reduction sums them
        const Tensor g = s->gradients().slice(spec.offset, {spec.numel});
        for (int64_t i = 0; i < spec.numel; ++i)
          g.ptr<float>()[i] = float(pseudo_random(uint64_t(spec.offset + i), 10 * uint64_t(step) + uint64_t(world.rank())));
      }
      for (int64_t stage = 2; stage >= -1; --stage) s->after_backward(stage, 0, true, false);
      s->finish_gradients(false);
      s->optimizer_step(AdamWHyper{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = step});
    }
    MARROW_CHECK(gathered_weights(split, specs) == gathered_weights(whole, specs),
                 "sharded split master: the bf16 weights differ from an fp32 master's after step {}", step);
    split.unpack_master();
    const Tensor stored = split.master_staging().all(), master = whole.params().all();
    for (int64_t i = 0; i < master.numel(); ++i) {
      uint32_t want = 0, got = 0;
      std::memcpy(&want, master.ptr<float>() + i, 4);
      std::memcpy(&got, stored.ptr<float>() + i, 4);
      MARROW_CHECK(got == split_storable(want), "sharded split master: element {} of the shard differs from an fp32 master's after step {}", i, step);
    }
    copy(master, stored);  // both as stored, so a midpoint moved in one cannot make them drift
    whole.master_changed();
    split.release_master_staging();
  }
  if (world.rank() == 0) std::printf("sharded split master over %d processes: bf16 weights and master as an fp32 master's\n", world.size());
}

// Each process on one machine runs its share of the cores (parallel/process.cpp); OMP_NUM_THREADS overrides.
void check_core_share() {
  if (std::getenv("OMP_NUM_THREADS")) return;
  const int local = process::local_size();
  const int want = local > 1 ? std::max(1, omp_get_num_procs() / local) : omp_get_num_procs();
  MARROW_CHECK(omp_get_max_threads() == want, "rank {}: {} OpenMP threads, but {} cores shared by {} processes give {}",
               process::rank(), omp_get_max_threads(), omp_get_num_procs(), local, want);
}

int main(int argc, char** argv) {
  return marrow::run_mpi_check(argc, argv, [](const marrow::Comm& world) {
    check_core_share();
    marrow::CheckReport report;
    marrow::check_collectives(report, world, marrow::Device::cpu);
    MARROW_CHECK(report.passed(), "rank {}: a collective gave a wrong result (the FAIL rows above)", world.rank());
    for (const int64_t experts : {std::max<int64_t>(2, world.size()), int64_t(2 * world.size()), int64_t(4 * world.size())}) {
      run_case(world, experts, false);
      if (experts >= 2 * world.size()) run_case(world, experts, true);  // two distinct experts on member 0
    }
    check_split_master_sharded(world);
    const double all_worst = world.sum(worst, "worst error (sum)");
    if (world.rank() == 0) std::printf("collectives exact; expert-parallel dispatch/combine on %d processes: worst relative error %.2e\nPASS\n", world.size(), all_worst);
  });
}
