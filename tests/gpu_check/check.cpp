// marrow check [--only <group>]: the GPU correctness report (DESIGN.md §7, layer 2); under mpirun,
// `--only expert_parallel` checks the expert all-to-alls over NCCL, `--only ring_attention` ring
// attention's K/V and dK/dV hops.
#include "gpu_check/check.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>

#include "apps/commands.h"
#include "core/cuda_check.h"
#include "core/rng.h"
#include "ops/cast.h"
#include "ops/init.h"
#include "parallel/process.h"

namespace marrow {

void CheckReport::add(CheckRow row) {
  std::printf("%-52s %10.3e %10.1e  %s\n", row.name.c_str(), row.error, row.bound, row.passed ? "ok" : "FAIL");
  std::fflush(stdout);
  rows_.push_back(std::move(row));
}

void CheckReport::compare(const std::string& name, Tensor gpu, Tensor cpu, double bound) {
  Buffer got = to_host_f32(gpu);
  MARROW_CHECK(got.numel() == cpu.numel(), "check {}: GPU result has {} elements but the reference {}", name, got.numel(), cpu.numel());
  const float *a = got.ptr<float>(), *b = cpu.ptr<float>();
  double max_diff = 0, max_ref = 0;
  bool finite = true;
  for (int64_t i = 0; i < got.numel(); ++i) {
    finite = finite && std::isfinite(a[i]);
    max_diff = std::max(max_diff, double(std::abs(a[i] - b[i])));
    max_ref = std::max(max_ref, double(std::abs(b[i])));
  }
  const double error = finite ? max_diff / std::max(max_ref, 1e-30) : INFINITY;
  add({name, error, bound, finite && error <= bound});
}

void CheckReport::expect_equal(const std::string& name, Tensor gpu, Tensor cpu) {
  Buffer got = to_host(gpu);
  MARROW_CHECK(got.view().bytes() == cpu.bytes(), "check {}: GPU result has {} bytes but the reference {}", name, got.view().bytes(),
               cpu.bytes());
  const bool same = std::memcmp(got.view().data, cpu.data, cpu.bytes()) == 0;
  add({name, same ? 0.0 : 1.0, 0.0, same});
}

void CheckReport::expect_finite(const std::string& name, Tensor gpu) {
  const Buffer host = to_host_f32(gpu);
  int64_t bad = 0;
  for (int64_t i = 0; i < host.numel(); ++i) bad += !std::isfinite(host.ptr<float>()[i]);
  add({name, double(bad), 0.0, bad == 0});
}

bool CheckReport::passed() const {
  return !rows_.empty() && std::all_of(rows_.begin(), rows_.end(), [](const CheckRow& r) { return r.passed; });
}

Buffer random_host(std::initializer_list<int64_t> dims, uint64_t seed, double scale) {
  Buffer b(DType::f32, Device::cpu, dims);
  Philox rng = philox_for(seed, "check");
  for (int64_t i = 0; i < b.numel(); ++i) b.ptr<float>()[i] = float(scale * rng.normal(uint64_t(i)));
  return b;
}

Buffer random_bf16(std::initializer_list<int64_t> dims, uint64_t seed, double scale) {
  Buffer b = random_host(dims, seed, scale);
  round_to_bf16(b);
  return b;
}

void round_to_bf16(Tensor host_f32) {
  Buffer tmp(DType::bf16, Device::cpu, {host_f32.numel()});
  cast(tmp, host_f32);
  cast(host_f32, tmp);
}

Buffer to_device(Tensor host, DType dtype) {
  Buffer staged(dtype, Device::cpu, {host.numel()});
  if (dtype == host.dtype) copy(staged, host);
  else cast(staged, host);
  Buffer out(dtype, Device::cuda, {host.numel()});
  copy(out, staged);
  return out;
}

Buffer to_host_f32(Tensor device) {
  Buffer raw = to_host(device);
  if (device.dtype == DType::f32) return raw;
  Buffer out(DType::f32, Device::cpu, {device.numel()});
  cast(out, raw);
  return out;
}

void poison(Tensor device) {
#if MARROW_CUDA
  // 0xFF bytes are NaN in f32 and bf16, and -1 in i32.
  MARROW_CUDA_CHECK(cudaMemset(device.data, 0xFF, device.bytes()));
#else
  (void)device;
#endif
}

Buffer poisoned(DType dtype, std::initializer_list<int64_t> dims) {
  Buffer b(dtype, Device::cuda, dims);
  poison(b);
  return b;
}

Both::Both(Tensor host, DType dtype) : cpu(host), gpu(host), device_(to_device(host, dtype)) {
  gpu.data = device_.view().data;
  gpu.dtype = dtype;
  gpu.device = Device::cuda;
}

Both::Both(Buffer&& host, DType dtype) : Both(host.view(), dtype) { host_ = std::move(host); }

Both Both::out(DType dtype, std::initializer_list<int64_t> dims) {
  Both t;
  t.host_ = Buffer(dtype == DType::bf16 ? DType::f32 : dtype, Device::cpu, dims);
  t.device_ = poisoned(dtype, dims);
  t.cpu = t.host_.view();
  t.gpu = t.device_.view();
  return t;
}

Buffer random_device(std::initializer_list<int64_t> dims, uint64_t seed, const char* name) {
  Buffer out(DType::bf16, Device::cuda, dims);
  Buffer values(DType::f32, Device::cuda, {out.numel()});
  fill_normal(values, seed, name, 1.0);
  cast(out, values);
  return out;
}

std::vector<int32_t> skewed_counts(int64_t experts, int64_t rows) {
  std::vector<double> weight(static_cast<size_t>(experts));
  for (int64_t g = 0; g < experts; ++g) weight[size_t(g)] = (g % 19 == 7 || g == 3) ? 0.0 : 1.0 / (1.0 + double((g * 37) % experts) / 8.0);
  double total = 0;
  for (double v : weight) total += v;
  std::vector<int32_t> counts(static_cast<size_t>(experts));
  counts[3 % size_t(experts)] = 1;
  int64_t assigned = 1;
  for (int64_t g = 0; g < experts; ++g) {
    if (weight[size_t(g)] == 0) continue;
    counts[size_t(g)] = int32_t(std::floor(double(rows - 1) * weight[size_t(g)] / total));
    assigned += counts[size_t(g)];
  }
  counts[0] += int32_t(rows - assigned);
  return counts;
}

Buffer offsets_host(const std::vector<int32_t>& counts) {
  Buffer b(DType::i32, Device::cpu, {int64_t(counts.size()) + 1});
  b.ptr<int32_t>()[0] = 0;
  for (size_t e = 0; e < counts.size(); ++e) b.ptr<int32_t>()[e + 1] = b.ptr<int32_t>()[e] + counts[e];
  return b;
}

int check_command(int argc, char** argv) {
  MARROW_CHECK(process::size() == 1 || argc >= 3, "marrow check under mpirun runs one group: --only expert_parallel or --only ring_attention");
  CLI::App app{"marrow check: every CUDA op and the model against the CPU reference"};
  std::string only;
  app.add_option("--only", only, "run one group: elementwise, gemm, fp8, attention, linear_attention, model, expert_parallel or ring_attention (these two also under mpirun)")
      ->check(CLI::IsMember({"elementwise", "gemm", "fp8", "attention", "linear_attention", "model", "expert_parallel", "ring_attention"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  MARROW_CHECK(cuda_available(), "check needs a GPU, and {}", MARROW_CUDA ? "none is visible" : "this build has no CUDA support");
  std::printf("%-52s %10s %10s\n", "check", "error", "bound");
  CheckReport report;
  if (only.empty() || only == "elementwise") check_elementwise_ops(report);
  if (only.empty() || only == "gemm") check_gemm_ops(report);
  if (only.empty() || only == "fp8") check_fp8_ops(report);
  if (only.empty() || only == "attention") check_attention_op(report);
  if (only.empty() || only == "linear_attention") {
    check_gated_delta(report);
    check_qwen3_5_ops(report);
  }
  if (only.empty() || only == "model") check_model(report);
  if (only.empty() || only == "expert_parallel") check_expert_parallel(report);
  if (only.empty() || only == "ring_attention") check_ring_attention(report);
  const auto failed = std::count_if(report.rows().begin(), report.rows().end(), [](const CheckRow& r) { return !r.passed; });
  std::printf("%zu checks, %ld failed\n%s\n", report.rows().size(), long(failed), report.passed() ? "PASS" : "FAIL");
  return report.passed() ? 0 : 1;
}

}  // namespace marrow
