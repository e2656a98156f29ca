// The training loop: data -> micro-batches through forward/backward -> gradient norm, clipping and
// AdamW -> one human line and one JSON line per step. Gradients accumulate over the micro-batches of
// a step; the loss is the mean over all counted tokens of the step, plus the load-balance loss
// (mean over layers and micro-batches) times its coefficient.
#pragma once
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>

#include "core/memory.h"
#include "core/tensor_spec.h"
#include "data/dataset.h"
#include "engine/checkpoint.h"
#include "engine/kernel_trace.h"
#include "engine/lr_schedule.h"
#include "engine/run_config.h"
#include "engine/step.h"
#include "ops/adamw.h"
#include "ops/cast.h"
#include "ops/cross_entropy.h"
#include "ops/grad_norm.h"

namespace marrow {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0, load_balance = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, step_ms = 0;
  size_t peak_bytes = 0;
  bool skipped = false;
  double val_loss = std::numeric_limits<double>::quiet_NaN();  // mean over eval.samples when evaluated
  std::array<double, kStageCount> stage_ms{};  // filled when train() is given a StageTimer
};

inline std::string step_line(const StepMetrics& s, int64_t total) {
  return fmt::format("step {}/{} | loss {:.4f} | lb {:.3f} | lr {:.3e} | grad {:.3f} | {:.0f} tok/s | {:.0f} ms | peak {:.2f} GiB{}{}", s.step,
                     total, s.loss, s.load_balance, s.lr, s.grad_norm, s.tokens_per_s, s.step_ms, s.peak_bytes / 1073741824.0,
                     std::isnan(s.val_loss) ? "" : fmt::format(" | val loss {:.4f}", s.val_loss),
                     s.skipped ? " | SKIPPED (non-finite)" : "");
}

inline std::string step_json(const StepMetrics& s) {
  Json j{{"step", s.step},         {"loss", s.loss},         {"load_balance", s.load_balance}, {"lr", s.lr},
         {"grad_norm", s.grad_norm}, {"tokens_per_s", s.tokens_per_s}, {"step_ms", s.step_ms}, {"peak_bytes", s.peak_bytes},
         {"skipped", s.skipped}};
  if (!std::isnan(s.val_loss)) j["val_loss"] = s.val_loss;
  return j.dump();
}

// A micro-batch of B samples of S + 1 tokens: inputs are tokens [0, S), targets [1, S + 1).
template <MoeModel M>
typename M::Batch make_batch(const std::vector<int32_t>& tokens, int64_t B, int64_t S, Device device) {
  const int64_t T = B * S;
  Buffer ids(DType::i32, Device::cpu, {T}), targets(DType::i32, Device::cpu, {T}), positions(DType::i32, Device::cpu, {T});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      ids.ptr<int32_t>()[b * S + s] = tokens[size_t(b * (S + 1) + s)];
      targets.ptr<int32_t>()[b * S + s] = tokens[size_t(b * (S + 1) + s + 1)];
      positions.ptr<int32_t>()[b * S + s] = int32_t(s);
    }
  if (device == Device::cpu) return {B, S, std::move(ids), std::move(targets), std::move(positions)};
  typename M::Batch batch{B, S, Buffer(DType::i32, device, {T}), Buffer(DType::i32, device, {T}), Buffer(DType::i32, device, {T})};
  copy(batch.input_ids, ids);
  copy(batch.targets, targets);
  copy(batch.positions, positions);
  return batch;
}

// Mean cross-entropy per target over the first `samples` held-out sequences, forward only, in
// micro-batches of `micro`: the same sequences at every evaluation, so the numbers are comparable.
template <MoeModel M>
double validation_loss(const M& model, const typename M::Weights& w, const TokenDataset& data, int64_t samples, int64_t micro,
                       int64_t S, Device device) {
  std::vector<int32_t> tokens;
  double loss_sum = 0;
  for (int64_t first = 0; first < samples; first += micro) {
    const int64_t B = std::min(micro, samples - first);
    tokens.resize(size_t(B * (S + 1)));
    data.validation_batch(first, B, tokens.data());
    MicroBatch<M> mb;
    forward(mb, model, w, make_batch<M>(tokens, B, S, device));
    loss_sum += mb.token_loss_sum;
  }
  return loss_sum / double(samples * S);
}

