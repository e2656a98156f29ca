// The training loop: data -> micro-batches through forward/backward -> gradients reduced over the
// data-parallel processes -> gradient norm, clipping and AdamW -> one human line and one JSON line
// per step. The loss is the mean over every process's counted tokens of the step, plus the
// load-balance loss (mean over layers and micro-batches) times its coefficient.
// Each process takes its share of every global batch (data-parallel width dp x ep), holds its
// expert-parallel rank's experts and its shard of the sharded state (parallel/sharded_params.h);
// a cp group takes the same samples, each rank its zigzag share of every sequence (SequenceShare).
// World rank 0 alone prints and writes metrics; every rank writes its shards into the checkpoint.
// The gradient norm takes the expert gradients' sums of squares from expert_squares, which every
// backward of a step updates (bands of the experts each dW call writes; a step's first call
// overwrites). A new path that writes expert gradients (another schedule, a new model's experts)
// passes the same squares to every one of its backwards, or the norm silently uses stale bands
// (python.test_parallel's DualPipeV-equals-sequential rows and
// Qwen3Moe.ExpertSquaresOfTheLastBackwardGiveTheGradientNorm catch a missed path).
// expert_known_zero flags experts whose gradients are all zeros, kept from step to step, so an
// overwriting dW call skips an empty expert (grouped_linear.h's known_zero) and AdamW takes its
// gradient as zero without reading it (adamw_step_known_zero via ShardedParameters::optimizer_step's
// `known`). The flags trust that only the dW calls write those gradients between steps: a new writer
// (a reduction, a reset, a loaded state) clears them (fills them with 0) or runs without them.
// prolog_known_zero does the same by rows for the embedding gradient (ops/known_zero.h).
#pragma once
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <thread>

#include "core/memory.h"
#include "core/tensor_spec.h"
#include "data/dataset.h"
#include "engine/checkpoint.h"
#include "engine/kernel_trace.h"
#include "engine/lr_schedule.h"
#include "engine/memory_estimate.h"
#include "engine/metrics_log.h"
#include "engine/pipeline_step.h"
#include "engine/run_config.h"
#include "engine/run_lock.h"
#include "engine/step.h"
#include "engine/tensorboard.h"
#include "ops/adamw.h"
#include "ops/attention.h"
#include "ops/grouped_linear_fp8.h"
#include "ops/launch.h"
#include "ops/cast.h"
#include "ops/cross_entropy.h"
#include "ops/grad_norm.h"
#include "ops/router.h"
#include "parallel/mesh.h"
#include "parallel/process.h"
#include "parallel/ring_attention.h"
#include "parallel/sharded_params.h"
#include "parallel/watchdog.h"

