#include "parallel/sequence_chain.h"

#include "core/memory.h"
#include "ops/add.h"
#include "parallel/comm.h"

namespace marrow {

namespace {

// Where chunks sit: chunk j of 2 CP, its holder and the holder's piece.
struct ChunkPlace {
  int rank, ranks;
  int64_t chunk(int64_t piece) const { return piece == 0 ? rank : 2 * ranks - 1 - rank; }
  int holder(int64_t chunk) const { return int(chunk < ranks ? chunk : 2 * ranks - 1 - chunk); }
  bool mine(int64_t chunk) const { return holder(chunk) == rank; }
  int64_t last() const { return 2 * ranks - 1; }
};

// Piece p's rows of t [2 N, ...].
Tensor piece_rows(Tensor t, int64_t p) {
  MARROW_CHECK(t.ndim >= 1 && t.size(0) % 2 == 0, "sequence chain: states of shape {} are not two pieces' rows", t.shape_string());
  const int64_t n = t.size(0) / 2;
  return t.rows(p * n, (p + 1) * n);
}

// One state's buffer, seen as `like`.
Tensor shaped_as(const Buffer& b, Tensor like) {
  like.data = b.view().data;
  return like;
}

void chain_forward(const Comm& cp, Tensor initial, const std::function<void(int64_t, Tensor)>& step) {
  const ChunkPlace at{cp.rank(), cp.size()};
  const Buffer state(initial.dtype, initial.device, {initial.numel() / 2});
  const Tensor final = shaped_as(state, piece_rows(initial, 0));
  for (int64_t p = 0; p < 2; ++p) {
    const int64_t j = at.chunk(p);
    if (j == 0) fill_zero(piece_rows(initial, p));
    else if (!at.mine(j - 1)) cp.send_recv({}, -1, piece_rows(initial, p), at.holder(j - 1), "sequence chain (state)");
    step(p, final);
    if (j == at.last()) continue;
    if (at.mine(j + 1)) copy(piece_rows(initial, 1), final);
    else cp.send_recv(final, at.holder(j + 1), {}, -1, "sequence chain (state)");
  }
}

void chain_backward(const Comm& cp, Tensor d_final, const std::function<void(int64_t, Tensor)>& step) {
  const ChunkPlace at{cp.rank(), cp.size()};
  const Buffer state(d_final.dtype, d_final.device, {d_final.numel() / 2});
  const Tensor d_initial = shaped_as(state, piece_rows(d_final, 0));
  for (int64_t p = 1; p >= 0; --p) {
    const int64_t j = at.chunk(p);
    if (j == at.last()) fill_zero(piece_rows(d_final, p));
    else if (!at.mine(j + 1)) cp.send_recv({}, -1, piece_rows(d_final, p), at.holder(j + 1), "sequence chain (state gradient)");
    step(p, d_initial);
    if (j == 0) continue;
    if (at.mine(j - 1)) copy(piece_rows(d_final, 0), d_initial);
    else cp.send_recv(d_initial, at.holder(j - 1), {}, -1, "sequence chain (state gradient)");
  }
}

// The last n tokens of every sequence's piece p of x [B, 2 c, F] into tail [B, n, F], or (back = true)
// tail added to them.
void piece_tails(Tensor tail, Tensor x, int64_t p, bool back) {
  const int64_t B = x.size(0), c = x.size(1) / 2, n = tail.size(1), F = x.numel() / (B * 2 * c);
  const Tensor rows = x.reshape({B * 2 * c, F}), ends = tail.reshape({B * n, F});
  for (int64_t b = 0; b < B; ++b) {
    const Tensor here = rows.rows(b * 2 * c + p * c + c - n, b * 2 * c + (p + 1) * c), there = ends.rows(b * n, (b + 1) * n);
    if (back) add(here, here, there);
    else copy(there, here);
  }
}

// history [B, 2, n, F]'s piece p to or from part [B, n, F].
void history_part(Tensor history, Tensor part, int64_t p, bool into_history) {
  const int64_t B = history.size(0), n = history.size(2), F = history.numel() / (B * 2 * n);
  const Tensor h = history.reshape({B * 2 * n, F}), q = part.reshape({B * n, F});
  for (int64_t b = 0; b < B; ++b) {
    const Tensor slot = h.rows((b * 2 + p) * n, (b * 2 + p + 1) * n), rows = q.rows(b * n, (b + 1) * n);
    if (into_history) copy(slot, rows);
    else copy(rows, slot);
  }
}

void check_history(const char* op, Tensor history, Tensor x) {
  MARROW_CHECK(x.ndim >= 2 && x.size(1) % 2 == 0 && history.ndim == 4 && history.size(0) == x.size(0) && history.size(1) == 2 &&
                   history.size(2) <= x.size(1) / 2 && history.numel() == x.size(0) * 2 * history.size(2) * (x.numel() / (x.size(0) * x.size(1))) &&
                   history.dtype == x.dtype,
               "{}: history {} does not hold n tokens before each of two pieces of x {}", op, history.shape_string(), x.shape_string());
}

// Each piece's history is the previous chunk's tail: piece 0's (chunk r - 1) comes from member r - 1's
// piece 0, piece 1's (chunk 2 CP - 2 - r) from member r + 1's piece 1, or on member CP - 1 its own piece 0.
void previous_tokens(const Comm& cp, Tensor history, Tensor x) {
  check_history("previous_tokens", history, x);
  const int r = cp.rank(), R = cp.size();
  const int64_t B = x.size(0), n = history.size(2), F = x.numel() / (B * x.size(1));
  const Buffer tail(x.dtype, x.device, {B, n, F}), got(x.dtype, x.device, {B, n, F});
  piece_tails(tail, x, 0, false);
  if (r == 0) fill_zero(got);
  cp.send_recv(r + 1 < R ? tail.view() : Tensor{}, r + 1, r > 0 ? got.view() : Tensor{}, r - 1, "previous tokens");
  history_part(history, got, 0, true);
  if (r + 1 == R) history_part(history, tail, 1, true);
  piece_tails(tail, x, 1, false);
  cp.send_recv(r > 0 ? tail.view() : Tensor{}, r - 1, r + 1 < R ? got.view() : Tensor{}, r + 1, "previous tokens");
  if (r + 1 < R) history_part(history, got, 1, true);
}

// The reverse of previous_tokens: each piece's history gradient goes back to the tail it was read from.
void previous_tokens_backward(const Comm& cp, Tensor dx, Tensor dhistory) {
  check_history("previous_tokens_backward", dhistory, dx);
  const int r = cp.rank(), R = cp.size();
  const int64_t B = dx.size(0), n = dhistory.size(2), F = dx.numel() / (B * dx.size(1));
  const Buffer part(dx.dtype, dx.device, {B, n, F}), got(dx.dtype, dx.device, {B, n, F});
  history_part(dhistory, part, 0, false);
  cp.send_recv(r > 0 ? part.view() : Tensor{}, r - 1, r + 1 < R ? got.view() : Tensor{}, r + 1, "previous tokens (gradient)");
  if (r + 1 < R) piece_tails(got, dx, 0, true);
  history_part(dhistory, part, 1, false);
  if (r + 1 == R) piece_tails(part, dx, 0, true);
  cp.send_recv(r + 1 < R ? part.view() : Tensor{}, r + 1, r > 0 ? got.view() : Tensor{}, r - 1, "previous tokens (gradient)");
  if (r > 0) piece_tails(got, dx, 1, true);
}

}  // namespace

SequenceChain sequence_chain(const Comm& cp) {
  return {2, [&cp](Tensor initial, const std::function<void(int64_t, Tensor)>& step) { chain_forward(cp, initial, step); },
          [&cp](Tensor d_final, const std::function<void(int64_t, Tensor)>& step) { chain_backward(cp, d_final, step); },
          [&cp](Tensor history, Tensor x) { previous_tokens(cp, history, x); },
          [&cp](Tensor dx, Tensor dhistory) { previous_tokens_backward(cp, dx, dhistory); }};
}

}  // namespace marrow
