// Debian 12's CLI11 (2.1) cannot map TOML sections to dotted options, so the file is read with
// toml++ and handed to CLI11 as --section.key=value arguments.
#include "engine/run_config.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <vector>

#include "core/errors.h"
#include "engine/config_changes.h"

#define TOML_HEADER_ONLY 1  // Debian ships a shared library too; the GPU machine has only the headers
#include <toml++/toml.h>

namespace marrow {

namespace {

// A TOML scalar as the text of a command-line value, or "" for anything else.
std::string scalar_text(const toml::node& value) {
  if (auto v = value.as_string()) return v->get();
  if (auto v = value.as_integer()) return std::to_string(v->get());
  if (auto v = value.as_floating_point()) return fmt::format("{}", v->get());
  if (auto v = value.as_boolean()) return v->get() ? "true" : "false";
  return "";
}

std::string where(const std::string& path, const toml::source_region& at) {
  return fmt::format("{}:{}:{}", path, at.begin.line, at.begin.column);
}

// The file's keys as "--section.key=value" arguments, read by toml++ (which refuses duplicate keys,
// bad quoting and such with line:column); CLI11 then types and checks the values, so the file and
// the command line go through one set of checks.
std::vector<std::string> config_file_arguments(const std::string& path) {
  std::error_code ec;
  MARROW_CHECK(!std::filesystem::is_directory(path, ec), "run config {} is a directory; give the .toml file", path);
  MARROW_CHECK(std::ifstream(path).good(), "cannot open run config {}: no such file or it is not readable", path);
  toml::table file;
  try {
    file = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    fail("{}: {}", where(path, e.source()), std::string(e.description()));
  }
  std::vector<std::string> args;
  for (const auto& [section, content] : file) {
    const toml::table* keys = content.as_table();
    MARROW_CHECK(keys != nullptr, "{}: '{}' is outside any [section]; run-config keys live in sections such as [train]",
                 where(path, content.source()), std::string(section.str()));
    for (const auto& [key, value] : *keys) {
      const std::string name = fmt::format("{}.{}", section.str(), key.str()), text = scalar_text(value);
      MARROW_CHECK(!value.is_table() && !value.is_array(), "{}: {} must be a single value, not a {}", where(path, value.source()), name,
                   value.is_table() ? "table" : "list");
      MARROW_CHECK(!value.is_date() && !value.is_time() && !value.is_date_time(), "{}: {} must be a number, a string or a boolean, not a {}",
                   where(path, value.source()), name, value.is_time() ? "time" : "date");
      MARROW_CHECK(!text.empty(), "{}: {} has an empty value", where(path, value.source()), name);
      args.push_back("--" + name + "=" + text);
    }
  }
  return args;
}

// Validators whose messages read as one sentence: "--train.seq_len: must be positive, got -5".
// Numbers must be finite (inf, nan and 1e999 are refused here, not at the first step) and are
// echoed as given, never as a 300-digit expansion.
CLI::Validator number_in(double low, double high, bool low_open, bool high_open, const std::string& what) {
  return CLI::Validator(
      [=](std::string& value) -> std::string {
        double v = 0;
        try {
          size_t used = 0;
          v = std::stod(value, &used);
          if (used != value.size()) return fmt::format("must be a number, got '{}'", value);
        } catch (const std::exception&) {
          return fmt::format("must be a {}number, got '{}'", value.find_first_of("0123456789") != std::string::npos ? "finite " : "", value);
        }
        const bool inside = std::isfinite(v) && (low_open ? v > low : v >= low) && (high_open ? v < high : v <= high);
        return inside ? "" : fmt::format("must be {}, got {}", what, value);
      },
      "");
}
// Integers are read whole: "1.5", "1e3" and values past int64 are refused here, echoed as given.
CLI::Validator integer_at_least(int64_t low, const std::string& what) {
  return CLI::Validator(
      [=](std::string& value) -> std::string {
        try {
          size_t used = 0;
          if (std::stoll(value, &used) >= low && used == value.size()) return "";
        } catch (const std::exception&) {
        }
        return fmt::format("must be {}, got {}", what, value);
      },
      "");
}
// An unsigned 64-bit integer read whole (std::stoull would take "-1" as 2^64 - 1, so a sign is refused).
CLI::Validator unsigned_integer(const std::string& what) {
  return CLI::Validator(
      [=](std::string& value) -> std::string {
        try {
          size_t used = 0;
          if (!value.empty() && value[0] != '-' && value[0] != '+' && (std::stoull(value, &used), used == value.size())) return "";
        } catch (const std::exception&) {
        }
        return fmt::format("must be {}, got {}", what, value);
      },
      "");
}
const CLI::Validator kCount = integer_at_least(1, "a positive integer");
const CLI::Validator kCountOrZero = integer_at_least(0, "an integer, zero or more");
constexpr double kHuge = std::numeric_limits<double>::max();
const CLI::Validator kPositive = number_in(0, kHuge, true, false, "positive");
const CLI::Validator kNonNegative = number_in(0, kHuge, false, false, "zero or more");
const CLI::Validator kFinite = number_in(-kHuge, kHuge, false, false, "a finite number");
const CLI::Validator kFraction = number_in(0, 1, false, false, "between 0 and 1");
const CLI::Validator kBeta = number_in(0, 1, false, true, "at least 0 and below 1 (1 would never forget a gradient)");
// checkpoint.allow_changes: a comma-separated list of kChangeKinds.
const CLI::Validator kChangeList(
    [](std::string& value) -> std::string {
      std::stringstream in(value);
      for (std::string kind; std::getline(in, kind, ',');)
        if (std::find(kChangeKinds.begin(), kChangeKinds.end(), kind) == kChangeKinds.end())
          return fmt::format("must be a comma-separated list of {}, got '{}'", fmt::join(kChangeKinds, ", "), kind);
      return "";
    },
    "");

// parallel.pp_layers: auto, even, or a comma-separated list of positive layer counts (whether it
// fits the model and parallel.pp is checked where both are known: parallel/dualpipev.h).
const CLI::Validator kLayerCounts(
    [](std::string& value) -> std::string {
      static const std::regex counts("[1-9][0-9]{0,5}(,[1-9][0-9]{0,5})*");
      return value == "auto" || value == "even" || std::regex_match(value, counts)
                 ? ""
                 : fmt::format("must be auto, even or a comma-separated list of layer counts such as 3,5,5,3, got '{}'", value);
    },
    "");

[[noreturn]] void bad_profile_steps(int64_t steps, const std::string& got) {
  fail("--profile-steps must be A:B with 1 <= A <= B <= train.steps ({}), got '{}'", steps, got);
}

// An option with an empty value (`--output.dir=`) or none before the next option (`--output.dir
// --train.steps=10`) would take the next argument as its value: refuse both. The last `command_line`
// arguments came from the command line.
void require_values(const std::vector<std::string>& args, size_t command_line) {
  for (size_t i = args.size() - command_line; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (!a.starts_with("--") || a == "--quiet") continue;
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      MARROW_CHECK(eq + 1 < a.size(), "{} has an empty value", a.substr(0, eq));
    } else {
      MARROW_CHECK(i + 1 < args.size() && !args[i + 1].starts_with("--"), "{} needs a value (write {}=VALUE)", a, a);
      ++i;
    }
  }
}

}  // namespace

