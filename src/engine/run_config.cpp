#include "engine/run_config.h"

#include <CLI/CLI.hpp>
#include <fstream>
#include <regex>
#include <vector>

#include "core/errors.h"

namespace marrow {

namespace {

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r"), e = s.find_last_not_of(" \t\r");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// The file's lines as "--section.key=value" arguments. CLI11 2.1 (Debian 12) does not map TOML
// sections onto dotted option names, so the file syntax is read here and CLI11 types the values.
std::vector<std::string> config_file_arguments(const std::string& path) {
  std::ifstream in(path);
  MARROW_CHECK(in.good(), "cannot open run config {}: no such file or it is not readable", path);
  std::vector<std::string> args;
  std::string line, section;
  for (int number = 1; std::getline(in, line); ++number) {
    bool quoted = false;
    for (size_t i = 0; i < line.size(); ++i) {
      if (line[i] == '"') quoted = !quoted;
      if (line[i] == '#' && !quoted) {
        line.resize(i);
        break;
      }
    }
    line = trim(line);
    if (line.empty()) continue;
    if (line.front() == '[') {
      MARROW_CHECK(line.back() == ']', "{}:{}: malformed section header '{}'", path, number, line);
      section = trim(line.substr(1, line.size() - 2));
      continue;
    }
    size_t eq = line.find('=');
    MARROW_CHECK(eq != std::string::npos, "{}:{}: expected 'key = value', got '{}'", path, number, line);
    std::string key = trim(line.substr(0, eq)), value = trim(line.substr(eq + 1));
    MARROW_CHECK(!key.empty() && !value.empty(), "{}:{}: expected 'key = value', got '{}'", path, number, line);
    if (value.size() >= 2 && value.front() == '"' && value.back() == '"') value = value.substr(1, value.size() - 2);
    MARROW_CHECK(!value.empty(), "{}:{}: {} has an empty value", path, number, key);
    args.push_back("--" + (section.empty() ? key : section + "." + key) + "=" + value);
  }
  return args;
}

// Validators whose messages read as one sentence: "--train.seq_len: must be positive, got -5".
CLI::Validator number_at_least(double low, bool inclusive) {
  return CLI::Validator(
      [=](std::string& value) -> std::string {
        double v = 0;
        try {
          v = std::stod(value);
        } catch (const std::exception&) {
          return "must be a number, got '" + value + "'";
        }
        if (inclusive ? v >= low : v > low) return "";
        return fmt::format("must be {}, got {}", low == 0 ? (inclusive ? "zero or more" : "positive") : "larger", value);
      },
      "");
}
const CLI::Validator kPositive = number_at_least(0, false);
const CLI::Validator kNonNegative = number_at_least(0, true);

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

void check_profile_steps(const RunConfig& rc) {
  if (rc.profile_first < 1 || rc.profile_first > rc.profile_last || rc.profile_last > rc.steps)
    bad_profile_steps(rc.steps, fmt::format("{}:{}", rc.profile_first, rc.profile_last));
}

RunConfig parse_run_config(int argc, char** argv) {
  MARROW_CHECK(argc >= 2 && argv[1][0] != '-', "usage: marrow {} <run-config> [--section.key=value ...] [--profile-steps=A:B] [--quiet]", argv[0]);
  RunConfig rc;
  rc.source = argv[1];
  CLI::App app{"marrow run"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--model.config", rc.model_config)->required();
  app.add_option("--data.path", rc.data_path)->required();
  app.add_option("--data.validation_fraction", rc.validation_fraction)->check(CLI::Range(0.0, 0.5));
  app.add_option("--train.steps", rc.steps)->check(kPositive);
  app.add_option("--train.global_batch", rc.global_batch)->check(kPositive);
  app.add_option("--train.micro_batch", rc.micro_batch)->check(kPositive);
  app.add_option("--train.seq_len", rc.seq_len)->check(kPositive);
  app.add_option("--train.seed", rc.seed);
  app.add_option("--train.device", rc.device)->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--train.aux_loss_coef", rc.aux_loss_coef);
  app.add_option("--train.max_bad_steps", rc.max_bad_steps)->check(kPositive);
  app.add_option("--optimizer.lr", rc.lr)->check(kPositive);
  app.add_option("--optimizer.min_lr", rc.min_lr)->check(kNonNegative);
  app.add_option("--optimizer.beta1", rc.beta1)->check(CLI::Range(0.0, 1.0));
  app.add_option("--optimizer.beta2", rc.beta2)->check(CLI::Range(0.0, 1.0));
  app.add_option("--optimizer.eps", rc.eps)->check(kPositive);
  app.add_option("--optimizer.weight_decay", rc.weight_decay)->check(kNonNegative);
  app.add_option("--optimizer.grad_clip", rc.grad_clip)->check(kNonNegative);
  app.add_option("--schedule.kind", rc.schedule)->check(CLI::IsMember({"cosine", "wsd"}));
  app.add_option("--schedule.warmup_steps", rc.warmup_steps)->check(kNonNegative);
  app.add_option("--schedule.decay_fraction", rc.decay_fraction)->check(CLI::Range(0.0, 1.0));
  app.add_option("--output.dir", rc.out_dir);
  app.add_option("--output.log_every", rc.log_every)->check(kPositive);
  app.add_option("--eval.every", rc.eval_every)->check(kNonNegative);
  app.add_option("--eval.samples", rc.eval_samples)->check(kPositive);
  app.add_option("--checkpoint.every", rc.checkpoint_every)->check(kNonNegative);
  app.add_option("--checkpoint.keep", rc.checkpoint_keep)->check(kPositive);
  app.add_option("--checkpoint.resume", rc.checkpoint_resume);
  app.add_option("--checkpoint.optimizer_state", rc.checkpoint_optimizer_state);
  app.add_option("--parallel.pp", rc.pp)->check(kPositive);
  app.add_option("--parallel.cp", rc.cp)->check(kPositive);
  app.add_option("--parallel.ep", rc.ep)->check(kPositive);
  app.add_option("--parallel.timeout_s", rc.timeout_s)->check(kPositive);
  app.add_option("--parallel.overlap_grad_reduce", rc.overlap_grad_reduce);
  app.add_option("--parallel.dp_shard", rc.dp_shard)->check(kNonNegative);
  app.add_option("--parallel.keep_gathered", rc.keep_gathered);
  app.add_option("--parallel.keep_whole_grads", rc.keep_whole_grads);
  app.add_option("--parallel.schedule", rc.pipeline_schedule)->check(CLI::IsMember({"auto", "sequential", "dualpipev"}));
  app.add_option("--parallel.print_schedule", rc.print_schedule);
  // Not a file key: a run's command line asks for a trace (both --profile-steps=A:B and --profile-steps A:B).
  std::string profile_steps;
  app.add_option("--profile-steps", profile_steps);
  app.add_flag("--quiet", rc.quiet);

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
  MARROW_CHECK(rc.warmup_steps <= rc.steps, "{}: schedule.warmup_steps ({}) exceeds train.steps ({})", rc.source, rc.warmup_steps,
               rc.steps);
  MARROW_CHECK(rc.min_lr <= rc.lr, "{}: optimizer.min_lr ({}) exceeds optimizer.lr ({})", rc.source, rc.min_lr, rc.lr);
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
