// One tensor of a model's canonical parameter table: its Hugging Face name, global shape and place
// in the arenas (parameters, gradients, optimizer state share one layout). Models build the table;
// the engine's checkpoint and export code walks it without knowing the model.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace marrow {

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in elements
  int64_t numel = 0;
  bool is_norm = false;  // RMSNorm weights: initialised to 1, no weight decay
  // AdamW's weight decay applies: matrices and embeddings, not norms, biases and sinks (as Megatron-LM
  // exempts every 1-D parameter).
  bool decayed = true;
  // Muon's (optimizer.kind = "muon"): a hidden layer's matrix, or [count, rows, cols] of them; the
  // embeddings, the LM head and the router stay with AdamW as norms, biases and sinks do.
  bool orthogonalized = false;
  // A step's first backward writes this gradient instead of adding to it (the expert weights, the
  // bulk of the arena; the LM head), so the trainer zeroes only the others (slotted units: every
  // micro-batch writes, ShardedParameters::first_writes_fresh).
  bool first_backward_writes = false;
  // Held by one expert-parallel rank (ExpertShard): summed over its data-parallel replicas only.
  bool is_expert = false;
  // The stage whose backward completes its gradient: decoder layer 0..L-1, L the epilog, -1 the
  // prolog; its reduction can start once the last micro-batch's backward has passed it.
  int64_t layer = -1;
  // Where a part of a canonical tensor lies in it (GPT-OSS's fused experts under expert
  // parallelism): elements [canonical_first, canonical_first + numel). Empty: the whole tensor.
  // Checkpoints, Hugging Face reads and initialisation address the canonical tensor.
  std::vector<int64_t> canonical_shape;
  int64_t canonical_first = 0;

  const std::vector<int64_t>& stored_shape() const { return canonical_shape.empty() ? shape : canonical_shape; }
  int64_t stored_numel() const {
    int64_t n = 1;
    for (int64_t d : stored_shape()) n *= d;
    return n;
  }
};

// A slice of one canonical tensor held in an arena: elements [first, first + count) of the flat
// tensor specs[spec] live at element `offset` of the arena.
struct TensorPiece {
  size_t spec = 0;
  int64_t first = 0, count = 0, offset = 0;
};

// The experts of each layer that one process holds: [first, first + count); count < 0 means all.
struct ExpertShard {
  int64_t first = 0, count = -1;
};

// Cuts a run of items of the given element counts into files of at most max_bytes at
// element_bytes per element (an item larger than that gets a file of its own): the [first, last)
// item ranges, in order.
inline std::vector<std::pair<size_t, size_t>> cut_into_files(const std::vector<int64_t>& counts, size_t element_bytes, size_t max_bytes) {
  std::vector<std::pair<size_t, size_t>> files;
  size_t bytes = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const size_t b = size_t(counts[i]) * element_bytes;
    if (files.empty() || (bytes > 0 && bytes + b > max_bytes)) {
      files.push_back({i, i});
      bytes = 0;
    }
    files.back().second = i + 1;
    bytes += b;
  }
  return files;
}

// The same for the tensors of a table.
inline std::vector<std::pair<size_t, size_t>> shard_specs(const std::vector<TensorSpec>& specs, size_t element_bytes,
                                                          size_t max_bytes) {
  std::vector<int64_t> counts;
  for (const TensorSpec& s : specs) counts.push_back(s.numel);
  return cut_into_files(counts, element_bytes, max_bytes);
}

}  // namespace marrow
