// Checkpoints and Hugging Face directories (engine/checkpoint.h, engine/hf_format.h): round trips
// are bitwise, leftovers of killed saves are never picked, and every damaged file is named.
#include "engine/checkpoint.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/bf16.h"
#include "core/safetensors.h"
#include "data_test_util.h"
#include "engine/hf_format.h"
#include "models/qwen3_moe.h"
#include "ops/init.h"

namespace marrow {
namespace {

namespace fs = std::filesystem;
using data_testing::error_of;
using data_testing::ScratchDir;

Json tiny_json(int64_t hidden = 16) {
  return Json{{"model_type", "qwen3_moe"},  {"architectures", {"Qwen3MoeForCausalLM"}},
              {"vocab_size", 40},           {"hidden_size", hidden},
              {"num_hidden_layers", 2},     {"num_attention_heads", 4},
              {"num_key_value_heads", 2},   {"head_dim", 8},
              {"num_experts", 4},           {"num_experts_per_tok", 2},
              {"moe_intermediate_size", 12}, {"norm_topk_prob", true},
              {"rope_theta", 10000.0},      {"rms_norm_eps", 1e-6}};
}

struct Tiny {
  Json json;
  Qwen3Moe model;
  Arena params, exp_avg, exp_avg_sq;
  explicit Tiny(int64_t hidden = 16, uint64_t seed = 7)
      : json(tiny_json(hidden)),
        model(Qwen3MoeConfig::from_json(json, "tiny.json"), DType::f32, Device::cpu),
        params("parameters", DType::f32, Device::cpu, model.num_parameters()),
        exp_avg("exp_avg", DType::f32, Device::cpu, model.num_parameters()),
        exp_avg_sq("exp_avg_sq", DType::f32, Device::cpu, model.num_parameters()) {
    model.initialize(params, seed);
    fill_normal(exp_avg.all(), seed + 1, "m", 1.0);
    fill_normal(exp_avg_sq.all(), seed + 2, "v", 1.0);
  }
  CheckpointArenas arenas() const { return {&params, &exp_avg, &exp_avg_sq}; }
};

bool same_bits(const Arena& a, const Arena& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.all().data, b.all().data, a.bytes()) == 0;
}

// A checkpoint with several files per group (small shards), written into dir/step-00000003.
std::string save_tiny(const Tiny& t, const std::string& run_dir, int64_t step = 3) {
  const std::string dir = run_dir + "/" + checkpoint_name(step);
  write_checkpoint(dir, t.model.specs(), t.arenas(), Json{{"step", step}, {"model_config", t.json}}, t.json, "", 4096);
  return dir;
}

// Arenas of bf16 moments (optimizer.moments = bf16) are saved as bf16 and read back bit for bit; a
// run with fp32 moments reads the same files widened exactly.
TEST(Checkpoint, Bf16MomentsAreSavedAsBf16AndReadIntoEitherDtype) {
  ScratchDir tmp;
  Tiny a;
  const int64_t n = a.model.num_parameters();
  Arena m16("exp_avg", DType::bf16, Device::cpu, n), v16("exp_avg_sq", DType::bf16, Device::cpu, n);
  for (int64_t i = 0; i < n; ++i) {
    static_cast<uint16_t*>(m16.all().data)[i] = float_to_bf16(a.exp_avg.all().ptr<float>()[i]);
    static_cast<uint16_t*>(v16.all().data)[i] = float_to_bf16(a.exp_avg_sq.all().ptr<float>()[i]);
  }
  const std::string dir = tmp.path() + "/" + checkpoint_name(3);
  write_checkpoint(dir, a.model.specs(), {&a.params, &m16, &v16}, Json{{"step", 3}, {"model_config", a.json}}, a.json, "", 4096);
  const Checkpoint c = open_checkpoint(dir);
  verify_checkpoint(c);
  SafetensorsFile moments(dir + "/exp_avg-00001-of-" + fmt::format("{:05d}", [&] {
                            int files = 0;
                            for (const auto& e : fs::directory_iterator(dir)) files += e.path().filename().string().starts_with("exp_avg-");
                            return files;
                          }()) + ".safetensors");
  EXPECT_EQ(moments.get(moments.names().front()).dtype, DType::bf16);

  Tiny b(16, 99);
  Arena m16_back("exp_avg", DType::bf16, Device::cpu, n);
  load_checkpoint_tensors(c, "exp_avg", b.model.specs(), m16_back);
  EXPECT_TRUE(same_bits(m16, m16_back));
  load_checkpoint_tensors(c, "exp_avg_sq", b.model.specs(), b.exp_avg_sq);  // into fp32: widened
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(b.exp_avg_sq.all().ptr<float>()[i], bf16_to_float(static_cast<uint16_t*>(v16.all().data)[i])) << i;
  load_checkpoint_tensors(c, "weights", b.model.specs(), b.params);
  EXPECT_TRUE(same_bits(a.params, b.params));

  // Weights are fp32 in every checkpoint: a bf16 weights file is refused, naming it.
  const std::string bad = tmp.path() + "/" + checkpoint_name(4);
  write_checkpoint(bad, a.model.specs(), {&m16, nullptr, nullptr}, Json{{"step", 4}, {"model_config", a.json}}, a.json, "", 4096);
  const std::string e = error_of([&] { load_checkpoint_tensors(open_checkpoint(bad), "weights", b.model.specs(), b.params); });
  EXPECT_NE(e.find("weights-00001-of-"), std::string::npos) << e;
  EXPECT_NE(e.find("is bf16 but checkpoints hold f32 (weights) or f32 and bf16 (moments)"), std::string::npos) << e;
}

// A tensor held in part (TensorSpec::canonical_first: one expert-parallel rank's rows of GPT-OSS's
// fused experts) is saved as a slice of the canonical tensor: a whole save reads into the part, the
// part's save reads back into the part, and a whole tensor read from the part alone names what is missing.
TEST(Checkpoint, PartsOfTensorsAddressTheCanonicalTensor) {
  ScratchDir tmp;
  const TensorSpec whole{
      .name = "model.layers.0.mlp.experts.down_proj", .shape = {2, 3, 4}, .numel = 24, .first_backward_writes = true, .is_expert = true, .layer = 0};
  TensorSpec part = whole;
  part.shape = {1, 3, 4};
  part.numel = 12;
  part.canonical_shape = whole.shape;
  part.canonical_first = 12;
  const Json config = tiny_json();
  auto save = [&](const std::string& name, const TensorSpec& spec, const Arena& a) {
    const std::string dir = tmp.path() + "/" + name;
    write_checkpoint(dir, {spec}, {&a, nullptr, nullptr}, Json{{"step", 1}, {"model_config", config}}, config, "", 4096);
    return open_checkpoint(dir);
  };
  Arena all("parameters", DType::f32, Device::cpu, 24), rows("parameters", DType::f32, Device::cpu, 12);
  for (int64_t i = 0; i < 24; ++i) all.all().ptr<float>()[i] = float(i);
  load_checkpoint_tensors(save("whole", whole, all), "weights", {part}, rows);
  for (int64_t i = 0; i < 12; ++i) EXPECT_EQ(rows.all().ptr<float>()[i], float(12 + i)) << i;

  for (int64_t i = 0; i < 12; ++i) rows.all().ptr<float>()[i] = float(100 + i);
  const Checkpoint c = save("part", part, rows);
  const Json meta = read_json_file(c.dir + "/meta.json");
  EXPECT_EQ(meta["files"][0]["slices"][part.name], (Json{{"first", 12}, {"count", 12}, {"shape", {2, 3, 4}}}));
  Arena back("parameters", DType::f32, Device::cpu, 12);
  load_checkpoint_tensors(c, "weights", {part}, back);
  EXPECT_TRUE(same_bits(rows, back));
  const std::string e = error_of([&] { load_checkpoint_tensors(c, "weights", {whole}, all); });
  EXPECT_NE(e.find("lacks elements [0, 24) of tensor 'model.layers.0.mlp.experts.down_proj'"), std::string::npos) << e;
}

TEST(Checkpoint, RoundTripIsBitwise) {
  ScratchDir tmp;
  Tiny a, b(16, 99);
  const std::string dir = save_tiny(a, tmp.path());
  EXPECT_EQ(checkpoint_name(3), "step-00000003");
  int weight_files = 0;
  for (const auto& e : fs::directory_iterator(dir)) weight_files += e.path().filename().string().starts_with("weights-");
  EXPECT_GT(weight_files, 2);
  EXPECT_FALSE(fs::exists(dir + ".tmp"));

  const Checkpoint c = open_checkpoint(tmp.path());  // a run directory opens its newest checkpoint
  EXPECT_EQ(c.dir, dir);
  EXPECT_EQ(c.step, 3);
  EXPECT_TRUE(c.has_optimizer_state);
  verify_checkpoint(c);
  EXPECT_FALSE(same_bits(a.params, b.params));
  load_checkpoint_tensors(c, "weights", b.model.specs(), b.params);
  load_checkpoint_tensors(c, "exp_avg", b.model.specs(), b.exp_avg);
  load_checkpoint_tensors(c, "exp_avg_sq", b.model.specs(), b.exp_avg_sq);
  EXPECT_TRUE(same_bits(a.params, b.params));
  EXPECT_TRUE(same_bits(a.exp_avg, b.exp_avg));
  EXPECT_TRUE(same_bits(a.exp_avg_sq, b.exp_avg_sq));

  // Canonical names and shapes, one entry per expert.
  SafetensorsFile first(dir + "/weights-00001-of-" + fmt::format("{:05d}", weight_files) + ".safetensors");
  EXPECT_TRUE(first.contains("model.embed_tokens.weight"));
  EXPECT_EQ(first.get("model.embed_tokens.weight").shape_string(), "[40, 16]");
}

TEST(Checkpoint, LeftoversOfKilledSavesAreNeverPicked) {
  ScratchDir tmp;
  Tiny a;
  save_tiny(a, tmp.path(), 2);
  // A save killed before its rename (step 4), and a directory without meta.json (step 3).
  fs::create_directories(tmp / "step-00000004.tmp");
  fs::copy(tmp / "step-00000002", tmp / "step-00000004.tmp", fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  fs::create_directories(tmp / "step-00000003");
  fs::copy_file(tmp / "step-00000002/config.json", tmp / "step-00000003/config.json");
  fs::create_directories(tmp / "notes");
  ASSERT_TRUE(latest_checkpoint(tmp.path()).has_value());
  EXPECT_EQ(*latest_checkpoint(tmp.path()), tmp / "step-00000002");
  EXPECT_NE(error_of([&] { open_checkpoint(tmp / "step-00000003"); }).find("has no meta.json"), std::string::npos);
  EXPECT_FALSE(latest_checkpoint(tmp / "nothing-here").has_value());
}

TEST(Checkpoint, DamagedFilesAreNamed) {
  ScratchDir tmp;
  Tiny a;
  const std::string dir = save_tiny(a, tmp.path());
  const std::string shard = dir + "/exp_avg-00002-of-" + fmt::format("{:05d}", [&] {
    int n = 0;
    for (const auto& e : fs::directory_iterator(dir)) n += e.path().filename().string().starts_with("exp_avg-");
    return n;
  }()) + ".safetensors";
  ASSERT_TRUE(fs::exists(shard));
  const std::string bytes = data_testing::read_file(shard);

  // Truncated.
  fs::resize_file(shard, bytes.size() - 100);
  std::string e = error_of([&] { open_checkpoint(dir); });
  EXPECT_NE(e.find(shard + " is truncated"), std::string::npos) << e;

  // Same size, one byte changed.
  std::string corrupt = bytes;
  corrupt[corrupt.size() - 5] ^= 0x40;
  data_testing::write_file(shard, corrupt);
  const Checkpoint c = open_checkpoint(dir);
  e = error_of([&] { verify_checkpoint(c); });
  EXPECT_NE(e.find(shard + " is corrupt"), std::string::npos) << e;

  // Missing.
  fs::remove(shard);
  e = error_of([&] { open_checkpoint(dir); });
  EXPECT_NE(e.find(shard + " is missing"), std::string::npos) << e;

  // Broken meta.json.
  data_testing::write_file(dir + "/meta.json", "{\"format\": ");
  e = error_of([&] { open_checkpoint(dir); });
  EXPECT_NE(e.find(dir + "/meta.json is not valid JSON"), std::string::npos) << e;
}

TEST(Checkpoint, AnotherModelIsRefused) {
  ScratchDir tmp;
  Tiny a, wide(24);
  const Checkpoint c = open_checkpoint(save_tiny(a, tmp.path()));
  const std::string e = error_of([&] { load_checkpoint_tensors(c, "weights", wide.model.specs(), wide.params); });
  EXPECT_NE(e.find("written for another model"), std::string::npos) << e;
  EXPECT_EQ(model_config_difference(a.json, wide.json), "hidden_size is 16 there but 24 here");
  Json same = a.json;
  same["torch_dtype"] = "bfloat16";
  same["rms_norm_eps"] = 1e-06;
  EXPECT_EQ(model_config_difference(a.json, same), "");
  same.erase("norm_topk_prob");
  EXPECT_EQ(model_config_difference(a.json, same), "norm_topk_prob is true there but absent here");
}

TEST(Checkpoint, MetricsAreCutAtTheResumedStep) {
  ScratchDir tmp;
  data_testing::write_file(tmp / "metrics.jsonl", "{\"step\": 1}\n{\"step\": 2}\n{\"step\": 3}\n{\"step\": 4}\n");
  keep_metrics_through(tmp / "metrics.jsonl", 2);
  EXPECT_EQ(data_testing::read_file(tmp / "metrics.jsonl"), "{\"step\": 1}\n{\"step\": 2}\n");
}

TEST(HfFormat, ExportThenReadIsBitwiseInFp32AndRoundedInBf16) {
  ScratchDir tmp;
  Tiny a, b(16, 99);
  HfExportOptions o;
  o.shard_bytes = 8192;
  write_hf_model(tmp / "f32", a.model.specs(), a.params, a.json, o);
  EXPECT_TRUE(is_hf_model_dir(tmp / "f32"));
  EXPECT_TRUE(fs::exists(tmp / "f32/model-00001-of-00008.safetensors") || fs::exists(tmp / "f32/model.safetensors.index.json"));
  const Json index = read_json_file(tmp / "f32/model.safetensors.index.json");
  EXPECT_EQ(index["weight_map"].size(), a.model.specs().size());
  EXPECT_EQ(index["metadata"]["total_size"].get<size_t>(), a.params.bytes());
  EXPECT_EQ(read_json_file(tmp / "f32/config.json")["torch_dtype"], "float32");
  read_hf_weights(tmp / "f32", b.model.specs(), b.params);
  EXPECT_TRUE(same_bits(a.params, b.params));

  o.dtype = DType::bf16;
  write_hf_model(tmp / "bf16", a.model.specs(), a.params, a.json, o);
  read_hf_weights(tmp / "bf16", b.model.specs(), b.params);
  const float* pa = a.params.all().ptr<float>();
  const float* pb = b.params.all().ptr<float>();
  bool rounded = true;
  for (int64_t i = 0; i < a.model.num_parameters(); ++i) rounded = rounded && pb[i] == bf16_to_float(float_to_bf16(pa[i]));
  EXPECT_TRUE(rounded);
}

TEST(HfFormat, ReadsSingleFileAndFusedExperts) {
  ScratchDir tmp;
  Tiny a, b(16, 99);
  const Qwen3MoeConfig& c = a.model.config();
  const int64_t E = c.num_experts, I = c.expert_intermediate_size, H = c.hidden_size;
  // transformers 5's in-memory layout: per layer one [E, 2I, H] gate_up and one [E, H, I] down tensor.
  std::vector<std::vector<float>> fused;
  std::vector<SafetensorsEntry> entries;
  for (const TensorSpec& s : a.model.specs()) {
    if (s.name.find(".mlp.experts.") != std::string::npos) continue;
    Tensor t = a.params.slice(s.offset, {s.numel});
    t.ndim = int(s.shape.size());
    for (size_t i = 0; i < s.shape.size(); ++i) t.shape[i] = s.shape[i];
    entries.push_back({s.name, t});
  }
  auto spec = [&](const std::string& name) {
    for (const TensorSpec& s : a.model.specs())
      if (s.name == name) return s;
    ADD_FAILURE() << name;
    return TensorSpec{};
  };
  fused.reserve(size_t(2 * c.num_layers));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    auto& gate_up = fused.emplace_back(size_t(E * 2 * I * H));
    auto& down = fused.emplace_back(size_t(E * H * I));
    for (int64_t e = 0; e < E; ++e) {
      const std::string p = fmt::format("model.layers.{}.mlp.experts.{}.", l, e);
      const float* base = a.params.all().ptr<float>();
      std::memcpy(&gate_up[size_t(e * 2 * I * H)], base + spec(p + "gate_proj.weight").offset, size_t(I * H) * 4);
      std::memcpy(&gate_up[size_t(e * 2 * I * H + I * H)], base + spec(p + "up_proj.weight").offset, size_t(I * H) * 4);
      std::memcpy(&down[size_t(e * H * I)], base + spec(p + "down_proj.weight").offset, size_t(H * I) * 4);
    }
    entries.push_back({fmt::format("model.layers.{}.mlp.experts.gate_up_proj", l), Tensor(gate_up.data(), DType::f32, Device::cpu, {E, 2 * I, H})});
    entries.push_back({fmt::format("model.layers.{}.mlp.experts.down_proj", l), Tensor(down.data(), DType::f32, Device::cpu, {E, H, I})});
  }
  fs::create_directories(tmp / "fused");
  write_safetensors(tmp / "fused/model.safetensors", entries);
  write_json_file(tmp / "fused/config.json", a.json);
  read_hf_weights(tmp / "fused", b.model.specs(), b.params);
  EXPECT_TRUE(same_bits(a.params, b.params));

  // A missing tensor names the file and the tensor.
  entries.erase(entries.begin());
  write_safetensors(tmp / "fused/model.safetensors", entries);
  const std::string e = error_of([&] { read_hf_weights(tmp / "fused", b.model.specs(), b.params); });
  EXPECT_NE(e.find(tmp / "fused/model.safetensors: tensor 'model.embed_tokens.weight' is missing"), std::string::npos) << e;
}

// One [E, C, R] tensor stored as MXFP4 (the Hub's gpt-oss experts): blocks [E, R, C / 32, 16] u8,
// two E2M1 codes a byte (low nibble first, then high), scales [E, R, C / 32] u8 (power of two + 127).
// The reader dequantizes each value and stores it transposed; a wrong shape names both tensors.
TEST(HfFormat, ReadsMxfp4TensorsDequantizedAndTransposed) {
  ScratchDir tmp;
  const int64_t E = 2, C = 64, R = 3, G = C / 32;
  const TensorSpec spec{.name = "model.layers.0.mlp.experts.down_proj",
                        .shape = {E, C, R},
                        .numel = E * C * R,
                        .first_backward_writes = true,
                        .is_expert = true,
                        .layer = 0};
  std::vector<uint8_t> blocks(size_t(E * R * G * 16)), scales(size_t(E * R * G));
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = uint8_t(i * 37 + 11);
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = uint8_t(124 + i % 7);
  fs::create_directories(tmp / "mxfp4");
  write_json_file(tmp / "mxfp4/config.json", Json{{"model_type", "gpt_oss"}});
  auto write = [&](int64_t rows) {
    write_safetensors(tmp / "mxfp4/model.safetensors",
                      {{spec.name + "_blocks", Tensor(blocks.data(), DType::u8, Device::cpu, {E, rows, G, 16})},
                       {spec.name + "_scales", Tensor(scales.data(), DType::u8, Device::cpu, {E, rows, G})}});
  };
  write(R);
  Arena params("parameters", DType::f32, Device::cpu, spec.numel);
  read_hf_weights(tmp / "mxfp4", {spec}, params);
  const float e2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) {
        const size_t group = size_t((e * R + r) * G + c / 32);
        const uint8_t byte = blocks[group * 16 + size_t(c % 32 / 2)];
        const float want = std::ldexp(e2m1[c % 2 == 0 ? byte & 15 : byte >> 4], int(scales[group]) - 127);
        EXPECT_EQ(params.all().ptr<float>()[(e * C + c) * R + r], want) << e << " " << c << " " << r;
      }
  // One expert-parallel rank's part (expert 1's rows, TensorSpec::canonical_first) reads expert 1 of the
  // whole, from MXFP4 and from a plain tensor alike.
  TensorSpec part = spec;
  part.shape[0] = 1;
  part.numel = C * R;
  part.canonical_shape = spec.shape;
  part.canonical_first = C * R;
  Arena part_params("parameters", DType::f32, Device::cpu, part.numel);
  read_hf_weights(tmp / "mxfp4", {part}, part_params);
  EXPECT_EQ(std::memcmp(part_params.all().data, params.all().ptr<float>() + C * R, size_t(C * R) * sizeof(float)), 0);
  fs::create_directories(tmp / "plain");
  write_json_file(tmp / "plain/config.json", Json{{"model_type", "gpt_oss"}});
  write_safetensors(tmp / "plain/model.safetensors", {{spec.name, params.all().reshape({E, C, R})}});
  fill_constant(part_params.all(), 0.0);
  read_hf_weights(tmp / "plain", {part}, part_params);
  EXPECT_EQ(std::memcmp(part_params.all().data, params.all().ptr<float>() + C * R, size_t(C * R) * sizeof(float)), 0);

  write(R - 1);
  const std::string error = error_of([&] { read_hf_weights(tmp / "mxfp4", {spec}, params); });
  EXPECT_NE(error.find("MXFP4 tensors 'model.layers.0.mlp.experts.down_proj_blocks' [2, 2, 2, 16] and "
                       "'model.layers.0.mlp.experts.down_proj_scales' [2, 2, 2] do not dequantize to "
                       "'model.layers.0.mlp.experts.down_proj' [2, 64, 3]"),
            std::string::npos)
      << error;
}

}  // namespace
}  // namespace marrow
