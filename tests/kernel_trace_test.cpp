#include "engine/kernel_trace.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "core/json.h"
#include "data_test_util.h"
#include "engine/run_config.h"

namespace marrow {
namespace {

using data_testing::ScratchDir;

// void marrow::(anonymous namespace)::rmsnorm_kernel<float, 128>(float*, float const*, int)
const char* kMangled = "_ZN6marrow12_GLOBAL__N_114rmsnorm_kernelIfLi128EEEvPT_PKS2_i";

KernelRecord kernel(const std::string& name, uint64_t start_ns, uint64_t end_ns, uint32_t stream = 7) {
  return {name, start_ns, end_ns, 0, stream, ActivityKind::kernel, {64, 2, 1}, {256, 1, 1}};
}

TEST(KernelTrace, DisplayNamesAreDemangledWithoutReturnTypeAndParameters) {
  EXPECT_EQ(kernel_display_name(kMangled), "marrow::rmsnorm_kernel<float, 128>");
  EXPECT_EQ(kernel_display_name("_Z10add_kernelPfS_"), "add_kernel");
  // cuBLAS kernels are C names: kept as they are.
  EXPECT_EQ(kernel_display_name("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n"), "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n");
}

TEST(KernelTrace, ChromeTraceParsesWithEveryRecordInMicroseconds) {
  ScratchDir tmp;
  const std::string odd = "odd \"quoted\" \\ <a, b> kernel";
  std::vector<KernelRecord> records{kernel(kMangled, 1000, 3500), kernel(odd, 4000, 4001, 13),
                                    {"memcpy HtoD", 5000, 7000, 0, 7, ActivityKind::memcpy, {}, {}, 4096},
                                    {"step 3", 900, 8000, 0, 4242, ActivityKind::range}};
  const std::string path = tmp / "trace.json";
  write_chrome_trace(path, records);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  const Json trace = read_json_file(path);
  std::vector<Json> events;
  for (const Json& e : trace.at("traceEvents"))
    if (e.at("ph") == "X") events.push_back(e);
  ASSERT_EQ(events.size(), records.size());

  EXPECT_EQ(events[0].at("name"), "marrow::rmsnorm_kernel<float, 128>");
  EXPECT_EQ(events[0].at("cat"), "kernel");
  EXPECT_DOUBLE_EQ(events[0].at("ts").get<double>(), 0.1);  // from the earliest record (the range at 900 ns)
  EXPECT_DOUBLE_EQ(events[0].at("dur").get<double>(), 2.5);
  EXPECT_EQ(events[0].at("pid"), 0);
  EXPECT_EQ(events[0].at("tid"), 7);
  EXPECT_EQ(events[0].at("args").at("grid"), "64x2x1");
  EXPECT_EQ(events[0].at("args").at("block"), "256x1x1");

  EXPECT_EQ(events[1].at("name"), odd);
  EXPECT_DOUBLE_EQ(events[1].at("dur").get<double>(), 0.001);
  EXPECT_EQ(events[1].at("tid"), 13);
  EXPECT_EQ(events[2].at("cat"), "memcpy");
  EXPECT_EQ(events[2].at("args").at("bytes"), 4096);
  // NVTX ranges are host work: a process of their own, after the GPUs.
  EXPECT_EQ(events[3].at("name"), "step 3");
  EXPECT_EQ(events[3].at("cat"), "nvtx");
  EXPECT_EQ(events[3].at("pid"), 1);
  EXPECT_DOUBLE_EQ(events[3].at("ts").get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(events[3].at("dur").get<double>(), 7.1);
}

TEST(KernelTrace, TopKernelsAggregateByNameHeaviestFirst) {
  std::vector<KernelRecord> records{
      kernel("b_kernel", 0, 5'000'000),
      kernel("a_kernel", 0, 3'000'000),
      kernel("a_kernel", 10'000'000, 13'000'000),
      kernel("tie_z", 0, 500'000),
      kernel("tie_y", 0, 500'000),
      {"memcpy DtoH", 0, 100'000'000, 0, 7, ActivityKind::memcpy},  // not a kernel: neither a row nor in the shares
  };
  const std::vector<KernelStat> rows = top_kernels(records, 10);
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_EQ(rows[0].name, "a_kernel");
  EXPECT_EQ(rows[0].calls, 2);
  EXPECT_DOUBLE_EQ(rows[0].total_ms, 6.0);
  EXPECT_DOUBLE_EQ(rows[0].mean_us, 3000.0);
  EXPECT_DOUBLE_EQ(rows[0].share, 0.5);
  EXPECT_EQ(rows[1].name, "b_kernel");
  EXPECT_EQ(rows[2].name, "tie_y");  // equal totals: by name
  EXPECT_EQ(rows[3].name, "tie_z");
  EXPECT_EQ(top_kernels(records, 1).size(), 1u);

  const std::string table = kernel_table(records, 2);
  EXPECT_NE(table.find("top 2 kernels by total time"), std::string::npos) << table;
  EXPECT_NE(table.find("other 2 kernels"), std::string::npos) << table;
  EXPECT_NE(table.find("all 4 kernels"), std::string::npos) << table;
  EXPECT_NE(table.find("memcpy and memset"), std::string::npos) << table;
  EXPECT_EQ(table.find("tie_y"), std::string::npos) << table;
}

// An all-to-all of 10 ms under two compute kernels but for 1 ms, one of 4 ms fully under two touching
// kernels, and an all-gather on another GPU with nothing to hide it: 13 of 18 ms hidden.
TEST(KernelTrace, CommunicationOverlapCountsTimeUnderComputeKernelsOfItsGpu) {
  auto on = [](KernelRecord r, uint32_t device, uint32_t stream) {
    r.device = device;
    r.stream = stream;
    return r;
  };
  std::vector<KernelRecord> records{
      on(kernel("_Z22ncclDevKernel_SendRecvP11ncclDevComm", 0, 10'000'000), 0, 9),  // mangled, as CUPTI may report it
      on(kernel("gemm", 5'000'000, 20'000'000), 0, 7),
      on(kernel("ncclDevKernel_SendRecv", 30'000'000, 34'000'000), 0, 9),
      on(kernel("attention", 29'000'000, 32'000'000), 0, 7),
      on(kernel("norm", 32'000'000, 35'000'000), 0, 7),
      on(kernel("ncclDevKernel_AllGather", 0, 4'000'000), 1, 9),
      on(kernel("gemm", 0, 4'000'000), 0, 7),  // GPU 0's: hides nothing on GPU 1
  };
  const std::vector<CommunicationOverlap> rows = communication_overlap(records);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].name, "ncclDevKernel_AllGather");
  EXPECT_DOUBLE_EQ(rows[0].total_ms, 4.0);
  EXPECT_DOUBLE_EQ(rows[0].hidden_ms, 0.0);
  EXPECT_EQ(rows[1].name, "ncclDevKernel_SendRecv");
  EXPECT_EQ(rows[1].calls, 2);
  EXPECT_DOUBLE_EQ(rows[1].total_ms, 14.0);
  EXPECT_DOUBLE_EQ(rows[1].hidden_ms, 9.0 + 4.0);  // [0,4) and [5,10) are covered, [4,5) is not; then [30,34)
  const std::string table = communication_table(rows);
  EXPECT_NE(table.find("all communication"), std::string::npos) << table;
  EXPECT_NE(table.find("72.2%"), std::string::npos) << table;  // 13 of 18 ms
  // GPU 0: compute kernels cover [0, 4), [5, 20) and [29, 35) of [0, 35): 25 of 35 ms; GPU 1 has none.
  const std::string busy = compute_busy_lines(records);
  EXPECT_NE(busy.find("GPU 0: busy 25.000 ms of the 35.000 ms"), std::string::npos) << busy;
  EXPECT_NE(busy.find("GPU 1: busy 0.000 ms of the 4.000 ms"), std::string::npos) << busy;
}

RunConfig parse(std::vector<std::string> args) {
  args.insert(args.begin(), {"train", MARROW_SOURCE_DIR "/configs/tiny-moe.toml", "--data.path=unused", "--train.steps=10",
                             "--schedule.warmup_steps=2"});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return parse_run_config(int(argv.size()), argv.data());
}

std::string parse_error(const std::vector<std::string>& args) {
  try {
    parse(args);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(KernelTraceProfileSteps, ParsesBothFormsAndDefaultsToNoTrace) {
  EXPECT_EQ(parse({}).profile_first, 0);
  const RunConfig joined = parse({"--profile-steps=3:4"});
  EXPECT_EQ(joined.profile_first, 3);
  EXPECT_EQ(joined.profile_last, 4);
  const RunConfig spaced = parse({"--profile-steps", "10:10"});
  EXPECT_EQ(spaced.profile_first, 10);
  EXPECT_EQ(spaced.profile_last, 10);
}

TEST(KernelTraceProfileSteps, MalformedOrOutOfRangeValuesAreOneSentence) {
  const std::string expected = "--profile-steps must be A:B with 1 <= A <= B <= train.steps (10), got ";
  for (const char* bad : {"3-4", "a:b", "3:", "3:4:5", " 3:4", "0:2", "4:3", "5:11"})
    EXPECT_EQ(parse_error({std::string("--profile-steps=") + bad}), expected + "'" + bad + "'") << bad;
  // No value at all: the run config reader refuses it before CLI11 would take the next argument.
  EXPECT_EQ(parse_error({"--profile-steps"}), "--profile-steps needs a value (write --profile-steps=VALUE)");
}

TEST(KernelTraceProfileSteps, NeedsAGpuRun) {
  EXPECT_THROW(KernelTrace trace(Device::cpu), Error);
}

// The ask fails at once, before the model or the data are touched (the corpus does not exist).
TEST(KernelTraceProfileSteps, TrainOnTheCpuFailsInOneSentence) {
  const auto result = data_testing::run_marrow("train " MARROW_SOURCE_DIR "/configs/tiny-moe.toml --model.config=" MARROW_SOURCE_DIR
                                               "/configs/tiny-moe.json --data.path=/nonexistent --train.device=cpu --profile-steps=1:1");
  EXPECT_EQ(result.exit_code, 1) << result.output;
  const std::string why = MARROW_CUDA ? "--profile-steps traces GPU kernels, but this run computes on the CPU"
                                      : "--profile-steps records kernels with CUPTI, and this build has no CUDA support "
                                        "(configure with -DMARROW_CUDA=ON)";
  EXPECT_EQ(result.output, "marrow train: error: " + why + "\n");
}

}  // namespace
}  // namespace marrow