namespace marrow {

struct StepMetrics {
  int64_t step = 0;
  int64_t tokens_seen = 0;  // targets trained on through this step (TrainCheckpoints::tokens_seen)
  double loss = 0, load_balance = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, step_ms = 0;
  size_t peak_bytes = 0;
  bool skipped = false;
  double val_loss = std::numeric_limits<double>::quiet_NaN();  // mean over eval.samples when evaluated
  std::array<double, kStageCount> stage_ms{};  // filled when train() is given a StageTimer
  ExpertTraffic expert_traffic;  // this process's rows sent to other expert-parallel ranks (parallel.ep > 1)
  std::vector<std::vector<double>> expert_load;  // train.expert_bias_update: each layer's copies routed to each expert
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
  j["tokens_seen"] = s.tokens_seen;
  if (!s.expert_load.empty()) j["expert_load"] = s.expert_load;
  return j.dump();
}

// This process's tokens of every sequence: all of them, or with context parallelism the zigzag
// split's two chunks (parallel/ring_attention.h). A span holds a piece's inputs and its last
// target (one token more).
struct SequenceShare {
  int64_t tokens = 0;            // per sequence: seq_len / cp
  std::vector<TokenSpan> spans;  // per piece of the sequence, in the order of the local tokens
  AttentionRunner ring;          // empty with cp = 1
  int32_t eos = -1;              // data.document_mask: the token that ends a document; -1: off
  bool loss_mask = false;        // data.loss_mask: targets carrying kNoLossBit are kIgnoreIndex
  const AttentionRunner* attention() const { return ring.forward ? &ring : nullptr; }
  // What a rank reads of a sample: its spans, or with documents all of it (a position in a document
  // depends on the tokens before it).
  std::vector<TokenSpan> reads() const { return eos >= 0 ? std::vector<TokenSpan>{} : spans; }
};

// cp must outlive the share (its ring refers to it).
inline SequenceShare sequence_share(int64_t seq_len, const Comm& cp) {
  if (cp.size() == 1) return {seq_len, {{0, seq_len + 1}}, {}};
  const ZigzagSplit z = zigzag_split(seq_len, cp.rank(), cp.size());
  return {2 * z.chunk, {{z.first, z.chunk + 1}, {z.second, z.chunk + 1}}, ring_attention_runner(cp)};
}

// A micro-batch of B samples read through share's reads(): each span's tokens [0, n - 1) are
// inputs, [1, n) their targets, at the span's positions in the sequence (with documents, in their
// documents); `rows` goes to a family's per-sequence statistics (engine/model.h). Ids lose a loss
// mask's bit; with share.loss_mask the targets that carry it are ignored.
template <MoeModel M>
typename M::Batch make_batch(const std::vector<int32_t>& tokens, int64_t B, const SequenceShare& share, Device device,
                             StatisticsRows rows = {}) {
  const int64_t T = B * share.tokens, whole = share.eos >= 0 ? int64_t(tokens.size()) / B : 0;
  std::vector<int32_t> in_document(size_t(B * whole));
  for (int64_t b = 0; b < B && whole > 0; ++b)
    document_positions(in_document.data() + b * whole, tokens.data() + b * whole, whole, share.eos);
  Buffer ids(DType::i32, Device::cpu, {T}), targets(DType::i32, Device::cpu, {T}), positions(DType::i32, Device::cpu, {T});
  int64_t at = 0, t = 0;
  for (int64_t b = 0; b < B; ++b)
    for (const TokenSpan& span : share.spans) {
      const int64_t from = whole > 0 ? b * whole + span.first : at;
      for (int64_t i = 0; i + 1 < span.count; ++i, ++t) {
        const auto next = uint32_t(tokens[size_t(from + i + 1)]);
        ids.ptr<int32_t>()[t] = int32_t(uint32_t(tokens[size_t(from + i)]) & ~kNoLossBit);
        targets.ptr<int32_t>()[t] = share.loss_mask && (next & kNoLossBit) ? kIgnoreIndex : int32_t(next & ~kNoLossBit);
        positions.ptr<int32_t>()[t] = whole > 0 ? in_document[size_t(from + i)] : int32_t(span.first + i);
      }
      at += span.count;
    }
  auto on_device = [&](Buffer& host) {
    if (device == Device::cpu) return std::move(host);
    Buffer b(DType::i32, device, {T});
    copy(b, host);
    return b;
  };
  typename M::Batch batch{B, share.tokens, on_device(ids), on_device(targets), on_device(positions), share.attention()};
  batch.documents = whole > 0;
  batch.sequences = rows;
  return batch;
}

// The tokens of B samples read through share's spans.
inline std::vector<int32_t> share_tokens(int64_t B, const SequenceShare& share, int64_t seq_len) {
  return std::vector<int32_t>(size_t(B * sample_tokens(share.reads(), seq_len)));
}

inline Device choose_device(const std::string& requested) {
  if (requested == "cpu") return Device::cpu;
  if (requested == "cuda") {
    MARROW_CHECK(cuda_available(), "train.device = cuda but {}", MARROW_CUDA ? "no GPU is visible" : "this build has no CUDA support");
    return Device::cuda;
  }
  return cuda_available() ? Device::cuda : Device::cpu;
}

// Test hook: MARROW_TEST_FAULT=<rank>:<step>:<raise|exit|hang|nan> makes that world rank raise, exit
// with code 3 or hang at the start of that step; nan returns true (the step's loss is non-finite).
inline bool inject_test_fault(int64_t step, int rank) {
  const char* fault = std::getenv("MARROW_TEST_FAULT");
  if (!fault) return false;
  int fault_rank = -1;
  long long fault_step = -1;
  char kind[16] = {};
  if (std::sscanf(fault, "%d:%lld:%15s", &fault_rank, &fault_step, kind) != 3 || fault_rank != rank || fault_step != step) return false;
  if (std::string(kind) == "nan") return true;
  if (std::string(kind) == "raise") fail("MARROW_TEST_FAULT: rank {} raises at step {}", rank, step);
  if (std::string(kind) == "exit") std::exit(3);
  if (std::string(kind) == "hang")
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  return false;
}

// The mesh for the job's processes, with one sentence for every layout the run cannot use.
inline Mesh make_mesh(const RunConfig& rc, int64_t num_experts, Device device) {
  const MeshShape shape = estimate_mesh(rc, num_experts, process::size());
  check_global_batch(rc, shape);
  if (device == Device::cuda) {
    use_gpu(process::local_rank());
    keep_pool_memory();
  }
  return Mesh::create(shape, device);
}

// This process's GPU memory in bytes; 0 on the CPU (no limit the estimate decides against).
inline double device_memory(Device device) {
  return device == Device::cuda ? double(device_memory_bytes(Device::cuda, process::local_rank())) : 0;
}

// train.load_balance resolved: unset takes the model's form (DeepSeek-V2's seq_aux: "sequence").
template <class C> std::string load_balance_form(const RunConfig& rc, const C& config) {
  return !rc.load_balance.empty() ? rc.load_balance : config.sequence_aux ? "sequence" : "micro_batch";
}
template <class C> C with_load_balance(const RunConfig& rc, C config) {
  config.sequence_aux = load_balance_form(rc, config) == "sequence";
  return config;
}

// Everything a run holds: the mesh, the model's share on this process, its sharded state
// (initialised) and the model's views of it.
template <MoeModel M> struct TrainSetup {
  Device device;
  DType dtype;  // GPU: bf16 from a working copy of the fp32 master weights; CPU: fp32
  Mesh mesh;
  std::optional<ExpertParallel> experts;  // with parallel.ep > 1
  SequenceShare share;
  M model;
  size_t model_tensors;               // canonical tensors of the whole model (every rank's together)
  std::vector<PipelineChunk> chunks;  // with DualPipeV: the 2 x pp chunks
  std::vector<int64_t> held;          // the chunk of each stage (index stage + 1) this rank holds, else -1
  bool gathers_expert_inputs;         // train.expert_inputs resolved (MicroBatch::gathers_expert_inputs)
  std::optional<PipelineLinks> links; // with parallel.pp > 1
  ShardedParameters state;
  typename M::Weights w, g;
  // Per decoder layer, the sums of squares of its expert gradients that every backward of a step
  // updates, so the gradient norm need not read them (empty where they are reduced after the
  // backward, an empty tensor for another pipeline rank's layer); where the squares are, its experts'
  // known-zero flags, kept with the gradients (zero at the start: nothing known).
  std::vector<Buffer> expert_squares, expert_known_zero;
  std::vector<Tensor> expert_squares_views, expert_known_zero_views;
  // The prolog gradients' row flags (prolog_known_zero_parts), where those are final after the backward.
  Buffer prolog_known_zero;
  Tensor prolog_known_zero_view;
  // The gradients the flags describe, for the step's start, the gradient norm and AdamW.
  std::vector<ShardedParameters::KnownZeroGrads> known_zero_grads;
  // The step's routing totals (StepGroups::step_totals) for the global-batch form and the expert bias
  // (train.expert_bias_update: f32 [layers, E], the same on every rank); empty when unused.
  bool global_balance = false;
  Buffer step_totals, expert_bias;

  TrainSetup(const RunConfig& rc, const typename M::Config& config, Device device_)
      : device(device_),
        dtype(device == Device::cuda ? DType::bf16 : DType::f32),
        mesh(make_mesh(rc, config.num_experts, device)),
        share(sequence_share(rc.seq_len, mesh.cp)),
        model(with_load_balance(rc, config), dtype, device,
              {mesh.ep_rank * (config.num_experts / mesh.shape.ep), config.num_experts / mesh.shape.ep}),
        model_tensors(M(config, dtype, device).specs().size()),
        chunks(rc.uses_dualpipev() ? pipeline_layout<M>(rc, config, mesh.world.size(), device) : std::vector<PipelineChunk>{}),
        held(chunks.empty() ? std::vector<int64_t>(size_t(config.num_layers + 2), 0) : held_stage_chunks(chunks, config.num_layers, mesh.pp_rank)),
        gathers_expert_inputs(gathers_expert_inputs_again<M>(rc, config, mesh.world.size(), device, device_memory(device))),
        state(model.specs(), model.num_layers(), held, mesh, rc.keep_gathered || rc.uses_dualpipev(),
              rc.keep_whole_grads || rc.uses_dualpipev(), !rc.bf16_weight_copy, device, dtype, moments_dtype(rc),
              rc.master_weights == "split") {
    if (mesh.shape.ep > 1) experts.emplace(mesh.ep, config.num_experts);
    if (mesh.shape.pp > 1) links = PipelineLinks::create(mesh.pipeline);
    state.initialize([&](Tensor out, const TensorSpec& spec, int64_t first) { model.initialize(out, spec, first, rc.seed); });
    w = model.bind(state.weights());
    g = model.bind(state.gradients());
    if (state.expert_grads_final()) {
      for (size_t l = 0; l < g.layers.size(); ++l) {
        const int64_t count = held[l + 1] >= 0 ? model.expert_squares_count(g.layers[l]) : 0;
        expert_squares.emplace_back(DType::f64, device, std::initializer_list<int64_t>{count});
        expert_squares_views.push_back(count > 0 ? expert_squares.back().view() : Tensor{});
        const int64_t flags = count > 0 ? model.expert_known_zero_count(g.layers[l]) : 0;
        expert_known_zero.push_back(Buffer::zeros(DType::i32, device, {flags}));
        expert_known_zero_views.push_back(flags > 0 ? expert_known_zero.back().view() : Tensor{});
        if (flags > 0)
          for (const auto& [grad, part] : model.expert_known_zero_parts(g.layers[l], expert_known_zero.back()))
            known_zero_grads.push_back({grad, part});
      }
    }
    if (state.grads_final(-1)) {
      prolog_known_zero = Buffer::zeros(DType::i32, device, {model.prolog_known_zero_count()});
      prolog_known_zero_view = prolog_known_zero.view();
      for (const auto& [grad, part] : model.prolog_known_zero_parts(g, prolog_known_zero_view)) known_zero_grads.push_back({grad, part});
    }
    global_balance = load_balance_form(rc, config) == "global_batch";
    if (global_balance || rc.expert_bias_update > 0)
      step_totals = Buffer::zeros(DType::f64, device, {config.num_layers, config.num_experts + 1});
    if (rc.expert_bias_update > 0) {
      expert_bias = Buffer::zeros(DType::f32, device, {config.num_layers, config.num_experts});
      model.set_expert_bias(expert_bias);
    }
  }
  // After an applied update: the step's loads (the pipeline's ranks hold other layers' as zeros)
  // move the expert bias (ops/router.h); returns them by layer for the record.
  std::vector<std::vector<double>> move_expert_bias(double rate) {
    if (mesh.shape.pp > 1) mesh.pipeline.all_reduce_sum(step_totals, "routing totals over the pipeline (all_reduce)");
    expert_bias_update(expert_bias, step_totals, rate);
    const Buffer totals = to_host(step_totals);
    const int64_t E = model.num_experts();
    std::vector<std::vector<double>> loads;
    for (int64_t l = 0; l < model.num_layers(); ++l) loads.emplace_back(totals.ptr<double>() + l * (E + 1), totals.ptr<double>() + l * (E + 1) + E);
    return loads;
  }
  // The groups and hooks of micro-batch `micro` of `count` in a step (evaluation: -1).
  StepGroups groups(int64_t micro = -1, int64_t count = 0, bool overlap = true) {
    StepGroups gr;
    gr.experts = experts ? &*experts : nullptr;
    gr.routing = mesh.data.size() > 1 ? &mesh.data : nullptr;
    ShardedParameters& st = state;
    gr.before_stage = [&st](int64_t stage, bool forward) { forward ? st.before_forward(stage) : st.before_backward(stage); };
    if (micro < 0) return gr;
    gr.layer_done = [&st, micro, count, overlap](int64_t stage) { st.after_backward(stage, micro, micro + 1 == count, overlap); };
    gr.step_totals = step_totals.view();
    gr.global_balance = global_balance;
    return gr;
  }
  std::vector<const Arena*> arenas() const { return state.arenas(); }
  typename PipelineStep<M>::Setup pipeline_setup(StageTimer* timer) const {
    return {model, w, g, mesh.shape.pp, mesh.pp_rank, chunks, links ? &*links : nullptr, timer, gathers_expert_inputs};
  }
  // Micro-batch `micro` of training step `step` (1-based).
  typename M::Batch train_batch(const RunConfig& rc, const TokenDataset& data, int64_t step, int64_t micro) const {
    std::vector<int32_t> tokens = share_tokens(rc.micro_batch, share, rc.seq_len);
    data.train_batch(step - 1, micro, rc.micro_batch, tokens.data(), int(mesh.data_rank()), int(mesh.shape.data_parallel()), share.reads());
    // The statistics are summed over the data group: a row for each sequence of its data-parallel ranks.
    return make_batch<M>(tokens, rc.micro_batch, share, device,
                         {mesh.data_rank() * rc.micro_batch, mesh.shape.data_parallel() * rc.micro_batch});
  }
};

// Whether run_micro_batches pairs micro-batches 2i and 2i + 1 for their expert weight gradients.
template <MoeModel M> bool pairs_micro_batches(const TrainSetup<M>& s, const RunConfig& rc) {
  const int64_t micro_batches = rc.global_batch / (rc.micro_batch * s.mesh.shape.data_parallel());
  return !rc.uses_dualpipev() && micro_batches >= 2 && s.state.expert_grads_accumulate() &&
         pairs_expert_weight_gradients(rc.pair_expert_grads, rc.micro_batch * rc.seq_len / s.mesh.shape.cp, s.model.top_k(), s.mesh.shape.ep,
                                       s.model.num_experts());
}

// A GPU run whose estimated bill exceeds the GPU's memory would end in an allocation failure partway
// into its first step: say so at the start, with the settings that would fit.
template <MoeModel M> void warn_if_over_memory(const TrainSetup<M>& s, const RunConfig& rc, const MemoryBill& bill) {
  const double gpu_bytes = device_memory(s.device);
  if (gpu_bytes == 0 || double(bill.total()) <= gpu_bytes) return;
  std::printf("warning: the estimated total %.2f GiB is more than this GPU's %.2f GiB, so the run will likely run out of memory\n%s",
              bill.total() / 1073741824.0, gpu_bytes / 1073741824.0,
              format_memory_options(memory_options<M>(rc, s.model.config(), s.mesh.world.size(), s.device, gpu_bytes), gpu_bytes).c_str());
}

template <MoeModel M> void print_setup(const TrainSetup<M>& s, const RunConfig& rc, const TokenDataset& data) {
  const M& m = s.model;
  std::printf("model %s on %s: %.2fM parameters (%.2fM active per token), %lld layers, %lld experts top-%lld\n", M::model_type,
              device_name(s.device), M(m.config(), m.dtype(), m.device()).num_parameters() / 1e6, m.num_active_parameters() / 1e6,
              (long long)m.num_layers(), (long long)m.num_experts(), (long long)m.top_k());
  if (s.mesh.world.size() > 1)
    std::printf("mesh: %lld processes, %s; each computes with %lld of %lld experts per layer%s and owns a shard of %.2fM parameters\n",
                (long long)s.mesh.world.size(), s.mesh.shape.describe().c_str(), (long long)(m.num_experts() / s.mesh.shape.ep),
                (long long)m.num_experts(),
                s.mesh.shape.cp > 1 ? fmt::format(" on {} of each sequence's {} tokens", s.share.tokens, rc.seq_len).c_str() : "",
                s.state.params().all().numel() / 1e6);
  std::printf("memory%s: %s\n", s.mesh.world.size() > 1 ? " per process" : "", memory_bill(s.arenas()).c_str());
  // The estimate (marrow estimate) next to what the run measures, so the two can be compared.
  const MemoryBill bill = estimate_memory<M>(rc, m.config(), s.mesh.world.size(), s.device, device_memory(s.device));
  std::printf("estimated peak%s: %.2f GiB (arenas %.2f GiB + activations at %s %.2f GiB)\n", s.mesh.world.size() > 1 ? " per process" : "",
              bill.trainer_peak() / 1073741824.0, (bill.bytes(BillGroup::state) + bill.bytes(BillGroup::weights)) / 1073741824.0,
              bill.activation_peak_at.c_str(), bill.bytes(BillGroup::activations) / 1073741824.0);
  warn_if_over_memory<M>(s, rc, bill);
  if (s.gathers_expert_inputs)
    std::printf("experts' inputs (x_perm): gathered again for each layer's backward (%s)\n",
                rc.expert_inputs == "auto" ? fmt::format("train.expert_inputs = auto: keeping them would pass {:.0f}% of this GPU's memory",
                                                         100 * kKeptExpertInputsShare).c_str()
                                           : "train.expert_inputs = gather");
  if (!s.chunks.empty())
    std::printf("DualPipeV: %lld pipeline ranks, decoder layers per chunk %s (parallel.pp_layers = %s)\n", (long long)s.mesh.shape.pp,
                fmt::format("{}", fmt::join(chunk_layer_counts(s.chunks, m.num_layers()), " ")).c_str(), rc.pp_layers.c_str());
  std::printf("data: %s, %lld training samples of %lld tokens; %lld steps x %lld sequences (micro-batch %lld%s%s%s)\n", rc.data_path.c_str(),
              (long long)data.train_samples(), (long long)rc.seq_len + 1, (long long)rc.steps, (long long)rc.global_batch,
              (long long)rc.micro_batch, s.mesh.shape.data_parallel() > 1 ? " per process" : "",
              pairs_micro_batches(s, rc) ? "; expert weight gradients of micro-batches in pairs" : "",
              rc.fp8 ? "; expert forward and backward-input GEMMs in FP8 (train.fp8)" : "");
  std::fflush(stdout);
}

// Each process saves the shards it holds (one replica of each); any mesh reads them back.
inline CheckpointSharing checkpoint_sharing(const Mesh& mesh, const ShardedParameters& state, size_t model_tensors) {
  return {mesh.world, state.pieces(), state.saves_checkpoint(), model_tensors,
          {{"pp", mesh.shape.pp}, {"dp", mesh.shape.dp}, {"cp", mesh.shape.cp}, {"ep", mesh.shape.ep}, {"dp_shard", mesh.shape.dp_shard}}};
}

// One optimizer step over the shards, the update-th applied (AdamW's bias correction counts applied
// updates, not steps); clipping scales the gradient inside the step, which also writes the bf16
// working weights. optimizer.kind = "muon": Muon on the orthogonalized matrices, AdamW on the rest.
template <MoeModel M> void optimizer_step(TrainSetup<M>& s, const RunConfig& rc, const StepMetrics& m, int64_t update) {
  AdamWHyper hyper{m.lr, rc.beta1, rc.beta2, rc.eps, rc.weight_decay, update};
  if (rc.grad_clip > 0 && m.grad_norm > rc.grad_clip) hyper.grad_scale = rc.grad_clip / m.grad_norm;
  const MuonHyper muon{rc.muon_momentum, rc.muon_scale, int(rc.muon_steps)};
  s.state.optimizer_step(hyper, s.known_zero_grads, rc.optimizer_kind == "muon" ? &muon : nullptr);
}

// Forward and backward of this process's micro-batches of one step; returns its summed token
// losses and the (already global) load-balance losses. Micro-batches 2i and 2i + 1 may pair their
// expert weight gradients (pairs_micro_batches).
template <MoeModel M>
std::pair<double, double> run_micro_batches(TrainSetup<M>& s, const RunConfig& rc, const TokenDataset& data, int64_t step,
                                            double loss_scale, double aux_grad, StageTimer* timer) {
  HostSum token_loss, aux_loss;  // read after the last micro-batch is queued: no wait for the GPU between them
  const int64_t micro_batches = rc.global_batch / (rc.micro_batch * s.mesh.shape.data_parallel());
  const bool pairs = pairs_micro_batches(s, rc);
  std::vector<typename MicroBatch<M>::DeferredExperts> earlier;  // an even micro-batch's expert inputs, held for the next
  for (int64_t micro = 0; micro < micro_batches; ++micro) {
    watchdog::progress("a micro-batch");
    const typename M::Batch batch = s.train_batch(rc, data, step, micro);
    MicroBatch<M> mb;
    mb.epilog_gradients = {&s.g, loss_scale, micro == 0};
    mb.gathers_expert_inputs = s.gathers_expert_inputs;
    const StepGroups groups = s.groups(micro, micro_batches, rc.overlap_grad_reduce);
    forward(mb, s.model, s.w, batch, groups, timer);
    token_loss.add(std::move(mb.token_loss));
    aux_loss.add(std::move(mb.aux_loss));
    const bool holds = pairs && micro % 2 == 0 && micro + 1 < micro_batches;
    typename BackwardPass<M>::Options options{loss_scale, aux_grad, s.state.first_writes_fresh(micro), holds, s.expert_squares_views,
                                              s.expert_known_zero_views, s.prolog_known_zero_view};
    options.first_of_step = micro == 0;
    if (pairs && micro % 2 == 1) {
      options.earlier = &earlier;
      options.earlier_overwrites = s.state.first_writes_fresh(micro - 1);
    }
    backward(mb, s.model, s.w, s.g, batch, options, groups, timer);
    if (holds) earlier = std::move(mb.deferred);
    MARROW_CHECK(holds || earlier.empty(), "internal: {} layers' held expert inputs were not consumed by micro-batch {}", earlier.size(), micro);
  }
  return {token_loss.value(), aux_loss.value()};
}

// The same with DualPipeV: this pipeline rank's order of work; `executed` receives the order as run.
template <MoeModel M>
std::pair<double, double> run_pipeline(TrainSetup<M>& s, const RunConfig& rc, const TokenDataset& data, int64_t step, double loss_scale,
                                       double aux_grad, StageTimer* timer, std::string* executed = nullptr) {
  const int64_t n = rc.global_batch / (rc.micro_batch * s.mesh.shape.data_parallel());
  PipelineStep<M> pipeline(s.pipeline_setup(timer), n, [&](int64_t micro) { return s.train_batch(rc, data, step, micro); },
                           [&](int64_t micro) { return s.groups(micro, n, false); },
                           {loss_scale, aux_grad, false, false, s.expert_squares_views, s.expert_known_zero_views, s.prolog_known_zero_view},
                           [&](int64_t micro) { return s.state.first_writes_fresh(micro); });
  watchdog::progress("a pipeline step");
  const auto losses = pipeline.run(dualpipev_order(s.mesh.shape.pp, s.mesh.pp_rank, n));
  if (executed) *executed = describe_order(pipeline.executed());
  return losses;
}

// The micro-batches of a step, sequentially or through DualPipeV; the whole pipeline's loss sums.
template <MoeModel M>
std::pair<double, double> run_step(TrainSetup<M>& s, const RunConfig& rc, const TokenDataset& data, int64_t step, double loss_scale,
                                   double aux_grad, StageTimer* timer) {
  if (!rc.uses_dualpipev()) return run_micro_batches(s, rc, data, step, loss_scale, aux_grad, timer);
  std::string order;
  const bool print = rc.print_schedule && step == 1;
  const auto [token_loss, aux_loss] = run_pipeline(s, rc, data, step, loss_scale, aux_grad, timer, print ? &order : nullptr);
  if (print) {
    const std::vector<std::string> orders = s.mesh.pipeline.all_gather_text(order, "pipeline orders (all_gather)");
    for (size_t r = 0; r < orders.size(); ++r) std::printf("schedule: pipeline rank %zu: %s\n", r, orders[r].c_str());
  }
  return {token_loss, s.mesh.pipeline.sum(aux_loss, "load-balance loss over the pipeline (sum)")};
}

// The mean validation loss per target over the first eval.samples held-out sequences (the same at
// every evaluation, so the numbers compare), forward only, through the pipeline with DualPipeV.
// Every process evaluates all of them (the experts' all-to-alls need the whole group).
template <MoeModel M> double evaluation_loss(TrainSetup<M>& s, const RunConfig& rc, const TokenDataset& data) {
  const int64_t samples = rc.eval_samples, micro = rc.micro_batch, n = (samples + micro - 1) / micro;
  StepGroups groups = s.groups();
  groups.routing = nullptr;  // every process evaluates the same sequences
  auto batches = [&](int64_t i) {
    const int64_t first = i * micro, B = std::min(micro, samples - first);
    std::vector<int32_t> tokens = share_tokens(B, s.share, rc.seq_len);
    data.validation_batch(first, B, tokens.data(), s.share.reads());
    return make_batch<M>(tokens, B, s.share, s.device);
  };
  double loss_sum = 0;
  if (rc.uses_dualpipev()) {
    PipelineStep<M> pipeline(s.pipeline_setup(nullptr), n, batches, [&](int64_t) { return groups; }, {}, [](int64_t) { return false; });
    loss_sum = s.mesh.pipeline.sum(pipeline.run(forward_only_order(n), true).first, "validation loss over the pipeline (sum)");
  } else {
    HostSum sum;
    for (int64_t i = 0; i < n; ++i) {
      MicroBatch<M> mb;
      forward(mb, s.model, s.w, batches(i), groups);
      sum.add(std::move(mb.token_loss));
    }
    loss_sum = sum.value();
  }
  const int64_t targets = rc.loss_mask ? std::max<int64_t>(1, data.validation_loss_targets(samples)) : samples * rc.seq_len;
  return s.mesh.cp.sum(loss_sum, "validation loss over the sequence's shares (sum)") / double(targets);
}

// A stop signal seen by any process stops all of them after the same step.
inline int agreed_stop_signal(const Comm& world) {
  const int local = StopSignals::received();
  const double anyone = world.sum(local != 0 ? 1.0 : 0.0, "stop signal agreement (sum)");
  return anyone > 0 ? (local != 0 ? local : SIGTERM) : 0;
}

// The corpus checked against the run: the vocabulary, enough samples for train.steps (a note when
// the run makes more than one pass) and for eval.samples.
inline void check_training_data(TokenDataset& data, const RunConfig& rc, int64_t vocab_size) {
  data.require_vocab_fits(vocab_size);
  data.require_train_samples(rc.steps * rc.global_batch, rc.max_epochs);
  if (rc.steps * rc.global_batch > data.train_samples() && process::rank() == 0)
    std::printf("note: the run reads %lld training samples of a corpus of %lld: %.2f passes over it (data.max_epochs = %lld)\n",
                (long long)(rc.steps * rc.global_batch), (long long)data.train_samples(),
                double(rc.steps * rc.global_batch) / double(data.train_samples()), (long long)rc.max_epochs);
  data.set_samples_per_step(rc.global_batch);
  MARROW_CHECK(!rc.loss_mask || !data.manifest().loss_mask.empty(),
               "data.loss_mask needs a corpus tokenized with a loss mask (marrow tokenize --loss-mask FIELD); {} has none", rc.data_path);
  MARROW_CHECK(rc.eval_every == 0 || rc.eval_samples <= data.validation_samples(),
               "corpus {} holds {} validation samples of {} tokens but eval.samples is {} (lower it or raise data.validation_fraction)",
               rc.data_path, data.validation_samples(), rc.seq_len + 1, rc.eval_samples);
}

// --profile-steps: a kernel trace of steps [profile_first, profile_last] by world rank 0, made
// before any NVTX range (KernelTrace). The stages' ranges come from a StageTimer: a traced run
// without one gets one that times no step (timing would slow the traced steps).
class StepTrace {
 public:
  // Returns the stage timer the steps use: `timer`, or that NVTX-only one.
  StageTimer* prepare(const RunConfig& rc, Device device, StageTimer* timer) {
    if (rc.profile_first <= 0 || process::rank() != 0) return timer;
    check_profile_steps(rc);
    trace_.emplace(device);
    if (timer) return timer;
    stages_.emplace(device);
    stages_->time_from_step(std::numeric_limits<int64_t>::max());
    return &*stages_;
  }
  void before_step(const RunConfig& rc, int64_t step) {
    if (trace_ && !trace_->running() && step >= rc.profile_first && step <= rc.profile_last) trace_->start();
  }
  // Writes the trace at its last step, or at the step a stop signal ends the run.
  void after_step(const RunConfig& rc, int64_t first_step, int64_t step, bool stopping) {
    if (trace_ && trace_->running() && (step == rc.profile_last || stopping))
      report_trace(trace_->stop(), fmt::format("{}/trace-steps-{}-{}.json", rc.out_dir, std::max(rc.profile_first, first_step), step));
  }

