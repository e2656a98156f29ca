// The run config reader (toml++ and CLI11): its refusals of values that would silently change a
// run, and one sentence with line:column for each bad file (issue #16, items 3, 10 and 11).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/errors.h"
#include "engine/run_config.h"

namespace marrow {
namespace {

std::string parse_error(std::vector<std::string> args) {
  args.insert(args.begin(), {"train", MARROW_SOURCE_DIR "/configs/tiny-moe.toml", "--data.path=unused"});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  try {
    parse_run_config(int(argv.size()), argv.data());
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(RunConfig, RefusesAnOverrideWithoutAValue) {
  EXPECT_EQ(parse_error({"--output.dir", "--train.steps=30"}), "--output.dir needs a value (write --output.dir=VALUE)");
  EXPECT_EQ(parse_error({"--train.steps=30", "--output.dir"}), "--output.dir needs a value (write --output.dir=VALUE)");
  EXPECT_EQ(parse_error({"--output.dir="}), "--output.dir has an empty value");
  EXPECT_EQ(parse_error({"--output.dir", "runs/x", "--train.steps=30"}), "no error");
}

// Parses a run config file with the given text; returns the error or "no error".
std::string file_error(const std::string& name, const std::string& text, RunConfig* rc = nullptr) {
  const std::string path = ::testing::TempDir() + "/" + name + ".toml";
  std::ofstream(path) << text;
  std::vector<std::string> args = {"train", path, "--data.path=unused"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  std::string error = "no error";
  try {
    const RunConfig parsed = parse_run_config(int(argv.size()), argv.data());
    if (rc) *rc = parsed;
  } catch (const Error& e) {
    error = e.what();
  }
  std::filesystem::remove(path);
  return error;
}

const std::string kModel = "[model]\nconfig = \"configs/tiny-moe.json\"\n";

TEST(RunConfig, RefusesAnEmptyStringInTheFile) {
  EXPECT_EQ(file_error("empty-value", kModel + "[output]\ndir = \"\"\n"),
            ::testing::TempDir() + "/empty-value.toml:4:7: output.dir has an empty value");
}

TEST(RunConfig, ReadsTomlAsTomlIs) {
  RunConfig rc;
  EXPECT_EQ(file_error("toml", "\xEF\xBB\xBF" + kModel + "[train]\nsteps = 1_234\n[output]\ndir = 'runs/single quoted'\n", &rc),
            "no error");
  EXPECT_EQ(rc.steps, 1234);
  EXPECT_EQ(rc.out_dir, "runs/single quoted");
}

// train.dependent_launch (ops/launch.h) is on unless the file says otherwise, and a value that is not
// a boolean is refused rather than read as off.
TEST(RunConfig, DependentLaunchIsOnByDefaultAndABoolean) {
  RunConfig rc;
  EXPECT_EQ(file_error("launch-default", kModel, &rc), "no error");
  EXPECT_TRUE(rc.dependent_launch);
  EXPECT_EQ(file_error("launch-off", kModel + "[train]\ndependent_launch = false\n", &rc), "no error");
  EXPECT_FALSE(rc.dependent_launch);
  EXPECT_NE(file_error("launch-bad", kModel + "[train]\ndependent_launch = \"sometimes\"\n"), "no error");
}

TEST(RunConfig, BadTomlIsOneSentenceWithLineAndColumn) {
  const std::string at = ::testing::TempDir();
  const std::string duplicate = file_error("duplicate", kModel + "[train]\nsteps = 5\nsteps = 6\n");
  EXPECT_EQ(duplicate.rfind(at + "/duplicate.toml:5:", 0), 0u) << duplicate;
  EXPECT_NE(duplicate.find("steps"), std::string::npos) << duplicate;
  const std::string unterminated = file_error("unterminated", kModel + "[output]\ndir = \"runs/x\n");
  EXPECT_EQ(unterminated.rfind(at + "/unterminated.toml:4:", 0), 0u) << unterminated;
  EXPECT_EQ(file_error("outside", "steps = 5\n" + kModel),
            at + "/outside.toml:1:9: 'steps' is outside any [section]; run-config keys live in sections such as [train]");
  EXPECT_EQ(file_error("list", kModel + "[train]\nsteps = [1, 2]\n"), at + "/list.toml:4:9: train.steps must be a single value, not a list");
  EXPECT_EQ(file_error("unknown", kModel + "[train]\nstep = 5\n"),
            at + "/unknown.toml: unknown run-config key --train.step (known sections: model, data, train, optimizer, schedule, output, "
                 "eval, checkpoint, parallel)");
}

TEST(RunConfig, ADirectoryIsNotARunConfig) {
  std::vector<std::string> args = {"train", ::testing::TempDir(), "--data.path=unused"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  try {
    parse_run_config(int(argv.size()), argv.data());
    ADD_FAILURE() << "a directory was read as a run config";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "run config " + ::testing::TempDir() + " is a directory; give the .toml file");
  }
}

TEST(RunConfig, RefusesNonFiniteAndOutOfRangeNumbersAtParseTime) {
  EXPECT_NE(parse_error({"--optimizer.lr=inf"}).find("--optimizer.lr: must be positive, got inf"), std::string::npos);
  EXPECT_NE(parse_error({"--optimizer.lr=nan"}).find("--optimizer.lr: must be positive, got nan"), std::string::npos);
  EXPECT_NE(parse_error({"--optimizer.lr=1e999"}).find("--optimizer.lr: must be a finite number, got '1e999'"), std::string::npos);
  EXPECT_NE(parse_error({"--optimizer.beta1=1"}).find("--optimizer.beta1: must be at least 0 and below 1"), std::string::npos);
  EXPECT_NE(parse_error({"--train.seed=-1"}).find("--train.seed: must be an integer from 0 to 2^64 - 1, got -1"), std::string::npos);
  // A huge value is echoed as given, not as a 300-digit expansion.
  const std::string huge = parse_error({"--data.validation_fraction=1.79e308"});
  EXPECT_NE(huge.find("must be between 0 and 0.5, got 1.79e308"), std::string::npos) << huge;
  EXPECT_LT(huge.size(), 200u) << huge;
  EXPECT_NE(parse_error({"--train.steps=1.79e308"}).find("--train.steps: must be a positive integer, got 1.79e308"), std::string::npos);
  EXPECT_NE(parse_error({"--train.steps=2.5"}).find("--train.steps: must be a positive integer, got 2.5"), std::string::npos);
  EXPECT_NE(parse_error({"--eval.every=-1"}).find("--eval.every: must be an integer, zero or more, got -1"), std::string::npos);
  EXPECT_NE(parse_error({"--data.max_epochs=0"}).find("--data.max_epochs: must be a positive integer, got 0"), std::string::npos);
  EXPECT_NE(parse_error({"--checkpoint.allow_changes=data,weights"}).find("got 'weights'"), std::string::npos);
  EXPECT_EQ(parse_error({"--checkpoint.allow_changes=data,tokenizer", "--optimizer.beta2=0"}), "no error");
}

TEST(RunConfig, Bf16MomentsNeedABeta2TheyCanHold) {
  EXPECT_EQ(parse_error({"--optimizer.moments=bf16"}), "no error");
  EXPECT_EQ(parse_error({"--optimizer.moments=bf16", "--optimizer.beta2=0.99"}), "no error");
  EXPECT_EQ(parse_error({"--optimizer.moments=bf16", "--optimizer.beta2=0.999"}),
            MARROW_SOURCE_DIR "/configs/tiny-moe.toml: optimizer.moments = \"bf16\" needs optimizer.beta2 <= 0.99, got 0.999: a bf16 "
                              "moment holds 8 significant bits, and v's per-step change of 0.001 would round away (use fp32 moments)");
  EXPECT_EQ(parse_error({"--optimizer.beta2=0.999"}), "no error");
  EXPECT_NE(parse_error({"--optimizer.moments=fp16"}).find("--optimizer.moments: fp16 not in {fp32,bf16}"), std::string::npos)
      << parse_error({"--optimizer.moments=fp16"});
}

TEST(RunConfig, ParallelSizesMustBePositive) {
  EXPECT_NE(parse_error({"--parallel.ep=0"}).find("--parallel.ep"), std::string::npos);
  EXPECT_NE(parse_error({"--parallel.timeout_s=-1"}).find("--parallel.timeout_s"), std::string::npos);
  EXPECT_EQ(parse_error({"--parallel.ep=2", "--parallel.overlap_grad_reduce=false"}), "no error");
}

TEST(RunConfig, PipelineLayersAreAutoEvenOrAListOfCounts) {
  for (const char* good : {"--parallel.pp_layers=auto", "--parallel.pp_layers=even", "--parallel.pp_layers=3,5,5,3", "--parallel.pp_layers=12"})
    EXPECT_EQ(parse_error({good}), "no error") << good;
  for (const char* bad : {"--parallel.pp_layers=3;5", "--parallel.pp_layers=3,0,5", "--parallel.pp_layers=3,,5", "--parallel.pp_layers=balanced",
                          "--parallel.pp_layers=-1,5"})
    EXPECT_NE(parse_error({bad}).find("must be auto, even or a comma-separated list of layer counts"), std::string::npos) << bad;
}

}  // namespace
}  // namespace marrow
