// Softmax cross entropy of next-token logits against target ids, one loss per token:
//   lse[t] = log sum_v exp(logits[t, v]),   token_loss[t] = lse[t] - logits[t, targets[t]].
// A target of kIgnoreIndex (-100, PyTorch's and Hugging Face's convention, e.g. for padding) gives
// loss 0 and a zero gradient row; the caller reduces token_loss and passes the matching scale
// (typically 1 / number of counted tokens) to the backward. On the GPU (logits, dlogits bf16;
// token_loss, lse f32) targets are not checked on the host: a bad one gives a NaN loss and row.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace marrow {

constexpr int32_t kIgnoreIndex = -100;

// token_loss[T] and lse[T] (saved for the backward) from logits[T, V] and targets[T] (i32). A
// target outside [0, V) other than kIgnoreIndex is an Error naming its position and value, checked
// before anything is written.
void cross_entropy_forward(Tensor token_loss, Tensor lse, Tensor logits, Tensor targets, Stream stream = {});

// dlogits[T, V] = scale * (softmax(logits) - onehot(target)), overwritten; zero rows where the
// target is kIgnoreIndex. dlogits may alias logits, so the logits need not be kept twice.
void cross_entropy_backward(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, double scale,
                            Stream stream = {});

}  // namespace marrow