void check_run_paths(const RunConfig& rc) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string& path = rc.model_config;
  const bool exists = fs::exists(path, ec);
  MARROW_CHECK(exists && !fs::is_directory(path, ec), "{}: model.config {} {}{}", rc.source, path,
               exists ? "is a directory, not a file" : "does not exist",
               fs::path(path).is_relative()
                   ? fmt::format(" (relative paths in a run config resolve against the working directory, {})", fs::current_path(ec).string())
                   : "");
  // A checkpoint (marrow import's output, a step-XXXXXXXX directory) holds meta.json at its top, which
  // sample and export would read instead of the run's own newest checkpoint inside it.
  MARROW_CHECK(!fs::exists(fs::path(rc.out_dir) / "meta.json", ec),
               "{}: output.dir {} is a checkpoint (it holds meta.json); train into another directory, with checkpoint.resume = {} to start "
               "from it",
               rc.source, rc.out_dir, rc.out_dir);
}

void check_profile_steps(const RunConfig& rc) {
  if (rc.profile_first < 1 || rc.profile_first > rc.profile_last || rc.profile_last > rc.steps)
    bad_profile_steps(rc.steps, fmt::format("{}:{}", rc.profile_first, rc.profile_last));
}

// Every run-config key as a CLI11 option bound to rc (profile_steps receives --profile-steps).
namespace {

void add_run_config_options(CLI::App& app, RunConfig& rc, std::string& profile_steps) {
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--model.config", rc.model_config)->required();
  app.add_option("--data.path", rc.data_path)->required();
  app.add_option("--data.validation_fraction", rc.validation_fraction)->check(number_in(0, 0.5, false, false, "between 0 and 0.5"));
  app.add_option("--data.max_epochs", rc.max_epochs)->check(kCount);
  app.add_option("--data.document_mask", rc.document_mask);
  app.add_option("--data.loss_mask", rc.loss_mask);
  app.add_option("--train.steps", rc.steps)->check(kCount);
  app.add_option("--train.global_batch", rc.global_batch)->check(kCount);
  app.add_option("--train.micro_batch", rc.micro_batch)->check(kCount);
  app.add_option("--train.seq_len", rc.seq_len)->check(kCount);
  app.add_option("--train.seed", rc.seed)->check(unsigned_integer("an integer from 0 to 2^64 - 1"));
  app.add_option("--train.device", rc.device)->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--train.aux_loss_coef", rc.aux_loss_coef)->check(kFinite);
  app.add_option("--train.load_balance", rc.load_balance)->check(CLI::IsMember({"micro_batch", "global_batch", "sequence"}));
  app.add_option("--train.expert_bias_update", rc.expert_bias_update)->check(kNonNegative);
  app.add_option("--train.max_bad_steps", rc.max_bad_steps)->check(kCount);
  app.add_option("--train.dependent_launch", rc.dependent_launch);
  app.add_option("--train.attention_kernels", rc.attention_kernels)->check(CLI::IsMember({"cudnn", "own", "cudnn_nondeterministic", "hopper", "hopper_backward"}));
  app.add_option("--train.master_weights", rc.master_weights)->check(CLI::IsMember({"split", "fp32"}));
  app.add_option("--train.bf16_weight_copy", rc.bf16_weight_copy);
  app.add_option("--train.pair_expert_grads", rc.pair_expert_grads);
  app.add_option("--train.expert_inputs", rc.expert_inputs)->check(CLI::IsMember({"auto", "keep", "gather"}));
  app.add_option("--train.fp8", rc.fp8);
  app.add_option("--optimizer.lr", rc.lr)->check(kPositive);
  app.add_option("--optimizer.min_lr", rc.min_lr)->check(kNonNegative);
  app.add_option("--optimizer.beta1", rc.beta1)->check(kBeta);
  app.add_option("--optimizer.beta2", rc.beta2)->check(kBeta);
  app.add_option("--optimizer.eps", rc.eps)->check(kPositive);
  app.add_option("--optimizer.weight_decay", rc.weight_decay)->check(kNonNegative);
  app.add_option("--optimizer.grad_clip", rc.grad_clip)->check(kNonNegative);
  app.add_option("--optimizer.moments", rc.moments)->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--optimizer.kind", rc.optimizer_kind)->check(CLI::IsMember({"adamw", "muon"}));
  app.add_option("--optimizer.muon_momentum", rc.muon_momentum)->check(kBeta);
  app.add_option("--optimizer.muon_scale", rc.muon_scale)->check(kPositive);
  app.add_option("--optimizer.muon_steps", rc.muon_steps)->check(kCount);
  app.add_option("--schedule.kind", rc.schedule)->check(CLI::IsMember({"cosine", "wsd"}));
  app.add_option("--schedule.warmup_steps", rc.warmup_steps)->check(kCountOrZero);
  app.add_option("--schedule.decay_fraction", rc.decay_fraction)->check(kFraction);
  app.add_option("--output.dir", rc.out_dir);
  app.add_option("--output.log_every", rc.log_every)->check(kCount);
  app.add_option("--eval.every", rc.eval_every)->check(kCountOrZero);
  app.add_option("--eval.samples", rc.eval_samples)->check(kCount);
  app.add_option("--checkpoint.every", rc.checkpoint_every)->check(kCountOrZero);
  app.add_option("--checkpoint.keep", rc.checkpoint_keep)->check(kCount);
  app.add_option("--checkpoint.resume", rc.checkpoint_resume);
  app.add_option("--checkpoint.optimizer_state", rc.checkpoint_optimizer_state);
  app.add_option("--checkpoint.allow_changes", rc.checkpoint_allow_changes)->check(kChangeList);
  app.add_option("--parallel.pp", rc.pp)->check(kCount);
  app.add_option("--parallel.cp", rc.cp)->check(kCount);
  app.add_option("--parallel.ep", rc.ep)->check(kCount);
  app.add_option("--parallel.timeout_s", rc.timeout_s)->check(kPositive);
  app.add_option("--parallel.overlap_grad_reduce", rc.overlap_grad_reduce);
  app.add_option("--parallel.dp_shard", rc.dp_shard)->check(kCountOrZero);
  app.add_option("--parallel.keep_gathered", rc.keep_gathered);
  app.add_option("--parallel.keep_whole_grads", rc.keep_whole_grads);
  app.add_option("--parallel.schedule", rc.pipeline_schedule)->check(CLI::IsMember({"auto", "sequential", "dualpipev"}));
  app.add_option("--parallel.print_schedule", rc.print_schedule);
  app.add_option("--parallel.pp_layers", rc.pp_layers)->check(kLayerCounts);
  // Not a file key: a run's command line asks for a trace (both --profile-steps=A:B and --profile-steps A:B).
  app.add_option("--profile-steps", profile_steps, "a kernel trace of steps A:B (GPU)");
  app.add_flag("--quiet", rc.quiet, "no progress lines");
}

constexpr const char* kUsage = "usage: marrow {} <run-config> [--section.key=value ...] [--profile-steps=A:B] [--quiet]";

}  // namespace

