// The run config reader's refusals of values that would silently change a run (issue #16, item 3).
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

TEST(RunConfig, RefusesAnEmptyStringInTheFile) {
  const std::string path = ::testing::TempDir() + "/empty-value.toml";
  {
    std::ofstream out(path);
    out << "[model]\nconfig = \"configs/tiny-moe.json\"\n[output]\ndir = \"\"\n";
  }
  std::vector<std::string> args = {"train", path, "--data.path=unused"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  std::string error = "no error";
  try {
    parse_run_config(int(argv.size()), argv.data());
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_EQ(error, path + ":4: dir has an empty value");
  std::filesystem::remove(path);
}

TEST(RunConfig, ParallelSizesMustBePositive) {
  EXPECT_NE(parse_error({"--parallel.ep=0"}).find("--parallel.ep"), std::string::npos);
  EXPECT_NE(parse_error({"--parallel.timeout_s=-1"}).find("--parallel.timeout_s"), std::string::npos);
  EXPECT_EQ(parse_error({"--parallel.ep=2", "--parallel.overlap_grad_reduce=false"}), "no error");
}

}  // namespace
}  // namespace marrow
