// marrow bench: measured speed, never pass/fail.
//   marrow bench <run-config> [--warmup N] [--steps M] [--grouped-gemm=wgmma|cublas] [--section.key=value ...]
//     reports over the measured steps: tokens/s, achieved TFLOP/s (6 x active parameters incl. the
//     LM head, plus causal attention), MFU against the datasheet's 989 dense bf16 TFLOP/s, peak
//     memory, the time per stage; --profile-steps=A:B adds a CUPTI kernel trace (its steps' times
//     include CUPTI's overhead), --grouped-gemm an A/B of the expert GEMMs' kernel.
//   marrow bench --kernels [attention|experts|mla|gated_delta]: the heaviest kernels at the bench shapes (CUDA events);
//     mla: attention at DeepSeek-V2-Lite's q/k head dim 192 and v 128 (cuDNN's, the only path there);
//     gated_delta: Qwen3.5-MoE's linear attention (ops/gated_delta.h) at its layer's shape.
//   marrow bench --attention-plans [seq]: every plan cuDNN offers for the bench's attention (time,
//     repeatability, difference from the op's plan).
// Speed steps run without stage timing (CUDA events at each stage boundary cost ~9 ms of a bench
// step); steps/4 extra steps are timed for the stage split, and --profile-steps traces untimed steps
// (stages as NVTX ranges only). Compare bench lines only across commits that time the same way
// (2f9fbd5 changed it). A kernel's rows in --kernels can understate a change in the step: dW variants
// looked 5-25% slower in the rows and were 27-39% slower in the step's trace.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>

#include "gpu_check/check.h"
#include "apps/commands.h"
#include "core/cuda_check.h"
#include "engine/memory_guard.h"
#include "engine/trainer.h"
#include "apps/model_switch.h"
#include "ops/adamw.h"
#include "ops/cast.h"
#include "ops/attention.h"
#include "ops/attention_cudnn.h"
#include "ops/attention_hopper.h"
#include "ops/fp8.h"
#include "ops/gated_delta.h"
#include "ops/grouped_linear.h"
#include "ops/grouped_linear_fp8.h"
#include "ops/init.h"
#include "ops/linear.h"
#include "parallel/process.h"