 private:
  std::optional<KernelTrace> trace_;
  std::optional<StageTimer> stages_;
};

// World rank 0's record of the steps: metrics.jsonl and tb/ (engine/tensorboard.h), cut back to
// the checkpoint's step when the run continues output.dir's own run, else started anew after an
// earlier run's records were moved aside (keep_earlier_records).
class RunRecord {
 public:
  RunRecord(const RunConfig& rc, int64_t first_step, bool continues, bool leader) {
    if (!leader) return;
    const std::string path = rc.out_dir + "/metrics.jsonl";
    if (continues) keep_metrics_through(path, first_step - 1);
    const std::string kept = continues ? "" : keep_earlier_records(rc.out_dir);
    if (!kept.empty()) std::printf("%s\n", kept.c_str());
    metrics_ = MetricsLog(path, !continues);
    tensorboard_.emplace(rc, first_step, continues);
  }
  void append(const StepMetrics& m) {
    if (!tensorboard_) return;
    metrics_.append(step_json(m));
    tensorboard_->add_step(Json::parse(step_json(m)));
  }

 private:
  MetricsLog metrics_;
  std::optional<TensorBoardLog> tensorboard_;
};

// The steps of a run, each in named parts: forward and backward, the update (gradients reduced,
// their norm, AdamW or a skipped step), timing, the report (evaluation, the line and record) and
// the end (trace, checkpoint, stop signals).
template <MoeModel M> class TrainLoop {
 public:
  TrainLoop(const RunConfig& rc, TrainSetup<M>& s, const TokenDataset& data, TrainCheckpoints& checkpoints, StepTrace& trace,
            StageTimer* timer, double aux_coef)
      : rc_(rc), s_(s), data_(data), checkpoints_(checkpoints), trace_(trace), timer_(timer),
        schedule_{rc.schedule, rc.lr, rc.min_lr, rc.warmup_steps, rc.steps, rc.decay_fraction},
        aux_coef_(aux_coef),
        micro_batches_(rc.global_batch / (rc.micro_batch * s.mesh.shape.data_parallel())), updates_(checkpoints.resumed_updates()) {
    for (const Arena* a : s.arenas()) arena_bytes_ += a->bytes();
  }

  // Steps first_step..train.steps, or to the end of the step a stop signal reached any process in.
  std::vector<StepMetrics> run(int64_t first_step, RunRecord& record) {
    std::vector<StepMetrics> history;
    StopSignals stop;
    for (int64_t step = first_step; step <= rc_.steps; ++step) {
      trace_.before_step(rc_, step);
      StepMetrics m = train_step(step);
      report(m, record);
      history.push_back(m);
      if (end_step(step, first_step)) break;
    }
    return history;
  }

 private:
  StepMetrics train_step(int64_t step) {
    const bool poisoned = inject_test_fault(step, s_.mesh.world.rank());
    watchdog::arm(true);
    std::optional<NvtxRange> step_range(std::in_place, fmt::format("step {}", step));
    const auto start = std::chrono::steady_clock::now();
    StepMetrics m = forward_backward(step);
    {
      StageScope optimizer_scope(timer_, Stage::optimizer);
      update(m, poisoned);
    }
    if (s_.device == Device::cuda) synchronize();
    watchdog::arm(false);
    step_range.reset();
    time_step(m, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    return m;
  }

  // The step's gradients, loss (the mean over the step's targets; with data.loss_mask those without the
  // bit, which every rank counts from the corpus: the count is known upfront) and load balance.
  StepMetrics forward_backward(int64_t step) {
    s_.state.start_step(s_.known_zero_grads);
    if (s_.step_totals.view().data) fill_zero(s_.step_totals);
    const int64_t targets = rc_.loss_mask ? std::max<int64_t>(1, data_.loss_targets(step - 1)) : rc_.global_batch * rc_.seq_len;
    const double loss_scale = 1.0 / double(targets);
    const double aux_grad = aux_coef_ / double(moe_layer_count(s_.model) * micro_batches_);
    if (timer_) timer_->start_step(step);
    const auto [token_loss_sum, aux_loss_sum] = run_step(s_, rc_, data_, step, loss_scale, aux_grad, timer_);
    StepMetrics m;
    m.step = step;
    m.tokens_seen = checkpoints_.tokens_seen(step);
    if (s_.experts) m.expert_traffic = s_.experts->take_traffic();
    m.loss = s_.mesh.world.sum(token_loss_sum, "loss (sum)") * loss_scale;  // pipeline: only the LM head's rank has it
    // Reported normalised so that perfectly balanced routing reads 1.0.
    m.load_balance = aux_loss_sum / double(moe_layer_count(s_.model) * micro_batches_ * s_.model.top_k());
    m.lr = schedule_.at(step);
    return m;
  }

  // Gradients reduced, their norm; AdamW, or the update skipped for a non-finite loss or norm (up to
  // train.max_bad_steps in a row).
  void update(StepMetrics& m, bool poisoned) {
    s_.state.finish_gradients(rc_.overlap_grad_reduce && !rc_.uses_dualpipev());
    m.grad_norm = s_.state.gradient_norm(s_.expert_squares_views, s_.known_zero_grads);
    if (poisoned) m.loss = std::numeric_limits<double>::quiet_NaN();
    if (std::isfinite(m.loss) && std::isfinite(m.grad_norm)) {
      bad_in_a_row_ = 0;
      optimizer_step(s_, rc_, m, ++updates_);
      if (rc_.expert_bias_update > 0) m.expert_load = s_.move_expert_bias(rc_.expert_bias_update);
      return;
    }
    m.skipped = true;
    ++bad_in_a_row_;
    std::fprintf(stderr, "warning: step %lld has a non-finite loss (%g) or gradient norm (%g); the update is skipped\n",
                 (long long)m.step, m.loss, m.grad_norm);
    MARROW_CHECK(bad_in_a_row_ < rc_.max_bad_steps, "stopping at step {}: {} steps in a row had a non-finite loss or gradient norm",
                 m.step, bad_in_a_row_);
  }

  void time_step(StepMetrics& m, double seconds) {
    if (timer_ && timer_->times(m.step)) {
      const std::array<double, kStageCount> before = timer_->total_ms();
      timer_->collect();
      for (int i = 0; i < kStageCount; ++i) m.stage_ms[size_t(i)] = timer_->total_ms()[size_t(i)] - before[size_t(i)];
    }
    m.step_ms = seconds * 1e3;
    m.tokens_per_s = double(rc_.global_batch * rc_.seq_len) / seconds;
    m.peak_bytes = s_.device == Device::cuda ? arena_bytes_ + peak_memory_bytes(s_.device) : peak_memory_bytes(s_.device);
  }

  // After the step's timing: evaluation is not training speed, nor its exchanges training traffic.
  void report(StepMetrics& m, RunRecord& record) {
    const bool evaluate = rc_.eval_every > 0 && (m.step % rc_.eval_every == 0 || m.step == rc_.steps);
    if (evaluate) m.val_loss = evaluation_loss(s_, rc_, data_);
    if (s_.experts) s_.experts->take_traffic();
    if (m.step % rc_.log_every == 0 || m.step == 1 || m.step == rc_.steps || m.skipped || evaluate) {
      std::printf("%s\n", step_line(m, rc_.steps).c_str());
      std::fflush(stdout);
    }
    record.append(m);
  }

  // The checkpoint of step (split master weights pass through their staging arena: sharded_params.h).
  std::string save_checkpoint(int64_t step) {
    s_.state.unpack_master();
    const std::string dir = checkpoints_.save(step, updates_);
    s_.state.release_master_staging();
    return dir;
  }

  // The trace and a checkpoint where due; returns whether a stop signal ends the run here.
  bool end_step(int64_t step, int64_t first_step) {
    const int stop_signal = agreed_stop_signal(s_.mesh.world);
    trace_.after_step(rc_, first_step, step, stop_signal != 0);
    const std::string saved = checkpoints_.due(step, stop_signal != 0) ? save_checkpoint(step) : "";
    if (stop_signal == 0 || step == rc_.steps) return false;
    std::printf("stopped by %s after step %lld: %s\n", stop_signal == SIGTERM ? "SIGTERM" : "SIGINT", (long long)step,
                saved.empty() ? "no checkpoint (checkpoint.every = 0)"
                              : ("checkpoint in " + saved + "; run the same command again to resume").c_str());
    std::fflush(stdout);
    return true;
  }

  const RunConfig& rc_;
  TrainSetup<M>& s_;
  const TokenDataset& data_;
  TrainCheckpoints& checkpoints_;
  StepTrace& trace_;
  StageTimer* timer_;
  const LrSchedule schedule_;
  const double aux_coef_;
  const int64_t micro_batches_;
  int64_t updates_;  // applied updates (AdamW's bias correction counts them, not steps)
  int64_t bad_in_a_row_ = 0;
  size_t arena_bytes_ = 0;
};

// Sets up a run (the corpus, the sharded state, a checkpoint to resume) and trains it. timer, when
// given, splits each step's time by stage into StepMetrics::stage_ms (marrow bench).
template <MoeModel M>
std::vector<StepMetrics> train(const RunConfig& rc, const typename M::Config& model_config, StageTimer* timer = nullptr) {
  const Device device = choose_device(rc.device);
  const RunLock lock(rc.out_dir, process::rank() == 0);  // one run per output.dir (engine/run_lock.h)
  set_attention_kernels(parse_attention_kernels(rc.attention_kernels));
  set_expert_fp8(rc.fp8);
  set_dependent_launch(rc.dependent_launch);
  StepTrace trace;
  timer = trace.prepare(rc, device, timer);
  TrainSetup<M> s(rc, model_config, device);
  TokenDataset data(rc.data_path, rc.seq_len, rc.seed, rc.validation_fraction, !rc.quiet);
  check_training_data(data, rc, model_config.vocab_size);
  if (rc.document_mask) s.share.eos = data.eos_id();
  s.share.loss_mask = rc.loss_mask;
  print_setup(s, rc, data);

  // Checkpoints (engine/checkpoint.h): resume from the newest in output.dir or checkpoint.resume.
  TrainCheckpoints checkpoints(rc, model_config.json, s.model.specs(), {&s.state.master_staging(), &s.state.exp_avg(), &s.state.exp_avg_sq()},
                               checkpoint_sharing(s.mesh, s.state, s.model_tensors));
  checkpoints.keep_expert_bias(s.expert_bias.view());
  const int64_t first_step = checkpoints.resume() + 1;
  checkpoints.require_disk_space();
  s.state.master_changed();
  if (first_step > rc.steps) {
    std::printf("the run is complete: its checkpoint is at step %lld of train.steps = %lld\n", (long long)first_step - 1,
                (long long)rc.steps);
    return {};
  }
  RunRecord record(rc, first_step, checkpoints.continues_output_dir(), s.mesh.world.rank() == 0);
  if (s.mesh.world.size() > 1) watchdog::start(rc.timeout_s, s.mesh.who(), nccl_async_error);
  const double aux_coef = rc.aux_loss_coef >= 0 ? rc.aux_loss_coef : model_config.router_aux_loss_coef;
  TrainLoop<M> loop(rc, s, data, checkpoints, trace, timer, aux_coef);
  std::vector<StepMetrics> history = loop.run(first_step, record);
  watchdog::stop();
  return history;
}

}  // namespace marrow
