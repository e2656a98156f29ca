#include "engine/hf_format.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <set>

#include "core/bf16.h"
#include "core/progress.h"
#include "core/safetensors.h"

namespace fs = std::filesystem;

namespace marrow {

namespace {

// The id of a token in a tokenizer.json (added tokens first, then the model's vocabulary), or -1.
int64_t token_id_in(const std::string& tokenizer_json, const std::string& token) {
  const Json t = read_json_file(tokenizer_json);
  for (const Json& added : t.value("added_tokens", Json::array()))
    if (added.value("content", "") == token) return added.value("id", int64_t(-1));
  const Json vocab = t.value("model", Json::object()).value("vocab", Json::object());
  return vocab.contains(token) ? vocab[token].get<int64_t>() : -1;
}

// Parses "model.layers.L.mlp.experts.E.<part>.weight"; false for any other name.
bool parse_expert_name(const std::string& name, std::string& layer_prefix, int64_t& expert, std::string& part) {
  const std::string marker = ".mlp.experts.";
  const size_t at = name.find(marker);
  if (at == std::string::npos || !name.ends_with(".weight")) return false;
  const size_t e_begin = at + marker.size(), e_end = name.find('.', e_begin);
  if (e_end == std::string::npos || e_end == e_begin) return false;
  for (size_t i = e_begin; i < e_end; ++i)
    if (name[i] < '0' || name[i] > '9') return false;
  layer_prefix = name.substr(0, at + marker.size());  // "model.layers.L.mlp.experts."
  expert = std::stoll(name.substr(e_begin, e_end - e_begin));
  part = name.substr(e_end + 1, name.size() - e_end - 1 - 7);  // gate_proj, up_proj or down_proj
  return true;
}

// The fp32 parameters [first, first + n) on the host in `dtype` (f32 or bf16).
Buffer host_in_dtype(const Arena& params, int64_t first, int64_t n, DType dtype) {
  Buffer host = to_host(params.slice(first, {n}));
  if (dtype == DType::f32) return host;
  Buffer out(DType::bf16, Device::cpu, {n});
  float_to_bf16(host.ptr<float>(), static_cast<uint16_t*>(out.view().data), n);
  return out;
}

// The weights in safetensors files of at most options.shard_bytes, and their index.
void write_hf_weights(const std::string& out_dir, const std::vector<TensorSpec>& specs, const Arena& params,
                      const HfExportOptions& options) {
  const size_t element = dtype_size(options.dtype);
  const auto shards = shard_specs(specs, element, options.shard_bytes);
  Json weight_map = Json::object();
  size_t total = 0;
  uint64_t weight_bytes = 0;
  for (const TensorSpec& s : specs) weight_bytes += uint64_t(s.numel) * element;
  Progress progress("writing " + out_dir, weight_bytes, options.progress);
  for (size_t k = 0; k < shards.size(); ++k) {
    const TensorSpec& first = specs[shards[k].first];
    const TensorSpec& last = specs[shards[k].second - 1];
    Buffer out = host_in_dtype(params, first.offset, last.offset + last.numel - first.offset, options.dtype);
    const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, shards.size());
    std::vector<SafetensorsEntry> entries;
    for (size_t i = shards[k].first; i < shards[k].second; ++i) {
      char* data = static_cast<char*>(out.view().data) + size_t(specs[i].offset - first.offset) * element;
      entries.push_back({specs[i].name, host_tensor(data, options.dtype, specs[i].shape)});
      weight_map[specs[i].name] = file;
      total += size_t(specs[i].numel) * element;
    }
    write_safetensors(out_dir + "/" + file, entries, {{"format", "pt"}});
    progress.set(total);
  }
  progress.finish();
  write_json_file(out_dir + "/model.safetensors.index.json", {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}});
}

