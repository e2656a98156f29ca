// Hugging Face model directories (DESIGN.md §6), written by `marrow export`, read by import and sample:
//   config.json, generation_config.json
//   model-0000k-of-0000n.safetensors + model.safetensors.index.json   the weights, fp32 or bf16
//   tokenizer.json + tokenizer_config.json                            when the model has a tokenizer
// Reading also takes a single model.safetensors, a layer's fused experts in place of per-expert
// tensors, and MXFP4 tensors (<name>_blocks and _scales, openai/gpt-oss's), dequantized exactly.
#pragma once
#include <string>
#include <vector>

#include "core/json.h"
#include "core/memory.h"
#include "core/tensor_spec.h"

namespace marrow {

struct HfExportOptions {
  DType dtype = DType::f32;                 // f32 or bf16 (rounded to nearest even)
  size_t shard_bytes = size_t(2) << 30;     // a new shard starts before this size is exceeded
  std::string tokenizer;                    // tokenizer.json to copy, "" for none
  std::string eos_token;                    // end-of-text token for tokenizer_config and generation_config
  bool progress = false;                    // a progress line when the writing is slow (core/progress.h)
};

// Writes the model directory into out_dir (created if needed) from a parameter arena on any device.
void write_hf_model(const std::string& out_dir, const std::vector<TensorSpec>& specs, const Arena& params, const Json& config,
                    const HfExportOptions& options);

// Whether dir looks like a Hugging Face model directory (config.json and safetensors weights).
bool is_hf_model_dir(const std::string& dir);

// Fills a parameter arena (any device) from the directory's safetensors, converting bf16 to fp32;
// a missing tensor, a wrong shape or an unsupported dtype is an Error naming the file and tensor.
void read_hf_weights(const std::string& dir, const std::vector<TensorSpec>& specs, const Arena& params, bool progress = false);

}  // namespace marrow
