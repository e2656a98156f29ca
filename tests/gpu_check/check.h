// marrow check: every CUDA op against its fp32 CPU reference on fresh random inputs, one table row
// per comparison, then PASS or FAIL. Each group of ops has a function in its own check_*.cpp file;
// check.cpp calls them in turn. The helpers here move data between the CPU reference (f32) and
// the GPU path (bf16 activations), poison outputs so unwritten elements show, and measure error.
// A check is written once for both sides: `Both` holds a tensor's CPU and GPU copies, and
// on_each_side runs the op's call on [0] (the CPU) and [1] (the GPU).
#pragma once
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/memory.h"

namespace marrow {

struct CheckRow {
  std::string name;
  double error = 0;  // max |gpu - cpu| / max |cpu| over the tensor
  double bound = 0;
  bool passed = false;
};

// One tensor on both sides, of one shape: [0] the CPU's (host; f32 where the GPU's is bf16), [1] the
// GPU's (device, in the GPU's dtype).
class Both {
 public:
  // A device copy of host in dtype; the caller keeps host alive.
  Both(Tensor host, DType dtype);
  // The same, holding host.
  Both(Buffer&& host, DType dtype);
  // An output: unwritten on the host, poisoned on the GPU.
  static Both out(DType dtype, std::initializer_list<int64_t> dims);
  Tensor operator[](int side) const { return side ? gpu : cpu; }
  Tensor cpu, gpu;

 private:
  Both() = default;
  Buffer host_, device_;
};

// Whether the call refuses its input (throws marrow's Error).
template <class Call>
bool refuses(const Call& call) {
  try {
    call();
  } catch (const Error&) {
    return true;
  }
  return false;
}

// Runs op(0) on the CPU's tensors, then op(1) on the GPU's.
template <class Op>
void on_each_side(const Op& op) {
  op(0);
  op(1);
}

class CheckReport {
 public:
  // Compares a GPU result (any float dtype, any device) with the CPU reference (f32 host).
  void compare(const std::string& name, Tensor gpu, Tensor cpu, double bound);
  void compare(const std::string& name, const Both& t, double bound) { compare(name, t.gpu, t.cpu, bound); }
  // A comparison of exact data (indices, offsets): any difference fails.
  void expect_equal(const std::string& name, Tensor gpu, Tensor cpu);
  void expect_equal(const std::string& name, const Both& t) { expect_equal(name, t.gpu, t.cpu); }
  // Two GPU results of the same bits.
  void expect_same_bits(const std::string& name, Tensor gpu, Tensor gpu_reference) { expect_equal(name, gpu, to_host(gpu_reference)); }
  // A row whose error is the number of non-finite elements (poison that no kernel overwrote).
  void expect_finite(const std::string& name, Tensor gpu);
  // A row of a yes/no fact (an op refused bad input, a kernel was chosen).
  void expect(const std::string& name, bool holds) { add({name, holds ? 0.0 : 1.0, 0.0, holds}); }
  void add(CheckRow row);
  bool passed() const;
  const std::vector<CheckRow>& rows() const { return rows_; }

 private:
  std::vector<CheckRow> rows_;
};

// Host f32 tensor of normal(0, scale) values drawn from (seed, index).
Buffer random_host(std::initializer_list<int64_t> dims, uint64_t seed, double scale = 1.0);
// The same values rounded to bf16, so that the CPU reference sees exactly the GPU's inputs.
Buffer random_bf16(std::initializer_list<int64_t> dims, uint64_t seed, double scale = 1.0);
// The host tensor rounded through bf16 and back: the CPU reference sees exactly the GPU's inputs.
void round_to_bf16(Tensor host_f32);
// A device copy of a host tensor, cast to dtype (bf16 or f32; i32 copies as is).
Buffer to_device(Tensor host, DType dtype);
// A host f32 copy of a device float tensor (bf16 or f32), shaped like it.
Buffer to_host_f32(Tensor device);
// Fills a device tensor with NaN (floats) or -1 (integers), so elements a kernel fails to write show.
void poison(Tensor device);
// A device tensor of the given dtype and shape, poisoned.
Buffer poisoned(DType dtype, std::initializer_list<int64_t> dims);

// A device bf16 tensor of N(0, 1) values drawn on the GPU from (seed, name): for bench-sized inputs
// that would take the CPU too long to draw.
Buffer random_device(std::initializer_list<int64_t> dims, uint64_t seed, const char* name);
// Rows per expert as skewed as real routing: a few experts empty, one with a single row, the rest
// falling off with the expert's rank; they sum to rows.
std::vector<int32_t> skewed_counts(int64_t experts, int64_t rows);
// Host i32 offsets [E + 1] from per-expert row counts.
Buffer offsets_host(const std::vector<int32_t>& counts);

void check_elementwise_ops(CheckReport& report);
void check_mla_ops(CheckReport& report);  // DeepSeek-V2's ops (check_mla.cpp), run with the elementwise group
void check_gemm_ops(CheckReport& report);
// Qwen3.5-MoE's ops (--only linear_attention): the gated delta rule (check_gated_delta.cpp) and the
// layer's elementwise ops (check_qwen3_5_ops.cpp: convolution, gates, gated norm).
void check_gated_delta(CheckReport& report);
void check_qwen3_5_ops(CheckReport& report);
void check_fp8_ops(CheckReport& report);
void check_attention_op(CheckReport& report);
void check_model(CheckReport& report);
// Under mpirun -np P (any P, also 1): the expert-parallel all-to-alls and the collectives over NCCL
// (check_parallel.cpp).
void check_expert_parallel(CheckReport& report);
class Comm;
// Every collective of parallel/comm.h on tensors of `device` against exactly known results.
void check_collectives(CheckReport& report, const Comm& group, Device device);
// Under mpirun -np P (P = 1 too): ring attention over the job's GPUs (check_ring_attention.cpp).
void check_ring_attention(CheckReport& report);
// A row that fails when any rank of world has a failed row (rank 0 alone prints the table).
void add_failed_rows_of_all_ranks(CheckReport& report, const Comm& world, const char* group);

}  // namespace marrow
