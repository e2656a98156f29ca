// Muon's steps before its update (issue #51; Moonlight's and PithTrain's recipe), per 2-D weight
// matrix G [R, C] (an expert's matrix one by one):
//   momentum:      m = beta m + (1 - beta) g,   u = (1 - beta) g + beta m   (Nesterov: torch's two lerps)
//   orthogonalize: X = u / (||u||_F + 1e-7), then `steps` quintic Newton-Schulz iterations
//                  A = X X^T,  B = b A + c A A,  X = a X + B X,   (a, b, c) = (3.4445, -4.7750, 2.0315);
//                  a tall matrix (R > C) iterates X = a X + X B on A = X^T X, the transposed
//                  problem's same algebra, so A is always the smaller Gram matrix.
// The coefficients push every singular value into roughly [0.7, 1.2] in 5 steps rather than to
// exactly 1 (faster than converging: the update only needs its directions). The Frobenius scaling
// makes the spectral norm at most 1, where the iteration is stable.
// GPU: u f32, X, A, B bf16 through cuBLASLt's GEMMs (ops/linear.h: f32 accumulation, one rounding
// a product, as torch's bf16 reference computes them); the norm from the f32 u. CPU: f32 or f64.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace marrow {

inline constexpr double kMuonA = 3.4445, kMuonB = -4.7750, kMuonC = 2.0315;

// update (written), momentum (updated in place) and grad: f32 (CPU also f64) of one element count.
void muon_momentum(Tensor update, Tensor momentum, Tensor grad, double beta, Stream stream = {});

// out [R, C] (bf16 on the GPU; the CPU: update's dtype) = `steps` Newton-Schulz iterations of
// update [R, C] (f32; CPU also f64) scaled to unit Frobenius norm. Scratch: a few [min, min] and one
// [R, C] buffer, allocated here.
void newton_schulz(Tensor out, Tensor update, int steps = 5, Stream stream = {});

}  // namespace marrow