namespace marrow {

namespace {

constexpr double kPeakTflops = 989.0;

// Median milliseconds of `reps` runs after one warm-up run, timed with CUDA events.
double median_ms([[maybe_unused]] const std::function<void()>& run, [[maybe_unused]] int reps = 10) {
#if MARROW_CUDA
  run();
  std::vector<float> times;
  cudaEvent_t start, stop;
  MARROW_CUDA_CHECK(cudaEventCreate(&start));
  MARROW_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < reps; ++i) {
    MARROW_CUDA_CHECK(cudaEventRecord(start));
    run();
    MARROW_CUDA_CHECK(cudaEventRecord(stop));
    MARROW_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    MARROW_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  MARROW_CUDA_CHECK(cudaEventDestroy(start));
  MARROW_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
#else
  fail("bench: this build has no CUDA support");
#endif
}

void kernel_row(const std::string& name, double flops, const std::function<void()>& run) {
  const double ms = median_ms(run);
  std::printf("%-64s %9.3f ms %8.1f TFLOP/s\n", name.c_str(), ms, flops / (ms * 1e-3) / 1e12);
  std::fflush(stdout);
}

// A memory-bound kernel's row: its rate in bytes read and written.
void memory_row(const std::string& name, double bytes, const std::function<void()>& run) {
  const double ms = median_ms(run);
  std::printf("%-64s %9.3f ms %8.1f GB/s\n", name.c_str(), ms, bytes / (ms * 1e-3) / 1e9);
  std::fflush(stdout);
}

// Where the hopper backward's time goes at one length (hopper_backward_timeline): the items' walk
// time fitted as fixed + per query block, their waits (those of the first wave, the items started
// before any ended, apart: they start together, so their dQ writes queue), the epilogue, and the
// SMs' idle time.
void print_hopper_timeline(const std::vector<HopperItemTimes>& items, int64_t S) {
  int64_t first = items.front().start, last = 0, busy = 0, dq_wait = 0, kv_wait = 0, epilog = 0;
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  std::map<int, std::vector<std::pair<int64_t, int64_t>>> by_sm;
  for (const HopperItemTimes& t : items) {
    const int64_t end = std::max(t.end, t.dq_end);
    const double x = double(S / 64 - 2 * t.key_block), y = double(t.walk_end - t.start) * 1e-3;
    first = std::min(first, t.start);
    last = std::max(last, end);
    busy += end - t.start;
    dq_wait += t.dq_wait;
    kv_wait += t.kv_wait;
    epilog += t.end - t.walk_end;
    sx += x, sy += y, sxx += x * x, sxy += x * y;
    by_sm[t.sm].emplace_back(t.start, end);
  }
  const double n = double(items.size()), slope = (n * sxy - sx * sy) / (n * sxx - sx * sx), fixed = (sy - slope * sx) / n;
  int64_t first_end = last, wave = 0, wave_wait = 0;
  for (const HopperItemTimes& t : items) first_end = std::min(first_end, std::max(t.end, t.dq_end));
  for (const HopperItemTimes& t : items)
    if (t.start < first_end) ++wave, wave_wait += t.dq_wait;
  int64_t gaps = 0, gap_count = 0;
  for (auto& [sm, spans] : by_sm) {
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i, ++gap_count) gaps += spans[i].first - spans[i - 1].second;
  }
  const double span_us = double(last - first) * 1e-3;
  std::printf("hopper bwd S%ld timeline: %zu items on %zu SMs over %.1f us, SMs busy %.1f%%; walk = %.2f us + %.3f us a query block;"
              " per item: dQ waits %.2f us (first wave of %ld: %.2f us, the rest: %.2f us), dK/dV wait %.2f us, epilogue %.2f us,"
              " gap before the next item %.2f us\n",
              long(S), items.size(), by_sm.size(), span_us, 100.0 * double(busy) * 1e-3 / (span_us * double(by_sm.size())), fixed, slope,
              double(dq_wait) * 1e-3 / n, long(wave), wave ? double(wave_wait) * 1e-3 / double(wave) : 0.0,
              n > double(wave) ? double(dq_wait - wave_wait) * 1e-3 / (n - double(wave)) : 0.0, double(kv_wait) * 1e-3 / n, double(epilog) * 1e-3 / n,
              gap_count ? double(gaps) * 1e-3 / double(gap_count) : 0.0);
  std::fflush(stdout);
}

// Attention at one sequence length: the own kernels, cuDNN's (deterministic backward, the default)
// and cuDNN's with its default backward (float atomics in dQ): what determinism costs.
void bench_attention_kernels(int64_t S, int64_t Hq, int64_t Hkv, int64_t D) {
  Buffer q = random_device({1, S, Hq, D}, 1, "q"), k = random_device({1, S, Hkv, D}, 1, "k"), v = random_device({1, S, Hkv, D}, 1, "v");
  Buffer out(DType::bf16, Device::cuda, {1, S, Hq, D}), lse(DType::f32, Device::cuda, {1, Hq, S});
  Buffer dout = random_device({1, S, Hq, D}, 2, "dout");
  Buffer dq(DType::bf16, Device::cuda, {1, S, Hq, D}), dk(DType::bf16, Device::cuda, {1, S, Hkv, D}),
      dv(DType::bf16, Device::cuda, {1, S, Hkv, D});
  // Causal: half of the 4 S^2 D multiply-adds per head forward; the backward does 2.5x the forward.
  const double fwd = 2.0 * double(S) * double(S) * double(D) * double(Hq);
  const std::string shape = fmt::format("attention S{} Hq{} Hkv{} D{} causal", S, Hq, Hkv, D);
  auto backward = [&] { attention_backward(dq, dk, dv, dout, q, k, v, out, lse); };
  auto backward_row = [&](const std::string& what) { kernel_row(shape + ", " + what, 2.5 * fwd, backward); };
  auto timeline = [&] { print_hopper_timeline(hopper_backward_timeline(dq, dk, dv, dout, q, k, v, out, lse), S); };
  const AttentionKernels before = attention_kernels();
  for (const AttentionKernels kernels : kAttentionKernels) {
    set_attention_kernels(kernels);
    kernel_row(shape + ", " + attention_kernels_name(kernels) + " fwd", fwd, [&] { attention_forward(out, lse, q, k, v); });
    backward_row(std::string(attention_kernels_name(kernels)) + " bwd");
  }
  // The hopper backward's work order: chunks of query heads (ops/attention_hopper.cu), each with its timeline.
  if (hopper_attention_supports(S, Hq, Hkv, D)) {
    set_attention_kernels(AttentionKernels::hopper);
    for (const int heads : {1, 2, 4, 8, 16}) {
      set_hopper_backward_chunk_heads(heads);
      backward_row(fmt::format("hopper bwd, chunks of {} heads", heads));
      timeline();
    }
    set_hopper_backward_chunk_heads(0);
    set_hopper_backward_unordered(true);
    backward_row("hopper bwd, dQ unordered (not deterministic)");
    timeline();
    set_hopper_backward_unordered(false);
    // What the walk's memory traffic costs (wrong results on purpose): hot Q/dO rows, no dQ writes, both.
    for (const int probe : {1, 2, 3}) {
      set_hopper_backward_probe(probe);
      const char* what[] = {"", "Q/dO from 8 hot query blocks", "no dQ writes", "hot Q/dO, no dQ writes"};
      backward_row(fmt::format("hopper bwd probe: {}", what[probe]));
      timeline();
    }
    set_hopper_backward_probe(0);
  }
  // Long sequences: cuDNN's deterministic backward under smaller workspace caps (more calls, less
  // memory), and in query chunks over all heads at the cap (the plan's choice at 32,768; at 16,384
  // it runs 4 whole head groups instead).
  if (S >= 16384) {
    set_attention_kernels(AttentionKernels::cudnn);
    for (const int64_t gib : {2, 1}) {
      set_cudnn_backward_workspace_cap(gib << 30);
      backward_row(fmt::format("cudnn bwd, cap {} GiB", gib));
    }
    set_cudnn_backward_workspace_cap(0);
    const int64_t rows = kCudnnAttentionWorkspaceCap / (Hq * S * 2);
    set_cudnn_backward_chunk(rows);
    backward_row(fmt::format("cudnn bwd, chunks of {} (all heads)", rows));
    set_cudnn_backward_chunk(0);
  }
  set_attention_kernels(before);
}

// Attention with v's head dim Dv != D (DeepSeek-V2's MLA heads) on cuDNN: causal, so half of the
// S^2 (2 D + 2 Dv) multiply-adds per head forward; the backward counted as 2.5 forwards.
void bench_attention_dv(int64_t S, int64_t H, int64_t D, int64_t Dv) {
  Buffer q = random_device({1, S, H, D}, 1, "q"), k = random_device({1, S, H, D}, 1, "k"), v = random_device({1, S, H, Dv}, 1, "v");
  Buffer out(DType::bf16, Device::cuda, {1, S, H, Dv}), lse(DType::f32, Device::cuda, {1, H, S}), dout = random_device({1, S, H, Dv}, 2, "dout");
  Buffer dq(DType::bf16, Device::cuda, {1, S, H, D}), dk(DType::bf16, Device::cuda, {1, S, H, D}), dv(DType::bf16, Device::cuda, {1, S, H, Dv});
  const double fwd = double(S) * double(S) * double(D + Dv) * double(H);
  const std::string shape = fmt::format("attention S{} H{} D{} Dv{} causal, cudnn", S, H, D, Dv);
  kernel_row(shape + " fwd", fwd, [&] { attention_forward(out, lse, q, k, v); });
  kernel_row(shape + " bwd", 2.5 * fwd, [&] { attention_backward(dq, dk, dv, dout, q, k, v, out, lse); });
}

// Qwen3.5-MoE's gated delta rule at its layer's shape (B = 1, S = 4096, Hk = 16, Hv = 32, Dk = Dv = D =
// 128, chunks of C = 64). FLOPs: twice the chunk algorithm's multiply-adds, per token and value head
// forward 2.5 C Dk + 1.5 C Dv + 3 Dk Dv (Q K^T, K K^T, the triangular solve for W and U, W S0,
// Q S0, P Vn, the state update: 21.5 GFLOP here), backward 9 C Dk + 4 C Dv + 8 Dk Dv (the forward's
// products again but O's, the reverse scan, the chunk gradients, the solve's backward: 62.3 GFLOP).
// GB/s counts the op's own tensors once (qkv, g, beta, o; + d_out, dqkv, dg, dbeta), not its scratch.
void bench_gated_delta() {
  const int64_t B = 1, S = 4096, Hk = 16, Hv = 32, D = 128, C = 64, width = 2 * Hk * D + Hv * D;
  Buffer qkv = random_device({B, S, width}, 1, "qkv"), dout = random_device({B, S, Hv, D}, 2, "dout");
  Buffer g_host = random_host({B, S, Hv}, 3), beta_host = random_host({B, S, Hv}, 4);
  for (int64_t i = 0; i < g_host.numel(); ++i) {
    g_host.ptr<float>()[i] = -std::log1p(std::exp(g_host.ptr<float>()[i] + 1.0f));  // the model's -softplus
    beta_host.ptr<float>()[i] = 1.0f / (1.0f + std::exp(-beta_host.ptr<float>()[i]));
  }
  Buffer g = to_device(g_host, DType::f32), beta = to_device(beta_host, DType::f32);
  Buffer o(DType::bf16, Device::cuda, {B, S, Hv, D}), dqkv(DType::bf16, Device::cuda, {B, S, width});
  Buffer dg(DType::f32, Device::cuda, {B, S, Hv}), dbeta(DType::f32, Device::cuda, {B, S, Hv});
  const double heads = double(B * S * Hv), fwd = 2 * heads * (4.0 * C * D + 3.0 * D * D), bwd = 2 * heads * (13.0 * C * D + 8.0 * D * D);
  const double io = double(B * S) * (2.0 * double(width) + 8.0 * double(Hv) + 2.0 * double(Hv * D));
  const double io_bwd = double(B * S) * (4.0 * double(width) + 16.0 * double(Hv) + 2.0 * double(Hv * D));
  auto row = [](const std::string& name, double flops, double bytes, const std::function<void()>& run) {
    const double ms = median_ms(run);
    std::printf("%-64s %9.3f ms %8.1f TFLOP/s %8.1f GB/s\n", name.c_str(), ms, flops / (ms * 1e-3) / 1e12, bytes / (ms * 1e-3) / 1e9);
    std::fflush(stdout);
  };
  const std::string shape = fmt::format("gated_delta B{} S{} Hk{} Hv{} D{} chunk {}", B, S, Hk, Hv, D, C);
  row(shape + " fwd", fwd, io, [&] { gated_delta_forward(o, {}, qkv, g, beta, Hk, D); });
  row(shape + " bwd", bwd, io_bwd, [&] { gated_delta_backward(dqkv, dg, dbeta, {}, dout, qkv, g, beta, Hk, D); });
  std::printf("gated_delta bwd scratch %.0f MiB\n", double(gated_delta_backward_scratch({B, S, Hk, D, Hv, D})) / (1 << 20));
}

#if MARROW_CUDA
// The largest |a - b| over the outputs of two runs (host copies), and whether their bits are equal.
std::pair<double, bool> compare_outputs(const std::vector<Buffer>& a, const std::vector<Buffer>& b) {
  double diff = 0;
  bool same = true;
  for (size_t t = 0; t < a.size(); ++t) {
    same = same && std::memcmp(a[t].view().data, b[t].view().data, a[t].view().bytes()) == 0;
    const float *x = a[t].ptr<float>(), *y = b[t].ptr<float>();
    for (int64_t i = 0; i < a[t].numel(); ++i) diff = std::max(diff, double(std::fabs(x[i] - y[i])));
  }
  return {diff, same};
}

// Every plan cuDNN offers for the attention forward and the deterministic backward at one shape:
// its median time, whether two of its runs give the same bits, and how its outputs differ from the
// op's own plan's. Which plans are faster than the op's, and whether they are deterministic.
void bench_attention_plans(int64_t S, int64_t Hq, int64_t Hkv, int64_t D) {
  keep_pool_memory();
  set_attention_kernels(AttentionKernels::cudnn);
  Buffer q = random_device({1, S, Hq, D}, 1, "q"), k = random_device({1, S, Hkv, D}, 1, "k"), v = random_device({1, S, Hkv, D}, 1, "v");
  Buffer dout = random_device({1, S, Hq, D}, 2, "dout");
  Buffer out(DType::bf16, Device::cuda, {1, S, Hq, D}), lse(DType::f32, Device::cuda, {1, Hq, S});
  Buffer dq(DType::bf16, Device::cuda, {1, S, Hq, D}), dk(DType::bf16, Device::cuda, {1, S, Hkv, D}),
      dv(DType::bf16, Device::cuda, {1, S, Hkv, D});
  const double fwd = 2.0 * double(S) * double(S) * double(D) * double(Hq);
  for (const bool backward : {false, true}) {
    // The op's own plan first: its outputs are the reference (the forward's also feed the backward).
    attention_forward(out, lse, q, k, v);
    if (backward) attention_backward(dq, dk, dv, dout, q, k, v, out, lse);
    const std::vector<Tensor> outputs = backward ? std::vector<Tensor>{dq, dk, dv} : std::vector<Tensor>{out, lse};
    auto host_outputs = [&] {
      std::vector<Buffer> copies;
      for (const Tensor& t : outputs) copies.push_back(to_host_f32(t));
      return copies;
    };
    const std::vector<Buffer> reference = host_outputs();
    const double flops = backward ? 2.5 * fwd : fwd;
    std::printf("\nattention S%lld Hq%lld Hkv%lld D%lld causal %s: cuDNN's plans (heuristics A, B, fallback)\n", (long long)S, (long long)Hq,
                (long long)Hkv, (long long)D, backward ? "backward (deterministic)" : "forward");
    std::printf("%-4s %-52s %10s %9s %9s %10s %10s %11s\n", "plan", "name", "workspace", "ms", "TFLOP/s", "repeatable", "op's bits", "max |diff|");
    const std::vector<CudnnAttentionPlan> plans = cudnn_attention_plans(backward, dq, dk, dv, dout, q, k, v, out, lse);
    for (size_t i = 0; i < plans.size(); ++i) {
      const CudnnAttentionPlan& plan = plans[i];
      if (!plan.run) {
        std::printf("%-4zu %-52s %10s\n", i, plan.name.c_str(), "not built");
        continue;
      }
      plan.run();
      const std::vector<Buffer> first = host_outputs();
      plan.run();
      const std::vector<Buffer> second = host_outputs();
      const double ms = median_ms(plan.run);
      const auto [diff, same] = compare_outputs(reference, first);
      std::printf("%-4zu %-52s %6.0f MiB %9.3f %9.1f %10s %10s %11.3e\n", i, plan.name.c_str(), double(plan.workspace_bytes) / (1 << 20), ms,
                  flops / (ms * 1e-3) / 1e12, compare_outputs(first, second).second ? "yes" : "NO", same ? "same" : "differ", diff);
      std::fflush(stdout);
    }
  }
}
#endif

// Ring attention's full blocks (parallel/ring_attention.h) at a member's local length L, two zigzag
// chunks of L / 2: its queries [0, L) against an earlier member's keys [0, L / 2), on the own
// mma.sync kernels and on the wgmma kernels; the backward adds into f32 sums as the ring's does.
void bench_ring_blocks(int64_t L, int64_t Hq, int64_t Hkv, int64_t D) {
  Buffer q = random_device({1, L, Hq, D}, 1, "q"), k = random_device({1, L, Hkv, D}, 1, "k"), v = random_device({1, L, Hkv, D}, 1, "v");
  Buffer out(DType::bf16, Device::cuda, {1, L, Hq, D}), lse(DType::f32, Device::cuda, {1, Hq, L});
  Buffer dout = random_device({1, L, Hq, D}, 2, "dout");
  Buffer dq = Buffer::zeros(DType::f32, Device::cuda, {1, L, Hq, D}), dk = Buffer::zeros(DType::f32, Device::cuda, {1, L, Hkv, D}),
         dv = Buffer::zeros(DType::f32, Device::cuda, {1, L, Hkv, D});
  const AttentionBlock block{AttentionMask::full, 0, L, 0, L / 2};
  const double fwd = 4.0 * double(L) * double(L / 2) * double(D) * double(Hq);  // no mask: all 4 Sq Sk D per head
  const AttentionKernels before = attention_kernels();
  for (const AttentionKernels kernels : {AttentionKernels::own, AttentionKernels::hopper_backward}) {
    set_attention_kernels(kernels);
    const std::string name = fmt::format("ring block q[0, {}) k[0, {}) Hq{} Hkv{} D{} full, {}", L, L / 2, Hq, Hkv, D,
                                         attention_block_backward_fused(q, k, block) ? "wgmma" : "own");
    kernel_row(name + " fwd", fwd, [&] { attention_block_forward(out, lse, q, k, v, block); });
    kernel_row(name + " bwd", 2.5 * fwd, [&] { attention_block_backward(dq, dk, dv, dout, q, k, v, out, lse, block); });
  }
  set_attention_kernels(before);
}

// The FP8 grouped GEMMs (ops/grouped_linear_fp8.h) on the same operands, each quantization timed
// on its own: activations and gradients by rows, the weight with its transposed copy.
void bench_fp8_grouped(const std::string& name, Tensor offsets, Tensor x, Tensor w, Tensor dy, double flops) {
  const int64_t R = x.size(0), in = x.size(1), E = w.size(0), out = w.size(1);
  const Fp8Buffer xq = Fp8Buffer::rows(Device::cuda, R, in), dyq = Fp8Buffer::rows(Device::cuda, R, out);
  const Fp8Buffer wq = Fp8Buffer::blocks(Device::cuda, E, out, in), wtq = Fp8Buffer::blocks(Device::cuda, E, in, out);
  Buffer y(DType::bf16, Device::cuda, {R, out}), dx(DType::bf16, Device::cuda, {R, in});
  // bf16 in, one byte out per element (two for the weight: it and its transpose).
  memory_row(name + " fp8 quantize x rows", 3.0 * double(R * in), [&] { quantize_rows(xq.view(), x); });
  memory_row(name + " fp8 quantize dy rows", 3.0 * double(R * out), [&] { quantize_rows(dyq.view(), dy); });
  memory_row(name + " fp8 quantize weight + transposed", 4.0 * double(E * in * out), [&] { quantize_blocks(wq.view(), wtq.view(), w); });
  kernel_row(name + " fp8 fwd", flops, [&] { grouped_linear_fp8(y, xq.view(), wq.view(), offsets); });
  kernel_row(name + " fp8 bwd input", flops, [&] { grouped_linear_fp8(dx, dyq.view(), wtq.view(), offsets); });
  // The weight's AdamW step as the optimizer runs it (f32 master, moments and gradient, and the bf16
  // copy: 30 bytes an element): the pass the weight's quantization above would join if fused into it.
  Buffer param(DType::f32, Device::cuda, {E, out, in}), grad(DType::f32, Device::cuda, {E, out, in});
  fill_normal(param, 5, "param", 0.02);
  fill_normal(grad, 5, "grad", 1e-3);
  Buffer m = Buffer::zeros(DType::f32, Device::cuda, {E, out, in}), v = Buffer::zeros(DType::f32, Device::cuda, {E, out, in});
  Buffer copy(DType::bf16, Device::cuda, {E, out, in}), known = Buffer::zeros(DType::i32, Device::cuda, {E});
  const AdamWHyper hyper{1e-4, 0.9, 0.95, 1e-8, 0.1, 1};
  memory_row(name + " adamw + bf16 copy", 30 * double(E * out * in), [&] { adamw_step_known_zero(param, copy, m, v, grad, known, hyper); });
  // The same with the moments in bf16 (optimizer.moments): 22 bytes an element.
  Buffer m16 = Buffer::zeros(DType::bf16, Device::cuda, {E, out, in}), v16 = Buffer::zeros(DType::bf16, Device::cuda, {E, out, in});
  memory_row(name + " adamw + bf16 copy, bf16 moments", 22 * double(E * out * in),
             [&] { adamw_step_known_zero(param, copy, m16, v16, grad, known, hyper); });
  // Split master weights (train.master_weights = "split"): the copy is the master's high half, the
  // low half a u16: 28 bytes an element, 20 with bf16 moments.
  Buffer low = Buffer::zeros(DType::u16, Device::cuda, {E, out, in});
  split_f32(copy, low, param);
  memory_row(name + " adamw split master", 28 * double(E * out * in), [&] { adamw_step_known_zero(low, copy, m, v, grad, known, hyper); });
  memory_row(name + " adamw split master, bf16 moments", 20 * double(E * out * in),
             [&] { adamw_step_known_zero(low, copy, m16, v16, grad, known, hyper); });
}

// group: "" all, "attention" the attention rows only, "experts" the expert GEMM rows only, "mla" DeepSeek-V2's attention,
// "gated_delta" Qwen3.5-MoE's linear attention.
void bench_kernels(const std::string& group) {
  if (group == "gated_delta") {
    keep_pool_memory();
    bench_gated_delta();
    return;
  }
  if (group == "mla") {
    for (const int64_t seq : {4096, 16384}) bench_attention_dv(seq, 16, 192, 128);
    return;
  }
  const bool attention_only = group == "attention", experts_only = group == "experts";
  // As in training: without it the pool hands freed memory back at every event sync, and each timed
  // call that allocates (the grouped GEMMs' small schedules, cuDNN's 1 GiB dP workspace) pays for mapping it again (~80 us).
  keep_pool_memory();
  std::printf("%-64s %12s %16s\n", "kernel (bench shapes, bf16)", "median", "achieved");
  const int64_t S = 4096, Hq = 32, Hkv = 4, D = 128, H = 2048, E = 128, K = 8, I = 768;
  if (!experts_only) {
    for (const int64_t seq : {S, 4 * S, 8 * S})
      bench_attention_kernels(seq, Hq, Hkv, D);
    for (const int64_t local : {4 * S, 8 * S}) bench_ring_blocks(local, Hq, Hkv, D);  // sequences of 32,768 and 65,536 with CP = 2
  }
  if (attention_only) return;
  if (!experts_only) {
    Buffer x = random_device({S, H}, 3, "x"), w = random_device({Hq * D, H}, 3, "w"), dy = random_device({S, Hq * D}, 3, "dy");
    Buffer y(DType::bf16, Device::cuda, {S, Hq * D}), dx(DType::bf16, Device::cuda, {S, H});
    Buffer dw = Buffer::zeros(DType::f32, Device::cuda, {Hq * D, H});
    const double flops = 2.0 * double(S) * double(H) * double(Hq * D);
    kernel_row("linear q_proj fwd 4096x2048->4096", flops, [&] { linear_forward(y, x, w); });
    kernel_row("linear q_proj bwd input", flops, [&] { linear_backward_input(dx, dy, w); });
    kernel_row("linear q_proj bwd weight (f32 accumulate)", flops, [&] { linear_backward_weight(dw, dy, x); });
  }
  // Two routings of the 32768 rows: skewed_counts (largest expert ~17x the smallest, two empty) and
  // even (256 rows each, every row tile full).
  const int64_t R = S * K;
  for (const bool even : {false, true}) {
    const Buffer offsets = offsets_host(even ? std::vector<int32_t>(size_t(E), int32_t(R / E)) : skewed_counts(E, R));
    for (auto [label, in, out] : {std::tuple{"gate_up", H, 2 * I}, std::tuple{"down", I, H}}) {
      Buffer x = random_device({R, in}, 4, "x"), w = random_device({E, out, in}, 4, "w"), dy = random_device({R, out}, 4, "dy");
      Buffer y(DType::bf16, Device::cuda, {R, out}), dx(DType::bf16, Device::cuda, {R, in});
      Buffer dw = Buffer::zeros(DType::f32, Device::cuda, {E, out, in});
      const double flops = 2.0 * double(R) * double(in) * double(out);
      const std::string name = fmt::format("grouped {} {} E128 {}x{}->{}", label, even ? "even" : "skewed", R, in, out);
      kernel_row(name + " fwd", flops, [&] { grouped_linear_forward(y, x, w, offsets); });
      kernel_row(name + " bwd input", flops, [&] { grouped_linear_backward_input(dx, dy, w, offsets); });
      set_grouped_gemm_backend(GroupedGemmBackend::cublas);
      kernel_row(name + " fwd (cuBLAS grouped)", flops, [&] { grouped_linear_forward(y, x, w, offsets); });
      kernel_row(name + " bwd input (cuBLAS grouped)", flops, [&] { grouped_linear_backward_input(dx, dy, w, offsets); });
      set_grouped_gemm_backend(GroupedGemmBackend::wgmma);
      bench_fp8_grouped(name, offsets, x, w, dy, flops);
      kernel_row(name + " bwd weight", flops, [&] { grouped_linear_backward_weight(dw, dy, x, offsets); });
      kernel_row(name + " bwd weight (overwrite)", flops, [&] { grouped_linear_backward_weight(dw, dy, x, offsets, true); });
      Buffer squares(DType::f64, Device::cuda, {grouped_weight_squares_count(E, out, in)});
      kernel_row(name + " bwd weight (with squares)", flops, [&] { grouped_linear_backward_weight(dw, dy, x, offsets, false, squares); });
      // Two micro-batches' rows (the same ones twice) in one pass: twice the multiplies, one pass over dW.
      kernel_row(name + " bwd weight (two micro-batches)", 2 * flops,
                 [&] { grouped_linear_backward_weight_pair(dw, {dy, x, offsets}, {dy, x, offsets}, false, squares); });
    }
  }
}

// Bytes rank 0 sent to other expert-parallel ranks per step, as the rows of the four all-to-alls
// (dispatch and combine, forward and backward), against one row per routed expert; and the host
// time of the dispatch plans.
void print_expert_traffic(const std::vector<StepMetrics>& history, int64_t warmup, int64_t row_bytes, double step_ms) {
  double rows = 0, copies = 0, plan_ms = 0, exchange_ms = 0, dispatches = 0;
  for (size_t i = size_t(warmup); i < history.size(); ++i) {
    rows += double(history[i].expert_traffic.remote_rows);
    copies += double(history[i].expert_traffic.remote_copies);
    plan_ms += history[i].expert_traffic.plan_ms;
    exchange_ms += history[i].expert_traffic.exchange_ms;
    dispatches += double(history[i].expert_traffic.dispatches);
  }
  const double steps = double(history.size() - size_t(warmup)), bytes = 4 * rows * double(row_bytes) / steps;
  std::printf("expert all-to-all per step (rank 0, 4 exchanges of rows): %.1f MB sent to other ranks, %.1f MB at one row per "
              "routed expert (deduplication saves %.1f%%); %.1f GB/s over the whole step\n",
              bytes / 1e6, 4 * copies * double(row_bytes) / steps / 1e6, 100 * (1 - rows / std::max(copies, 1.0)), bytes / (step_ms * 1e-3) / 1e9);
  std::printf("expert-parallel plans per step (rank 0): %.0f, %.2f ms of host time from the counts on the host to the all-to-alls "
              "queued (the GPU waits): %.2f ms in the MPI count exchange\n",
              dispatches / steps, plan_ms / steps, exchange_ms / steps);
}

// The stages' own time in the `timed` steps after the measured ones (timing slows a step); what is
// left of the step is host work between them (data, launches, syncs).
void print_stage_split(const std::array<double, kStageCount>& stage_ms, int64_t timed, double timed_ms) {
  std::printf("%-24s %10s %7s   (%lld more step%s, timed by stage: %.1f ms/step)\n", "stage (per step)", "ms", "share", (long long)timed,
              timed > 1 ? "s" : "", timed_ms);
  double staged = 0;
  for (int k = 0; k < kStageCount; ++k) {
    staged += stage_ms[size_t(k)];
    std::printf("%-24s %10.1f %6.1f%%\n", kStageNames[k], stage_ms[size_t(k)], 100 * stage_ms[size_t(k)] / timed_ms);
  }
  std::printf("%-24s %10.1f %6.1f%%\n", "outside the stages", timed_ms - staged, 100 * (timed_ms - staged) / timed_ms);
}

template <MoeModel M>
void bench_training(RunConfig rc, const typename M::Config& config, int64_t warmup, int64_t steps) {
  check_state_fits(config.model_size(), process::size(), choose_device(rc.device), process::local_rank(),
                   int(dtype_size(moments_dtype(rc))));
  // The stage split comes from `timed` steps after the measured ones: timing the stages slows a
  // step (engine/stage_timer.h), so the tokens/s come from steps without it.
  const int64_t timed = std::max<int64_t>(1, steps / 4);
  rc.steps = warmup + steps + timed;
  rc.warmup_steps = std::min(rc.warmup_steps, rc.steps);
  // A benchmark times fresh steps: it saves no checkpoint, and its own folder holds none to resume.
  rc.checkpoint_every = 0;
  rc.checkpoint_resume.clear();
  rc.out_dir += "/bench";
  StageTimer timer(choose_device(rc.device));
  timer.time_from_step(warmup + steps + 1);
  const std::vector<StepMetrics> history = train<M>(rc, config, &timer);
  MARROW_CHECK(int64_t(history.size()) == rc.steps, "bench: the run stopped after {} of {} steps", history.size(), rc.steps);
  const M model(config, DType::f32, Device::cpu);
  double ms = 0, timed_ms = 0;
  size_t peak = 0;
  std::array<double, kStageCount> stage_ms{};
  for (int64_t i = warmup; i < rc.steps; ++i) {
    peak = std::max(peak, history[size_t(i)].peak_bytes);
    if (i < warmup + steps) {
      ms += history[size_t(i)].step_ms / double(steps);
      continue;
    }
    timed_ms += history[size_t(i)].step_ms / double(timed);
    for (int k = 0; k < kStageCount; ++k) stage_ms[size_t(k)] += history[size_t(i)].stage_ms[size_t(k)] / double(timed);
  }
  const double tokens = double(rc.global_batch * rc.seq_len);
  // Per token: 6 x active parameters, plus causal attention's (6 S D Hq per full layer, forward + backward).
  const double flops_per_token = 6.0 * double(model.num_active_parameters()) + model.attention_flops_per_token(rc.seq_len);
  const double tflops = flops_per_token * tokens / (ms * 1e-3) / 1e12;
  // Several processes: the figures are per GPU (tokens/s of the whole job over its processes).
  const double gpus = double(process::size());
  // MFU compares with a GPU's datasheet: a CPU run reports its GFLOP/s, labelled, and no MFU.
  const bool gpu = choose_device(rc.device) == Device::cuda;
  const std::string speed = gpu ? fmt::format("{:.1f} TFLOP/s | MFU {:.1f}%", tflops / gpus, 100 * tflops / gpus / kPeakTflops)
                                : fmt::format("{:.3g} GFLOP/s on the CPU (fp32; MFU needs a GPU)", tflops * 1e3 / gpus);
  std::printf("bench: %lld measured steps after %lld warm-up | %.0f tokens/s%s | %.1f ms/step | %s | peak %.2f GiB\n", (long long)steps,
              (long long)warmup, tokens / (ms * 1e-3) / gpus, gpus > 1 ? (gpu ? " per GPU" : " per process") : "", ms, speed.c_str(),
              peak / 1073741824.0);
  const int64_t row_bytes = config.hidden_size * (gpu ? 2 : 4);  // bf16 or f32 rows
  if (rc.ep > 1) print_expert_traffic(history, warmup, row_bytes, ms);
  print_stage_split(stage_ms, timed, timed_ms);
}

}  // namespace