inline Device choose_device(const std::string& requested) {
  if (requested == "cpu") return Device::cpu;
  if (requested == "cuda") {
    MARROW_CHECK(cuda_available(), "train.device = cuda but {}", MARROW_CUDA ? "no GPU is visible" : "this build has no CUDA support");
    return Device::cuda;
  }
  return cuda_available() ? Device::cuda : Device::cpu;
}

// timer, when given, splits each step's time by stage into StepMetrics::stage_ms (marrow bench).
template <MoeModel M>
std::vector<StepMetrics> train(const RunConfig& rc, const typename M::Config& model_config, StageTimer* timer = nullptr) {
  const Device device = choose_device(rc.device);
  // --profile-steps: the trace exists before any NVTX range (see KernelTrace); the stages are NVTX
  // ranges only when timed, so a traced run times them.
  std::optional<KernelTrace> trace;
  std::optional<StageTimer> traced_stages;
  if (rc.profile_first > 0) {
    check_profile_steps(rc);
    trace.emplace(device);
    if (!timer) timer = &traced_stages.emplace(device);
  }
  if (device == Device::cuda) keep_pool_memory();
  // The GPU computes in bf16 from a working copy of the fp32 master weights; the CPU in fp32.
  M model(model_config, device == Device::cuda ? DType::bf16 : DType::f32, device);
  TokenDataset data(rc.data_path, rc.seq_len, rc.seed, rc.validation_fraction);
  data.require_vocab_fits(model_config.vocab_size);
  data.require_train_samples(rc.steps * rc.global_batch);
  data.set_samples_per_step(rc.global_batch);
  MARROW_CHECK(rc.eval_every == 0 || rc.eval_samples <= data.validation_samples(),
               "corpus {} holds {} validation samples of {} tokens but eval.samples is {} (lower it or raise data.validation_fraction)",
               rc.data_path, data.validation_samples(), rc.seq_len + 1, rc.eval_samples);

  const int64_t n = model.num_parameters();
  Arena params("parameters", DType::f32, device, n);
  Arena grads("gradients", DType::f32, device, n);
  Arena exp_avg("adam exp_avg", DType::f32, device, n);
  Arena exp_avg_sq("adam exp_avg_sq", DType::f32, device, n);
  std::vector<const Arena*> arenas{&params, &grads, &exp_avg, &exp_avg_sq};
  std::optional<Arena> working;  // bf16 weights the GPU computes with
  if (device == Device::cuda) {
    working.emplace("bf16 weights", DType::bf16, device, n);
    arenas.push_back(&*working);
  }
  model.initialize(params, rc.seed);
  const auto w = model.bind(working ? *working : params);
  const auto g = model.bind(grads);
  // The gradients a step zeroes: all but those its first backward writes, as runs of the arena
  // (the spec table is in arena order).
  std::vector<Tensor> zeroed_each_step;
  int64_t run_begin = 0, run_end = 0;
  auto close_run = [&] {
    if (run_end > run_begin) zeroed_each_step.push_back(grads.slice(run_begin, {run_end - run_begin}));
  };
  for (const TensorSpec& s : model.specs()) {
    if (s.first_backward_writes) continue;
    if (s.offset != run_end) {
      close_run();
      run_begin = s.offset;
    }
    run_end = s.offset + s.numel;
  }
  close_run();
  size_t arena_bytes = 0;
  for (const Arena* a : arenas) arena_bytes += a->bytes();
  std::printf("model %s on %s: %.2fM parameters (%.2fM active per token), %lld layers, %lld experts top-%lld\n", M::model_type,
              device_name(device), model.num_parameters() / 1e6, model.num_active_parameters() / 1e6, (long long)model.num_layers(),
              (long long)model.num_experts(), (long long)model.top_k());
  std::printf("memory: %s\n", memory_bill(arenas).c_str());
  std::printf("data: %s, %lld training samples of %lld tokens; %lld steps x %lld sequences (micro-batch %lld)\n", rc.data_path.c_str(),
              (long long)data.train_samples(), (long long)rc.seq_len + 1, (long long)rc.steps, (long long)rc.global_batch,
              (long long)rc.micro_batch);
  std::fflush(stdout);

  // Checkpoints (engine/checkpoint.h): resume from the newest in output.dir or checkpoint.resume.
  TrainCheckpoints checkpoints(rc, model_config.json, model.specs(), {&params, &exp_avg, &exp_avg_sq});
  const int64_t first_step = checkpoints.resume() + 1;
  if (working) cast(working->all(), params.all());
  std::filesystem::create_directories(rc.out_dir);
  const std::string metrics_path = rc.out_dir + "/metrics.jsonl";
  if (first_step > rc.steps) {
    std::printf("the run is complete: its checkpoint is at step %lld of train.steps = %lld\n", (long long)first_step - 1,
                (long long)rc.steps);
    return {};
  }
  if (first_step > 1) keep_metrics_through(metrics_path, first_step - 1);
  std::ofstream metrics(metrics_path, first_step > 1 ? std::ios::app : std::ios::trunc);
  MARROW_CHECK(metrics.good(), "cannot write {}", metrics_path);

  const LrSchedule schedule{rc.schedule, rc.lr, rc.min_lr, rc.warmup_steps, rc.steps, rc.decay_fraction};
  const double aux_coef = rc.aux_loss_coef >= 0 ? rc.aux_loss_coef : model_config.router_aux_loss_coef;
  const int64_t micro_batches = rc.global_batch / rc.micro_batch, S = rc.seq_len, B = rc.micro_batch;
  std::vector<int32_t> tokens(size_t(B * (S + 1)));
  std::vector<StepMetrics> history;
  int64_t bad_in_a_row = 0;
  StopSignals stop;  // SIGTERM/SIGINT: finish the step, save, return

  for (int64_t step = first_step; step <= rc.steps; ++step) {
    if (trace && !trace->running() && step >= rc.profile_first && step <= rc.profile_last) trace->start();
    std::optional<NvtxRange> step_range(std::in_place, fmt::format("step {}", step));
    const auto start = std::chrono::steady_clock::now();
    for (const Tensor& t : zeroed_each_step) fill_zero(t);
    // Every target of a sample is a real next token, so the step's counted tokens are known upfront.
    const double loss_scale = 1.0 / double(rc.global_batch * S);
    const double aux_grad = aux_coef / double(model.num_layers() * micro_batches);
    double token_loss_sum = 0, aux_loss_sum = 0;
    for (int64_t micro = 0; micro < micro_batches; ++micro) {
      data.train_batch(step - 1, micro * B, B, tokens.data());
      const typename M::Batch batch = make_batch<M>(tokens, B, S, device);
      MicroBatch<M> mb;
      forward(mb, model, w, batch, timer);
      token_loss_sum += mb.token_loss_sum;
      aux_loss_sum += mb.aux_loss_sum;
      backward(mb, model, w, g, batch, loss_scale, aux_grad, micro == 0, timer);
    }

    StepMetrics m;
    m.step = step;
    m.loss = token_loss_sum * loss_scale;
    // Reported normalised so that perfectly balanced routing reads 1.0.
    m.load_balance = aux_loss_sum / double(model.num_layers() * micro_batches * model.top_k());
    m.lr = schedule.at(step);
    std::optional<StageScope> optimizer_scope(std::in_place, timer, Stage::optimizer);
    m.grad_norm = l2_norm(grads.all());
    if (!std::isfinite(m.loss) || !std::isfinite(m.grad_norm)) {
      m.skipped = true;
      ++bad_in_a_row;
      std::fprintf(stderr, "warning: step %lld has a non-finite loss (%g) or gradient norm (%g); the update is skipped\n",
                   (long long)step, m.loss, m.grad_norm);
      MARROW_CHECK(bad_in_a_row < rc.max_bad_steps, "stopping at step {}: {} steps in a row had a non-finite loss or gradient norm",
                   step, bad_in_a_row);
    } else {
      bad_in_a_row = 0;
      const int64_t decayed = model.num_decayed_parameters();
      auto range = [&](const Arena& a, int64_t begin, int64_t end) { return a.slice(begin, {end - begin}); };
      // One pass over the arenas: clipping scales the gradient inside the step, which also writes
      // the bf16 working weights.
      auto working_range = [&](int64_t begin, int64_t end) { return working ? range(*working, begin, end) : Tensor{}; };
      AdamWHyper hyper{m.lr, rc.beta1, rc.beta2, rc.eps, rc.weight_decay, step};
      if (rc.grad_clip > 0 && m.grad_norm > rc.grad_clip) hyper.grad_scale = rc.grad_clip / m.grad_norm;
      adamw_step(range(params, 0, decayed), working_range(0, decayed), range(exp_avg, 0, decayed), range(exp_avg_sq, 0, decayed),
                 range(grads, 0, decayed), hyper);
      hyper.weight_decay = 0;
      adamw_step(range(params, decayed, n), working_range(decayed, n), range(exp_avg, decayed, n), range(exp_avg_sq, decayed, n),
                 range(grads, decayed, n), hyper);
    }
    optimizer_scope.reset();
    if (device == Device::cuda) synchronize();
    step_range.reset();
    if (timer) {
      const std::array<double, kStageCount> before = timer->total_ms();
      timer->collect();
      for (int i = 0; i < kStageCount; ++i) m.stage_ms[size_t(i)] = timer->total_ms()[size_t(i)] - before[size_t(i)];
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    m.step_ms = seconds * 1e3;
    m.tokens_per_s = double(rc.global_batch * S) / seconds;
    m.peak_bytes = device == Device::cuda ? arena_bytes + peak_memory_bytes(device) : peak_memory_bytes(device);
    // After the step's timing: evaluation is not training speed.
    const bool evaluate = rc.eval_every > 0 && (step % rc.eval_every == 0 || step == rc.steps);
    if (evaluate) m.val_loss = validation_loss(model, w, data, rc.eval_samples, rc.micro_batch, S, device);
    if (step % rc.log_every == 0 || step == 1 || step == rc.steps || m.skipped || evaluate) {
      std::printf("%s\n", step_line(m, rc.steps).c_str());
      std::fflush(stdout);
    }
    metrics << step_json(m) << "\n";
    metrics.flush();
    history.push_back(m);
    const int stop_signal = StopSignals::received();
    if (trace && trace->running() && (step == rc.profile_last || stop_signal != 0))
      report_trace(trace->stop(), fmt::format("{}/trace-steps-{}-{}.json", rc.out_dir, std::max(rc.profile_first, first_step), step));
    const std::string saved = checkpoints.due(step, stop_signal != 0) ? checkpoints.save(step) : "";
    if (stop_signal != 0 && step < rc.steps) {
      std::printf("stopped by %s after step %lld: %s\n", stop_signal == SIGTERM ? "SIGTERM" : "SIGINT", (long long)step,
                  saved.empty() ? "no checkpoint (checkpoint.every = 0)"
                                : ("checkpoint in " + saved + "; run the same command again to resume").c_str());
      std::fflush(stdout);
      break;
    }
  }
  return history;
}

}  // namespace marrow
