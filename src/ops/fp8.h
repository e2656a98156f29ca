// FP8 E4M3 block quantization, the recipe of DeepSeek-V3 with power-of-two scales (as PithTrain runs
// it on Hopper): a block of values is divided by its scale and rounded to E4M3 (to nearest even,
// saturating at +-448), so that block * scale is the dequantized value.
//   rows:   1 x 128 blocks (one row, 128 columns): activations and output gradients, x[R, C].
//   blocks: 128 x 128 blocks of each matrix of weight[E, O, I], and optionally the same bytes
//           transposed, [E, I, O], which is the weight of the backward input (dx = dy W needs W with
//           the contracted dimension O innermost: FP8 wgmma reads only K-major operands).
// A block's scale is the smallest power of two s with amax / s <= 448 (1 for an all-zero block), so
// the division is exact, the block's largest value lands in (224, 448] and only the rounding to E4M3
// loses anything; a block holding an infinity or NaN gets a NaN scale, so what it feeds is NaN and
// the step is skipped as non-finite, never trained on silently. Edges: the last block of a row or
// matrix covers what is left. The GPU and the CPU give the same bytes and scales, bit for bit.
// Scales are f32:
//   rows:   [ceil(C / 128), R]  (block column major: the rows of one column block are contiguous)
//   blocks: [E, ceil(O / 128), ceil(I / 128)], transposed [E, ceil(I / 128), ceil(O / 128)].
// Inputs are bf16 or f32 on either device; values are fp8_e4m3 tensors of the input's shape.
#pragma once
#include <cstdint>

#include "core/memory.h"
#include "core/tensor.h"

namespace marrow {

constexpr int64_t kFp8Block = 128;
constexpr float kFp8Max = 448.0f;
// The blocks (of 128) along a dimension of n.
inline int64_t fp8_blocks(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }

// The E4M3 byte of v (round to nearest even, +-448 at most, NaN for NaN) and the value of a byte.
uint8_t fp8_e4m3_from_float(float v);
float fp8_e4m3_to_float(uint8_t byte);

// The power-of-two scale of a block whose largest magnitude is amax (NaN if amax is not finite).
float fp8_block_scale(float amax);

// An FP8 tensor and its block scales.
struct Fp8Tensor {
  Tensor values, scales;
};

// The same with its memory, shaped for quantize_rows of [r, c] or quantize_blocks of [e, o, i].
struct Fp8Buffer {
  Buffer values, scales;
  Fp8Tensor view() const { return {values.view(), scales.view()}; }
  static Fp8Buffer rows(Device device, int64_t r, int64_t c, Stream stream = {});
  static Fp8Buffer blocks(Device device, int64_t e, int64_t o, int64_t i, Stream stream = {});
};

// values[R, C], scales[ceil(C / 128), R] from x[R, C].
void quantize_rows(Fp8Tensor out, Tensor x, Stream stream = {});

// values[E, O, I], scales[E, ceil(O / 128), ceil(I / 128)] from weight[E, O, I]; transposed, when
// its values are given: values[E, I, O], scales[E, ceil(I / 128), ceil(O / 128)].
void quantize_blocks(Fp8Tensor out, Fp8Tensor transposed, Tensor weight, Stream stream = {});

// The f32 values the quantized tensors stand for (CPU only: references and the CPU path).
void dequantize_rows(Tensor out, Fp8Tensor in);
void dequantize_blocks(Tensor out, Fp8Tensor in);

}  // namespace marrow
