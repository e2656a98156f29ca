// Muon (optimizer.kind = "muon"; Moonlight's and PithTrain's recipe), per 2-D weight matrix G [R, C]
// (an expert's matrix one by one), with g = grad * grad_scale (clipping folded in):
//   momentum:      m = beta m + (1 - beta) g,   u = (1 - beta) g + beta m   (Nesterov: torch's two lerps)
//   orthogonalize: X = u / (||u||_F + 1e-7), then `steps` quintic Newton-Schulz iterations
//                  A = X X^T,  B = b A + c A A,  X = a X + B X,   (a, b, c) = (3.4445, -4.7750, 2.0315);
//                  a tall matrix (R > C) iterates X = a X + X B on A = X^T X, the transposed
//                  problem's same algebra, so A is always the smaller Gram matrix.
// The coefficients push every singular value into roughly [0.7, 1.2] in 5 steps rather than to
// exactly 1 (faster than converging: the update only needs its directions). The Frobenius scaling
// makes the spectral norm at most 1, where the iteration is stable.
//   apply:         param = param (1 - lr weight_decay) - lr scale O,   scale = 0.2 sqrt(max(R, C)) by default
//                  (Moonlight's rule: the update's RMS near AdamW's, so both share one lr)
// GPU: u f32, X, A, B bf16 through cuBLASLt's GEMMs (ops/linear.h: f32 accumulation, one rounding
// a product, as torch's bf16 reference computes them); the norm from the f32 u. CPU: f32 or f64.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace marrow {

inline constexpr double kMuonA = 3.4445, kMuonB = -4.7750, kMuonC = 2.0315;

// update (written), momentum (updated in place) and grad: f32 (CPU also f64) of one element count.
void muon_momentum(Tensor update, Tensor momentum, Tensor grad, double beta, double grad_scale = 1, Stream stream = {});

// out [R, C] (bf16 on the GPU; the CPU: update's dtype) = `steps` Newton-Schulz iterations of
// update [R, C] (f32; CPU also f64) scaled to unit Frobenius norm; [B, R, C]: B matrices, each on its
// own (one batched GEMM a product on the GPU). Scratch: a few [B, min, min] and one [B, R, C] buffer.
void newton_schulz(Tensor out, Tensor update, int steps = 5, Stream stream = {});

// param -= param lr weight_decay + lr scale orth, for master weights as ops/adamw.h keeps them:
// param f32 (param_bf16, when given, receives the result rounded), or split (param u16 low halves,
// param_bf16 high halves). orth: newton_schulz's out (bf16 on the GPU, f32 on the CPU), any dtype of
// those two. One element count. The same bits on CPU and GPU.
void muon_apply(Tensor param, Tensor param_bf16, Tensor orth, double lr, double weight_decay, double scale, Stream stream = {});

}  // namespace marrow