// config.json, generation_config.json and, with a tokenizer, tokenizer.json and tokenizer_config.json.
void write_hf_configs(const std::string& out_dir, const Json& config, const HfExportOptions& options) {
  Json hf_config = config;
  const char* dtype_text = options.dtype == DType::bf16 ? "bfloat16" : "float32";
  hf_config["torch_dtype"] = dtype_text;
  if (hf_config.contains("dtype")) hf_config["dtype"] = dtype_text;
  write_json_file(out_dir + "/config.json", hf_config);

  const int64_t eos = options.tokenizer.empty() || options.eos_token.empty() ? -1 : token_id_in(options.tokenizer, options.eos_token);
  Json generation = {{"_from_model_config", true}};
  if (eos >= 0) generation["eos_token_id"] = eos;
  write_json_file(out_dir + "/generation_config.json", generation);
  if (options.tokenizer.empty()) return;

  std::error_code ec;
  fs::copy_file(options.tokenizer, out_dir + "/tokenizer.json", fs::copy_options::overwrite_existing, ec);
  MARROW_CHECK(!ec, "cannot copy {} to {}: {}", options.tokenizer, out_dir, ec.message());
  // A generic fast tokenizer: AutoTokenizer loads tokenizer.json as it is.
  Json tokenizer_config = {{"tokenizer_class", "PreTrainedTokenizerFast"}, {"clean_up_tokenization_spaces", false}};
  if (eos >= 0) tokenizer_config["eos_token"] = tokenizer_config["pad_token"] = options.eos_token;
  if (config.contains("max_position_embeddings")) tokenizer_config["model_max_length"] = config["max_position_embeddings"];
  write_json_file(out_dir + "/tokenizer_config.json", tokenizer_config);
}

}  // namespace

void write_hf_model(const std::string& out_dir, const std::vector<TensorSpec>& specs, const Arena& params, const Json& config,
                    const HfExportOptions& options) {
  MARROW_CHECK(options.dtype == DType::f32 || options.dtype == DType::bf16, "export writes f32 or bf16, not {}",
               dtype_name(options.dtype));
  for (const TensorSpec& s : specs)
    MARROW_CHECK(s.canonical_shape.empty(), "internal: export writes whole tensors, but '{}' is a part of one", s.name);
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  MARROW_CHECK(!ec, "cannot create {}: {}", out_dir, ec.message());
  write_hf_weights(out_dir, specs, params, options);
  write_hf_configs(out_dir, config, options);
}

bool is_hf_model_dir(const std::string& dir) {
  return fs::exists(dir + "/config.json") &&
         (fs::exists(dir + "/model.safetensors.index.json") || fs::exists(dir + "/model.safetensors"));
}

namespace {

// The safetensors files of a Hugging Face directory in transformers' order: model.safetensors, else
// those its index names. (save_pretrained leaves a stale one of the two behind when a directory is
// saved once sharded and once not; reading the other would load another model than transformers.)
std::vector<std::string> safetensors_paths(const std::string& dir) {
  const std::string index_path = dir + "/model.safetensors.index.json";
  if (fs::exists(dir + "/model.safetensors")) {
    if (fs::exists(index_path))
      std::fprintf(stderr, "note: %s holds model.safetensors and model.safetensors.index.json; model.safetensors is read, as transformers does\n",
                   dir.c_str());
    return {dir + "/model.safetensors"};
  }
  MARROW_CHECK(fs::exists(index_path), "{} has neither model.safetensors.index.json nor model.safetensors", dir);
  const Json index = read_json_file(index_path);
  MARROW_CHECK(index.contains("weight_map") && index["weight_map"].is_object(), "{}: key 'weight_map' is missing or not an object",
               index_path);
  std::vector<std::string> paths;
  std::set<std::string> seen;
  for (auto& [name, file] : index["weight_map"].items()) {
    MARROW_CHECK(file.is_string(), "{}: weight_map['{}'] must be a file name", index_path, name);
    const std::string path = dir + "/" + file.get<std::string>();
    if (!seen.insert(path).second) continue;
    MARROW_CHECK(fs::exists(path), "{} lists {} but that file is missing", index_path, path);
    paths.push_back(path);
  }
  return paths;
}

// The safetensors tensors of a directory by name.
class HfTensors {
 public:
  explicit HfTensors(const std::string& dir) : dir_(dir), paths_(safetensors_paths(dir)) {
    for (const std::string& path : paths_) {
      files_.push_back(std::make_unique<SafetensorsFile>(path));
      for (const std::string& name : files_.back()->names()) where_[name] = files_.back().get();
    }
  }

