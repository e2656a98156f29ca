// marrow estimate <run-config> [--section.key=value ...] [--world N] [--gpu-memory GiB] [--layouts]:
// one process's memory bill (engine/memory_estimate.h) against the GPU's memory, and the largest
// micro-batch and sequence that fit; --layouts lists every layout of the world with its peak per GPU.
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "apps/model_switch.h"
#include "core/memory.h"
#include "engine/checkpoint.h"
#include "engine/memory_estimate.h"
#include "ops/attention.h"

namespace marrow {

namespace {

// One H100's memory as CUDA reports it (the trainer's start-up line: "GPU free ... of 79.2 GiB"): the
// GPU the device machines give by default, assumed where no GPU is visible.
constexpr double kH100GiB = 79.2;

struct EstimateOptions {
  int64_t world = 1;
  double gpu_gib = 0;  // 0 until --gpu-memory or default_gpu_memory sets it
  std::string gpu_source = "given by --gpu-memory";
  bool layouts = false;
};

// The memory of the GPU the trainer would train on (device 0), or one H100's where none is visible.
void default_gpu_memory(EstimateOptions& o) {
  const size_t visible = device_memory_bytes(Device::cuda, 0);
  o.gpu_gib = visible > 0 ? double(visible) / 1073741824.0 : kH100GiB;
  o.gpu_source = visible > 0 ? "GPU 0's, as CUDA reports it; --gpu-memory sets another"
                             : "no GPU visible, so one H100's; --gpu-memory sets another";
}

// The value of --name=V or --name V at args[i] (advancing i past V), or nothing for another argument.
std::optional<std::string> option_value(const std::vector<std::string>& args, size_t& i, const std::string& name) {
  const std::string& a = args[i];
  if (a.starts_with(name + "=")) return a.substr(name.size() + 1);
  if (a != name) return std::nullopt;
  MARROW_CHECK(i + 1 < args.size() && !args[i + 1].starts_with("--"), "{} needs a value (write {}=VALUE)", name, name);
  return args[++i];
}

// One GPU's memory in GiB at most: far above any GPU's, and finite (inf would fit anything).
constexpr double kMostGpuGiB = 65536;

// Takes --world and --gpu-memory out of args, so that the run config's parser sees only its keys.
EstimateOptions take_options(std::vector<std::string>& args) {
  EstimateOptions o;
  std::vector<std::string> rest;
  for (size_t i = 0; i < args.size(); ++i) {
    if (const auto world = option_value(args, i, "--world")) {
      size_t used = 0;
      try {
        o.world = std::stoll(*world, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      MARROW_CHECK(used == world->size() && used > 0 && o.world >= 1, "--world must be a whole number of processes, at least 1, got '{}'",
                   *world);
    } else if (const auto gib = option_value(args, i, "--gpu-memory")) {
      size_t used = 0;
      try {
        o.gpu_gib = std::stod(*gib, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      MARROW_CHECK(used == gib->size() && used > 0 && o.gpu_gib > 0 && o.gpu_gib <= kMostGpuGiB,
                   "--gpu-memory must be a positive number of GiB, at most {} (one GPU's memory), got '{}'", kMostGpuGiB, *gib);
    } else if (args[i] == "--layouts") {
      o.layouts = true;
    } else {
      rest.push_back(args[i]);
    }
  }
  args = std::move(rest);
  if (o.gpu_gib == 0) default_gpu_memory(o);
  return o;
}

std::string fit_lines(const LargestFit& fit, const RunConfig& rc) {
  if (fit.micro_batch == 0 && fit.seq_len == 0)
    return "nothing fits, not even one token per micro-batch: spread the weights and optimizer state over more processes "
           "(--world, parallel.dp_shard, parallel.ep)\n";
  const char* limit = " or more (the search stops at 2^31 tokens a micro-batch)";
  const std::string batch = fit.micro_batch > 0 ? fmt::format("largest train.micro_batch that fits at seq_len {}: {}{}\n", rc.seq_len,
                                                              fit.micro_batch, fit.micro_batch_at_limit ? limit : "")
                                                : fmt::format("no train.micro_batch fits at seq_len {}\n", rc.seq_len);
  return batch + fmt::format("largest train.seq_len that fits at micro_batch {}: {}{}\n", rc.micro_batch, fit.seq_len,
                             fit.seq_len_at_limit ? limit : "");
}

// Every layout of `world` processes the trainer accepts with rc's other settings (parallel.cp kept):
// pp and ep dividing the world, dp_shard 1 (replicated) or all of dp (ZeRO-3), each with the
// trainer's peak per GPU against gpu_bytes, the layouts that fit first, the smallest peak first.
template <MoeModel M>
std::string layout_table(const RunConfig& rc, const typename M::Config& config, int64_t world, Device device, double gpu_bytes) {
  struct Row {
    std::string layout;
    double peak;
  };
  std::vector<Row> rows;
  for (int64_t pp = 1; pp <= world; ++pp)
    for (int64_t ep = 1; ep <= world / pp; ++ep)
      for (const int64_t dp_shard : {int64_t(0), int64_t(1)}) {
        if (world % (pp * ep) != 0) continue;
        RunConfig candidate = rc;
        candidate.pp = pp;
        candidate.ep = ep;
        candidate.dp_shard = dp_shard;
        try {
          const MeshShape mesh = estimate_mesh(candidate, config.num_experts, world);
          if (dp_shard == 1 && mesh.dp == 1) continue;  // the same layout as dp_shard = 0
          check_global_batch(candidate, mesh);
          rows.push_back({mesh.describe(), double(estimate_memory<M>(candidate, config, world, device, gpu_bytes).total())});
        } catch (const Error&) {
          // A layout the trainer refuses (sizes that do not divide, too few layers or micro-batches).
        }
      }
  std::stable_sort(rows.begin(), rows.end(), [&](const Row& a, const Row& b) {
    return (a.peak <= gpu_bytes) != (b.peak <= gpu_bytes) ? a.peak <= gpu_bytes : a.peak < b.peak;
  });
  std::string out = fmt::format("layouts of {} processes (total per GPU against {:.2f} GiB):\n", world, gpu_bytes / 1073741824.0);
  for (const Row& r : rows)
    out += fmt::format("  {:<58} {:>9.2f} GiB  {}\n", r.layout, r.peak / 1073741824.0, r.peak <= gpu_bytes ? "fits" : "does NOT fit");
  if (rows.empty()) out += "  none the trainer accepts with these settings (global_batch, micro_batch, layers, experts)\n";
  return out;
}

}  // namespace

int estimate_command(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  const EstimateOptions options = take_options(args);
  std::vector<char*> pointers;
  for (std::string& a : args) pointers.push_back(a.data());
  const RunConfig rc = parse_run_config(int(pointers.size()), pointers.data());
  set_attention_kernels(parse_attention_kernels(rc.attention_kernels));  // their scratch differs
  // An estimate is for the GPU unless the run is asked to train on the CPU.
  const Device device = rc.device == "cpu" ? Device::cpu : Device::cuda;
  const double gpu_bytes = options.gpu_gib * 1073741824.0;
  std::printf("GPU memory: %.2f GiB (%s)\n", options.gpu_gib, options.gpu_source.c_str());
  with_model(read_json_file(rc.model_config), rc.model_config, [&]<class M>(const typename M::Config& config) {
    if (options.layouts) {
      std::printf("%s", layout_table<M>(rc, config, options.world, device, gpu_bytes).c_str());
      return;
    }
    check_global_batch(rc, estimate_mesh(rc, config.num_experts, options.world));
    const double device_bytes = device == Device::cuda ? gpu_bytes : 0;
    const MemoryBill bill = estimate_memory<M>(rc, config, options.world, device, device_bytes);
    std::printf("%s", format_bill(bill, gpu_bytes).c_str());
    if (device == Device::cuda && double(bill.total()) > gpu_bytes)
      std::printf("%s", format_memory_options(memory_options<M>(rc, config, options.world, device, device_bytes), gpu_bytes).c_str());
    if (rc.uses_dualpipev())
      std::printf("\n%s", with_estimated_model<M>(rc, config, options.world, device, [&](const EstimatedModel& m, const MeshShape& mesh) {
                    return pipeline_report(rc, m, mesh);
                  }).c_str());
    if (device == Device::cuda) std::printf("%s", fit_lines(largest_fit<M>(rc, config, options.world, device, gpu_bytes), rc).c_str());
    // Every process writes its shards into one directory (TrainCheckpoints::require_disk_space).
    const double checkpoint_bytes = double(M(config, DType::f32, Device::cpu).num_parameters()) * double(checkpoint_bytes_per_parameter(rc));
    std::printf("one checkpoint: %.2f GiB in output.dir (%s, all processes together)\n", checkpoint_bytes / 1073741824.0,
                checkpoint_contents(rc).c_str());
  });
  return 0;
}

}  // namespace marrow
