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
  // AdamW's weight decay applies to it: matrices and embeddings. Norms, biases and GPT-OSS's sinks
  // (vectors added to or scaling activations) are exempt, as Megatron-LM exempts every 1-D parameter
  // (Hugging Face's Trainer exempts norms and biases, and decays the sinks).
  bool decayed = true;
  // The backward of a step's first micro-batch writes this gradient instead of adding to it (the
  // expert weights: their fp32 gradients are the bulk of the arena; the LM head, as large as the
  // embedding), so the trainer zeroes only the other gradients before a step. Decoder layers' such
  // gradients are written by every micro-batch where their unit is reduced after each (slots:
  // ShardedParameters::first_writes_fresh); the epilog's are kept whole in every layout, so written
  // by micro-batch 0 (BackwardPass::Options::first_of_step).
  bool first_backward_writes = false;
  // One expert's weight: held by one expert-parallel rank (ExpertShard), so its gradient is summed
  // over that rank's data-parallel replicas only, and that rank saves it.
  bool is_expert = false;
  // The stage whose backward completes its gradient: decoder layer 0..L-1, L for the epilog (LM
  // head, final norm), -1 for the prolog (embedding). Once the last micro-batch's backward has passed
  // that stage, the gradient's reduction over processes can start while the stages below compute.
  int64_t layer = -1;
  // Where this tensor lies in the model's canonical tensor of its name, when it holds a part of it:
  // GPT-OSS's fused experts [E, ...] under expert parallelism hold one rank's experts, the canonical
  // tensor's elements [canonical_first, canonical_first + numel). Empty: the whole canonical tensor.
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
// tensor specs[spec] live at element `offset` of the arena. A process holding whole tensors has one
// piece per spec (first 0, count numel, offset spec.offset); a shard of a fully sharded run holds
// slices.
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