  // The model's tensor `s` (a view into its file) and the file: stored under its name, or as expert
  // e's rows of transformers 5's fused experts (gate_up_proj [E, 2I, H], gate rows then up rows;
  // down_proj [E, H, I]).
  std::pair<Tensor, const SafetensorsFile*> find(const TensorSpec& s) {
    if (auto it = where_.find(stored_name(s.name)); it != where_.end()) {
      const std::string& name = it->first;
      const Tensor t = it->second->get(name);
      used_.insert(name);
      const std::vector<int64_t> shape(t.shape.begin(), t.shape.begin() + t.ndim);
      MARROW_CHECK(shape == s.stored_shape(), "{}: tensor '{}' has shape {} but the model's config.json gives {}", it->second->path(),
                   s.name, t.shape_string(), host_tensor(nullptr, t.dtype, s.stored_shape()).shape_string());
      return {host_tensor(static_cast<char*>(t.data) + size_t(s.canonical_first) * dtype_size(t.dtype), t.dtype, s.shape), it->second};
    }
    std::string layer, part;
    int64_t expert = 0;
    if (!s.canonical_shape.empty() || !parse_expert_name(s.name, layer, expert, part) || s.shape.size() != 2)
      fail("{}: tensor '{}' is missing", paths_.size() == 1 ? paths_[0] : dir_ + "/model.safetensors.index.json", s.name);
    const std::string fused = stored_name(layer + (part == "down_proj" ? "down_proj" : "gate_up_proj"));
    auto it = where_.find(fused);
    MARROW_CHECK(it != where_.end(), "{}: tensor '{}' is missing (nor is there a fused '{}')", dir_, s.name, fused);
    const Tensor f = it->second->get(fused);
    const int64_t rows = s.shape[0] * (part == "down_proj" ? 1 : 2);
    MARROW_CHECK(f.ndim == 3 && f.shape[0] > expert && f.shape[1] == rows && f.shape[2] == s.shape[1],
                 "{}: tensor '{}' has shape {}, which does not hold expert {}'s {} of shape {}", it->second->path(), fused,
                 f.shape_string(), expert, part, host_tensor(nullptr, f.dtype, s.shape).shape_string());
    const size_t offset = size_t(expert * rows + (part == "up_proj" ? s.shape[0] : 0)) * size_t(s.shape[1]);
    used_.insert(fused);
    return {host_tensor(static_cast<char*>(f.data) + offset * dtype_size(f.dtype), f.dtype, s.shape), it->second};
  }

  // Whether `s` is stored in MXFP4 (openai/gpt-oss's expert weights on the Hub): s.name + "_blocks",
  // [..., R, G, 16] u8, two E2M1 values a byte, low nibble first, and s.name + "_scales", [..., R, G]
  // u8, each group of 32 values' power of two plus 127, in place of s itself. If so, dst (f32, s's
  // shape [..., 32 G, R]) gets them dequantized and transposed, as transformers dequantizes them
  // (integrations/mxfp4.py): exactly, since every such value is an f32.
  bool read_mxfp4(const TensorSpec& part, Tensor dst) {
    TensorSpec s = part;  // the canonical tensor is dequantized, then part's elements copied
    s.shape = part.stored_shape();
    s.numel = part.stored_numel();
    const std::string blocks_name = s.name + "_blocks", scales_name = s.name + "_scales";
    auto blocks_at = where_.find(blocks_name), scales_at = where_.find(scales_name);
    if (where_.count(s.name) || blocks_at == where_.end() || scales_at == where_.end()) return false;
    const Tensor blocks = blocks_at->second->get(blocks_name), scales = scales_at->second->get(scales_name);
    const std::string path = blocks_at->second->path();
    MARROW_CHECK(blocks.dtype == DType::u8 && scales.dtype == DType::u8, "{}: MXFP4 tensors '{}' and '{}' must be U8, got {} and {}", path,
                 blocks_name, scales_name, dtype_name(blocks.dtype), dtype_name(scales.dtype));
    const int n = int(s.shape.size());
    MARROW_CHECK(n >= 2 && blocks.ndim == n + 1 && scales.ndim == n && blocks.shape[n] == 16, "{}: MXFP4 tensor '{}' has shape {}, not [..., rows, groups, 16] for '{}' {}",
                 path, blocks_name, blocks.shape_string(), s.name, host_tensor(nullptr, DType::f32, s.shape).shape_string());
    const int64_t rows = blocks.shape[n - 2], groups = blocks.shape[n - 1], columns = 32 * groups;
    bool fits = s.shape[size_t(n - 1)] == rows && s.shape[size_t(n - 2)] == columns;
    for (int d = 0; d < n - 2; ++d) fits = fits && blocks.shape[d] == s.shape[size_t(d)];
    for (int d = 0; d < n; ++d) fits = fits && scales.shape[d] == blocks.shape[d];
    MARROW_CHECK(fits, "{}: MXFP4 tensors '{}' {} and '{}' {} do not dequantize to '{}' {}", path, blocks_name, blocks.shape_string(),
                 scales_name, scales.shape_string(), s.name, host_tensor(nullptr, DType::f32, s.shape).shape_string());
    static constexpr float kE2M1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
    const auto* b = static_cast<const uint8_t*>(blocks.data);
    const auto* e = static_cast<const uint8_t*>(scales.data);
    Buffer out(DType::f32, Device::cpu, {s.numel});
    float* o = out.ptr<float>();
    const int64_t outer = s.numel / (rows * columns);
    for (int64_t p = 0; p < outer; ++p)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g) {
          const int exponent = int(e[(p * rows + r) * groups + g]) - 127;
          const uint8_t* bytes = b + ((p * rows + r) * groups + g) * 16;
          for (int64_t k = 0; k < 16; ++k)
            for (int64_t half = 0; half < 2; ++half) {
              const int64_t c = g * 32 + 2 * k + half;
              o[(p * columns + c) * rows + r] = std::ldexp(kE2M1[half ? bytes[k] >> 4 : bytes[k] & 15], exponent);
            }
        }
    copy(dst, out.view().rows(part.canonical_first, part.canonical_first + part.numel));
    used_.insert(blocks_name);
    used_.insert(scales_name);
    return true;
  }

