// The one model switch of the program (DESIGN.md §1.3): from a config.json's model_type to the model
// family's class. f is a generic lambda, called as f.template operator()<M>(config):
//   with_model(json, path, [&]<class M>(const typename M::Config& config) { train<M>(rc, config); });
#pragma once
#include <string>

#include "core/json.h"
#include "models/deepseek_v2.h"
#include "models/gpt_oss.h"
#include "models/qwen3_5_moe.h"
#include "models/qwen3_moe.h"

namespace marrow {

template <class F>
decltype(auto) with_model(const Json& config_json, const std::string& source, F&& f) {
  const std::string model_type = JsonFields(config_json, source).string("model_type");
  if (model_type == Qwen3Moe::model_type) return f.template operator()<Qwen3Moe>(Qwen3MoeConfig::from_json(config_json, source));
  if (model_type == GptOss::model_type) return f.template operator()<GptOss>(GptOssConfig::from_json(config_json, source));
  if (model_type == DeepseekV2::model_type) return f.template operator()<DeepseekV2>(DeepseekV2Config::from_json(config_json, source));
  // A multimodal Qwen3.5-MoE config (model_type qwen3_5_moe) reads as its text tower.
  if (model_type == Qwen3_5Moe::model_type || model_type == "qwen3_5_moe")
    return f.template operator()<Qwen3_5Moe>(Qwen3_5MoeConfig::from_json(config_json, source));
  fail("{}: unknown model_type '{}' (supported: qwen3_moe, gpt_oss, deepseek_v2, qwen3_5_moe_text)", source, model_type);
}

}  // namespace marrow