bool print_run_config_help(int argc, char** argv) {
  if (argc < 2 || (std::string(argv[1]) != "--help" && std::string(argv[1]) != "-h")) return false;
  RunConfig rc;
  std::string profile_steps;
  CLI::App app{fmt::format(kUsage, argv[0]) +
               "\nThe run config is a TOML file of [section] key = value; --section.key=value overrides a key. Keys:"};
  add_run_config_options(app, rc, profile_steps);
  std::printf("%s", app.help().c_str());
  return true;
}

RunConfig parse_run_config(int argc, char** argv) {
  MARROW_CHECK(argc >= 2 && argv[1][0] != '-', "{} (--help lists the keys)", fmt::format(kUsage, argv[0]));
  RunConfig rc;
  rc.source = argv[1];
  CLI::App app{"marrow run"};
  std::string profile_steps;
  add_run_config_options(app, rc, profile_steps);

  std::vector<std::string> args = config_file_arguments(rc.source);
  rc.overrides.assign(argv + 2, argv + argc);
  args.insert(args.end(), rc.overrides.begin(), rc.overrides.end());
  require_values(args, size_t(argc - 2));
  // CLI11 parses a reversed vector (last element first).
  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::ExtrasError&) {
    std::string unknown;
    for (const std::string& a : app.remaining()) unknown += (unknown.empty() ? "" : ", ") + a.substr(0, a.find('='));
    fail("{}: unknown run-config key {} (known sections: model, data, train, optimizer, schedule, output, eval, checkpoint, parallel)", rc.source, unknown);
  } catch (const CLI::ParseError& e) {
    fail("{}: {}", rc.source, e.what());
  }

  MARROW_CHECK(rc.global_batch % rc.micro_batch == 0, "{}: train.micro_batch ({}) does not divide train.global_batch ({})", rc.source,
               rc.micro_batch, rc.global_batch);
  // Counts of samples and tokens are int64 everywhere; a run past 2^62 tokens is a typo, not a run.
  const __int128 tokens = __int128(rc.steps) * rc.global_batch * (__int128(rc.seq_len) + 1);
  MARROW_CHECK(tokens < (__int128(1) << 62),
               "{}: train.steps x train.global_batch x (train.seq_len + 1) is {:.3g} tokens, more than any corpus holds", rc.source,
               double(tokens));
  MARROW_CHECK(rc.warmup_steps <= rc.steps, "{}: schedule.warmup_steps ({}) exceeds train.steps ({})", rc.source, rc.warmup_steps,
               rc.steps);
  MARROW_CHECK(rc.min_lr <= rc.lr, "{}: optimizer.min_lr ({}) exceeds optimizer.lr ({})", rc.source, rc.min_lr, rc.lr);
  MARROW_CHECK(rc.bf16_weight_copy || rc.master_weights == "fp32",
               "{}: train.bf16_weight_copy = false needs train.master_weights = \"fp32\": split master weights keep the bf16 copy as "
               "their high halves, so there is no copy to drop",
               rc.source);
  MARROW_CHECK(rc.moments != "bf16" || rc.beta2 <= 0.99,
               "{}: optimizer.moments = \"bf16\" needs optimizer.beta2 <= 0.99, got {}: a bf16 moment holds 8 significant bits, and "
               "v's per-step change of {:g} would round away (use fp32 moments)",
               rc.source, rc.beta2, 1 - rc.beta2);
  MARROW_CHECK(rc.optimizer_kind != "muon" || rc.moments == "fp32",
               "{}: optimizer.kind = \"muon\" keeps its momentum in the first-moment arena in fp32: optimizer.moments must be \"fp32\"",
               rc.source);
  if (app.count("--profile-steps") > 0) {
    std::smatch range;
    if (!std::regex_match(profile_steps, range, std::regex(R"((\d{1,18}):(\d{1,18}))"))) bad_profile_steps(rc.steps, profile_steps);
    rc.profile_first = std::stoll(range[1]);
    rc.profile_last = std::stoll(range[2]);
    check_profile_steps(rc);
  }
  return rc;
}

}  // namespace marrow