  // A model tensor's name in the files: as it is, or a multimodal checkpoint's text tower's
  // (Qwen3.5-MoE's model.language_model.* for model.*) when only that is stored.
  std::string stored_name(const std::string& name) const {
    if (where_.count(name) || !name.starts_with("model.")) return name;
    const std::string tower = "model.language_model." + name.substr(6);
    return where_.count(tower) ? tower : name;
  }

  // A note naming one of the tensors no find() asked for.
  void note_unused() const {
    if (used_.size() >= where_.size()) return;
    for (auto& [name, f] : where_)
      if (!used_.count(name)) {
        std::fprintf(stderr, "note: %s: %zu tensors that the model does not use were ignored, e.g. '%s'\n", dir_.c_str(),
                     where_.size() - used_.size(), name.c_str());
        return;
      }
  }

 private:
  std::string dir_;
  std::vector<std::string> paths_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
  std::set<std::string> used_;
};

// dst (f32) = t, an f32 or bf16 tensor of `file`.
void copy_as_f32(Tensor dst, Tensor t, const SafetensorsFile& file, const std::string& name) {
  const int64_t n = dst.numel();
  if (t.dtype == DType::f32) {
    copy(dst, t.reshape({n}));
  } else if (t.dtype == DType::bf16) {
    Buffer f32(DType::f32, Device::cpu, {n});
    bf16_to_float(static_cast<const uint16_t*>(t.data), f32.ptr<float>(), n);
    copy(dst, f32);
  } else {
    fail("{}: tensor '{}' is {}; Marrow reads f32 and bf16 weights", file.path(), name, dtype_name(t.dtype));
  }
}

}  // namespace

void read_hf_weights(const std::string& dir, const std::vector<TensorSpec>& specs, const Arena& params, bool show_progress) {
  HfTensors tensors(dir);
  uint64_t weight_bytes = 0;  // counted as the fp32 parameters they become
  for (const TensorSpec& s : specs) weight_bytes += uint64_t(s.numel) * sizeof(float);
  Progress progress("reading " + dir, weight_bytes, show_progress);
  for (const TensorSpec& s : specs) {
    if (!tensors.read_mxfp4(s, params.slice(s.offset, {s.numel}))) {
      const auto [t, file] = tensors.find(s);
      copy_as_f32(params.slice(s.offset, {s.numel}), t, *file, s.name);
    }
    progress.add(uint64_t(s.numel) * sizeof(float));
  }
  progress.finish();
  tensors.note_unused();
}

}  // namespace marrow
