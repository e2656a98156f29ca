#include "engine/config_changes.h"

#include <algorithm>
#include <sstream>

#include "core/errors.h"
#include "core/sha256.h"

namespace marrow {

namespace {

struct Change {
  std::string kind, what;
};

std::vector<std::string> allowed_kinds(const std::string& list) {
  std::vector<std::string> kinds;
  std::stringstream in(list);
  for (std::string kind; std::getline(in, kind, ',');)
    if (!kind.empty()) kinds.push_back(kind);
  return kinds;
}

// The values of this run that the data order depends on, under the names run_config uses in meta.json.
std::vector<std::pair<std::string, Json>> data_order_keys(const RunConfig& rc) {
  return {{"train.seed", rc.seed},
          {"train.global_batch", rc.global_batch},
          {"train.seq_len", rc.seq_len},
          {"data.validation_fraction", rc.validation_fraction}};
}

std::vector<Change> changes_of(const Json& meta, const RunConfig& rc, const CorpusManifest& corpus) {
  std::vector<Change> changes;
  const Json saved_config = meta.value("run_config", Json::object());
  for (const auto& [key, now] : data_order_keys(rc)) {
    const std::string section = key.substr(0, key.find('.')), name = key.substr(key.find('.') + 1);
    const Json saved = saved_config.value(section, Json::object()).value(name, Json());
    if (!saved.is_null() && saved != now) changes.push_back({"data", fmt::format("{} is {} there but {} now", key, saved.dump(), now.dump())});
  }
  const Json data = meta.value("data", Json::object());
  const std::string fingerprint = data.value("corpus_sha256", "");
  if (!fingerprint.empty() && fingerprint != corpus_fingerprint(corpus))
    changes.push_back({"data", fmt::format("the corpus {} holds other tokens than the one it was trained on ({}), or the same tokens cut "
                                           "into other shards",
                                           rc.data_path, data.value("path", "?"))});
  const std::string tokenizer = data.value("tokenizer_sha256", "");
  if (!tokenizer.empty() && !corpus.tokenizer_sha256.empty() && tokenizer != corpus.tokenizer_sha256)
    changes.push_back({"tokenizer", fmt::format("the corpus {} was made with another tokenizer (sha256 {}) than the checkpoint's ({})",
                                                rc.data_path, corpus.tokenizer_sha256.substr(0, 12), tokenizer.substr(0, 12))});
  return changes;
}

}  // namespace

std::string corpus_fingerprint(const CorpusManifest& corpus) {
  Sha256 hash;
  for (const ShardInfo& shard : corpus.shards) hash.update(shard.sha256.data(), shard.sha256.size());
  return hash.hex_digest();
}

Json check_config_changes(const Json& meta, const RunConfig& rc, const CorpusManifest& corpus) {
  const std::vector<std::string> allowed = allowed_kinds(rc.checkpoint_allow_changes);
  Json record = meta.value("config_changes", Json::array());
  Json entry = {{"at_step", meta.value("step", int64_t(0))}, {"allowed", allowed}, {"changes", Json::array()}};
  for (const Change& c : changes_of(meta, rc, corpus)) {
    MARROW_CHECK(std::find(allowed.begin(), allowed.end(), c.kind) != allowed.end(),
                 "cannot continue from the checkpoint at step {}: {}, which changes the {}; pass --checkpoint.allow_changes={} to "
                 "continue anyway (recorded in meta.json), or use another output.dir",
                 meta.value("step", int64_t(0)), c.what, c.kind == "data" ? "data order" : "meaning of the token ids", c.kind);
    entry["changes"].push_back(c.kind + ": " + c.what);
  }
  if (!entry["changes"].empty()) record.push_back(entry);
  return record;
}

}  // namespace marrow
