// Issue #16's building blocks, one process: the run lock, the checked metrics log and the rule on
// config changes at a resume, the memory floor checked before allocation. tests/python/test_faults.py drives the same through the binary.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <string>

#include "data_test_util.h"
#include "engine/config_changes.h"
#include "engine/memory_guard.h"
#include "engine/metrics_log.h"
#include "engine/run_lock.h"
#include "models/gpt_oss.h"
#include "models/qwen3_moe.h"

namespace marrow {
namespace {

using data_testing::error_of;
using data_testing::read_file;
using data_testing::ScratchDir;
using data_testing::write_file;

TEST(RunLock, ASecondHolderIsRefusedNamingTheFirst) {
  const ScratchDir scratch;
  const std::string dir = scratch / "run";
  {
    const RunLock first(dir);
    const std::string error = error_of([&] { RunLock second(dir); });
    EXPECT_NE(error.find("is in use by another run (process " + std::to_string(::getpid()) + " on "), std::string::npos) << error;
    EXPECT_NE(error.find(dir + "/.lock"), std::string::npos) << error;
    EXPECT_EQ(error_of([&] { RunLock other_rank(dir, false); }), "no error");  // ranks other than 0 take nothing
  }
  EXPECT_EQ(error_of([&] { RunLock again(dir); }), "no error");  // released with its holder
}

TEST(RunLock, AnOutputDirThatIsAFileIsOneSentence) {
  const ScratchDir scratch;
  const std::string dir = scratch / "file";
  write_file(dir, "not a directory");
  EXPECT_NE(error_of([&] { RunLock lock(dir); }).find("cannot create output.dir " + dir + ": "), std::string::npos);
  EXPECT_NE(error_of([&] { RunLock lock(dir + "/below"); }).find("cannot create output.dir " + dir + "/below: "), std::string::npos);
  EXPECT_EQ(read_file(dir), "not a directory");
}

TEST(MetricsLog, AFailedAppendStopsWithASentenceAndCutsTheLineBack) {
  const ScratchDir scratch;
  const std::string path = scratch / "metrics.jsonl";
  write_file(path, "{\"step\":1}\n");
  MetricsLog log(path, false);
  // RLIMIT_FSIZE, as a full disk: the write past the limit fails with EFBIG once SIGXFSZ is ignored.
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  auto previous = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 20;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string error = error_of([&] { log.append("{\"step\":2,\"loss\":1.2345678}"); });
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, previous);
  EXPECT_NE(error.find("cannot write " + path + ": File too large (is the disk full?); the file is as it was"), std::string::npos) << error;
  EXPECT_EQ(read_file(path), "{\"step\":1}\n");
}

TEST(MetricsLog, DevFullIsRefused) {
  MetricsLog log("/dev/full", false);
  EXPECT_NE(error_of([&] { log.append("{}"); }).find("cannot write /dev/full: No space left on device (is the disk full?)"),
            std::string::npos);
}

// A checkpoint's meta.json as TrainCheckpoints::save writes it, for the keys the rule compares.
Json saved_meta(const RunConfig& rc, const CorpusManifest& corpus) {
  return {{"step", 10},
          {"run_config", {{"train", {{"seed", rc.seed}, {"global_batch", rc.global_batch}, {"seq_len", rc.seq_len}}},
                          {"data", {{"validation_fraction", rc.validation_fraction}}}}},
          {"data", {{"tokenizer_sha256", corpus.tokenizer_sha256}, {"corpus_sha256", corpus_fingerprint(corpus)}, {"path", "c"}}}};
}

TEST(ConfigChanges, DataOrderAndTokenizerChangesNeedConsent) {
  RunConfig rc;
  rc.data_path = "corpus";
  CorpusManifest corpus;
  corpus.tokenizer_sha256 = "aaaa";
  corpus.shards = {{"shard-0.bin", 10, 1, "1111"}};
  const Json meta = saved_meta(rc, corpus);
  EXPECT_EQ(check_config_changes(meta, rc, corpus), Json::array());  // nothing changed, nothing recorded

  RunConfig other_seed = rc;
  other_seed.seed = 7;
  const std::string error = error_of([&] { check_config_changes(meta, other_seed, corpus); });
  EXPECT_NE(error.find("train.seed is 1234 there but 7 now, which changes the data order; pass --checkpoint.allow_changes=data"),
            std::string::npos) << error;
  other_seed.checkpoint_allow_changes = "data";
  const Json record = check_config_changes(meta, other_seed, corpus);
  ASSERT_EQ(record.size(), 1u);
  EXPECT_EQ(record[0]["at_step"], 10);
  EXPECT_EQ(record[0]["changes"][0], "data: train.seed is 1234 there but 7 now");

  RunConfig other_fraction = rc;
  other_fraction.validation_fraction = 0.05;
  EXPECT_NE(error_of([&] { check_config_changes(meta, other_fraction, corpus); }).find("data.validation_fraction"), std::string::npos);

  CorpusManifest other_tokens = corpus;
  other_tokens.shards[0].sha256 = "2222";
  EXPECT_NE(error_of([&] { check_config_changes(meta, rc, other_tokens); }).find("holds other tokens"), std::string::npos);

  CorpusManifest other_tokenizer = corpus;
  other_tokenizer.tokenizer_sha256 = "bbbb";
  RunConfig data_only = rc;
  data_only.checkpoint_allow_changes = "data";
  const std::string tokenizer_error = error_of([&] { check_config_changes(meta, data_only, other_tokenizer); });
  EXPECT_NE(tokenizer_error.find("another tokenizer"), std::string::npos) << tokenizer_error;
  EXPECT_NE(tokenizer_error.find("--checkpoint.allow_changes=tokenizer"), std::string::npos) << tokenizer_error;
  data_only.checkpoint_allow_changes = "data,tokenizer";
  EXPECT_EQ(check_config_changes(meta, data_only, other_tokenizer).size(), 1u);
}

TEST(ConfigChanges, EarlierRecordsAreKept) {
  RunConfig rc;
  CorpusManifest corpus;
  Json meta = saved_meta(rc, corpus);
  meta["config_changes"] = Json::array({{{"at_step", 4}, {"allowed", {"data"}}, {"changes", {"data: x"}}}});
  EXPECT_EQ(check_config_changes(meta, rc, corpus), meta["config_changes"]);
}

// The guard's arithmetic is the model's: any drift (a new tensor) shows here.
TEST(MemoryGuard, ModelSizeCountsWhatTheModelHolds) {
  for (const char* name : {"tiny-moe.json", "bench-moe.json", "bench-moe-16.json"}) {
    const Qwen3MoeConfig config = Qwen3MoeConfig::load(std::string(MARROW_SOURCE_DIR) + "/configs/" + name);
    const Qwen3Moe model(config, DType::f32, Device::cpu);
    const ModelSize size = config.model_size();
    EXPECT_EQ(size.parameters, double(model.num_parameters())) << name;
    EXPECT_EQ(size.tensors, double(model.specs().size())) << name;
  }
  const GptOssConfig config = GptOssConfig::load(std::string(MARROW_SOURCE_DIR) + "/configs/tiny-gpt-oss.json");
  const GptOss model(config, DType::f32, Device::cpu);
  EXPECT_EQ(config.model_size().parameters, double(model.num_parameters()));
  EXPECT_EQ(config.model_size().tensors, double(model.specs().size()));
}

TEST(MemoryGuard, RefusesWhatCannotFitWithTheNumbers) {
  Qwen3MoeConfig config = Qwen3MoeConfig::load(std::string(MARROW_SOURCE_DIR) + "/configs/tiny-moe.json");
  EXPECT_EQ(error_of([&] { check_state_fits(config.model_size(), 1, Device::cpu, 0); }), "no error");
  config.num_experts = 1000000000;
  // 2 layers x (attention 64*64*12 + router 1e9*64 + experts 3*1e9*64*64 + norms 256) + 2*4096*64 + 64
  // parameters; 2 x (9 + 3e9) + 3 tensors of 160 bytes.
  const std::string error = error_of([&] { check_state_fits(config.model_size(), 4, Device::cpu, 0); });
  EXPECT_EQ(error.rfind("the model cannot fit: 2.47e+13 parameters need 3.681e+05 GiB of fp32 training state (16 bytes each), "
                        "9.203e+04 GiB per process over 4 plus 894.1 GiB for their table of 6e+09 tensors, more than the ", 0), 0u)
      << error;
  const std::string bf16 = error_of([&] { check_state_fits(config.model_size(), 4, Device::cpu, 0, 2); });
  EXPECT_EQ(bf16.rfind("the model cannot fit: 2.47e+13 parameters need 2.761e+05 GiB of training state (bf16 moments) (12 bytes each), ", 0),
            0u)
      << bf16;
}

}  // namespace
}  // namespace marrow