int bench_command(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "--kernels") {
    MARROW_CHECK(cuda_available(), "bench --kernels needs a GPU");
    const std::string only = argc >= 3 ? argv[2] : "";
    MARROW_CHECK(only.empty() || only == "attention" || only == "experts" || only == "mla" || only == "gated_delta",
                 "bench --kernels takes nothing, `attention`, `experts`, `mla` or `gated_delta` (it needs no run config), got '{}'", only);
    bench_kernels(only);
    return 0;
  }
  if (argc >= 2 && std::string(argv[1]) == "--attention-plans") {
    MARROW_CHECK(cuda_available(), "bench --attention-plans needs a GPU");
#if MARROW_CUDA
    const int64_t seq = argc >= 3 ? std::stoll(argv[2]) : 4096;
    MARROW_CHECK(seq > 0, "bench --attention-plans: the sequence length must be positive, got {}", seq);
    bench_attention_plans(seq, 32, 4, 128);
#endif
    return 0;
  }
  if (print_run_config_help(argc, argv)) {
    std::printf("\nbench's own: --warmup=N (3) --steps=M (10) measured steps; --grouped-gemm=wgmma|cublas (the expert GEMMs' kernel);\n"
                "marrow bench --kernels [attention|experts|mla|gated_delta] times the heaviest kernels (GPU); marrow bench --attention-plans [seq]\n"
                "times every plan cuDNN offers for the bench's attention (GPU)\n");
    return 0;
  }
  // --warmup, --steps and --grouped-gemm are bench's own; everything else is the run config and its overrides.
  int64_t warmup = 3, steps = 10;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const std::string& flag) { return a.rfind(flag + "=", 0) == 0 ? std::stoll(a.substr(flag.size() + 1)) : -1; };
    if (value("--warmup") >= 0) warmup = value("--warmup");
    else if (value("--steps") > 0) steps = value("--steps");
    else if (a.rfind("--grouped-gemm=", 0) == 0) {
      const std::string kernel = a.substr(15);
      MARROW_CHECK(kernel == "wgmma" || kernel == "cublas", "bench: --grouped-gemm takes wgmma or cublas, got '{}'", kernel);
      set_grouped_gemm_backend(kernel == "cublas" ? GroupedGemmBackend::cublas : GroupedGemmBackend::wgmma);
    }
    else rest.push_back(argv[i]);
  }
  const RunConfig rc = parse_run_config(int(rest.size()), rest.data());
  check_run_paths(rc);
  with_model(read_json_file(rc.model_config), rc.model_config,
             [&]<class M>(const typename M::Config& config) { bench_training<M>(rc, config, warmup, steps); });
  return 0;
}

}  // namespace marrow
