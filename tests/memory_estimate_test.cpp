// The memory estimate's arithmetic (engine/memory_estimate.h): shard chunks and their padding,
// kept-whole units against the layers' slots, expert parallelism, and the bench model's bill
// against the peaks measured on the H200 (docs/performance.md).
#include "engine/memory_estimate.h"

#include <gtest/gtest.h>

#include "models/qwen3_moe.h"
#include "parallel/ring_attention.h"

namespace marrow {
namespace {

constexpr double kGiB = 1073741824.0;

int64_t item(const MemoryBill& bill, const std::string& name) {
  for (const BillItem& i : bill.items)
    if (i.name == name) return i.bytes;
  ADD_FAILURE() << "no bill item named " << name;
  return -1;
}

std::string estimate_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

// A hand-made table of 2 layers: embedding 10, per layer dense 7 and experts 2 x 5, LM head 10,
// norms 3 + 1; activations of zero bytes, so the bill is the layout alone.
struct SmallTable {
  std::vector<TensorSpec> specs;
  SmallTable() {
    add("embed", 10, -1, false, false);
    for (int64_t l = 0; l < 2; ++l) {
      add("dense", 7, l, false, false);
      add("expert 0", 5, l, true, false);
      add("expert 1", 5, l, true, false);
    }
    add("lm_head", 10, 2, false, false);
    add("norm a", 3, 0, false, true);
    add("norm b", 1, 2, false, true);
  }
  void add(const std::string& name, int64_t numel, int64_t layer, bool expert, bool norm) {
    const int64_t offset = specs.empty() ? 0 : specs.back().offset + specs.back().numel;
    specs.push_back({.name = name,
                     .shape = {numel},
                     .offset = offset,
                     .numel = numel,
                     .is_norm = norm,
                     .decayed = !norm,
                     .first_backward_writes = expert,
                     .is_expert = expert,
                     .layer = layer});
  }
  EstimatedModel model() const {
    return {"small", specs, 2, 4, 2, 2, 4, [](int64_t, int64_t, int64_t) { return ModelActivationBytes{}; }};
  }
};

MemoryBill small_bill(const RunConfig& rc, const SmallTable& t, int64_t world, Device device) {
  const MeshShape mesh = mesh_shape(world, 1, 1, rc.ep, rc.dp_shard);
  return estimate_memory(rc, t.model(), mesh, shard_groups(mesh), device);
}

RunConfig small_run(bool keep_gathered = false) {
  RunConfig rc;
  rc.keep_gathered = rc.keep_whole_grads = keep_gathered;
  rc.source = "test.toml";
  return rc;
}

TEST(MemoryEstimate, ChunksArePaddedPerUnit) {
  const SmallTable t;
  // 4 data-parallel processes, all sharding: chunks ceil(10/4) + 2 x (ceil(7/4) + ceil(10/4)) + ceil(10/4) + ceil(4/4) = 17.
  const MemoryBill bill = small_bill(small_run(), t, 4, Device::cpu);
  EXPECT_EQ(item(bill, "fp32 master weights"), 4 * 17);
  EXPECT_EQ(item(bill, "AdamW exp_avg_sq (fp32)"), 4 * 17);
  EXPECT_EQ(bill.bytes(BillGroup::state), 4 * 4 * 17);
  // One process: the whole table, no copies on the CPU (it computes on the master weights).
  const MemoryBill one = small_bill(small_run(), t, 1, Device::cpu);
  EXPECT_EQ(item(one, "fp32 gradients"), 4 * 58);
  EXPECT_EQ(one.bytes(BillGroup::weights), 0);
}

// The split master (the default, GPU) keeps 2 bytes a parameter besides the bf16 weights, which its
// high halves are; "fp32" keeps a 4-byte master beside the same bf16 weights. The CPU has no split.
TEST(MemoryEstimate, SplitMasterWeightsTakeTwoBytesBesideTheBf16Weights) {
  const SmallTable t;
  RunConfig fp32 = small_run();
  fp32.master_weights = "fp32";
  const MemoryBill split = small_bill(small_run(), t, 4, Device::cuda), whole = small_bill(fp32, t, 4, Device::cuda);
  EXPECT_EQ(item(split, "fp32 master weights' low halves"), 2 * 17);
  EXPECT_EQ(item(whole, "fp32 master weights"), 4 * 17);
  EXPECT_EQ(whole.bytes(BillGroup::state) - split.bytes(BillGroup::state), 2 * 17);
  EXPECT_EQ(split.bytes(BillGroup::weights), whole.bytes(BillGroup::weights));
  EXPECT_EQ(item(small_bill(small_run(), t, 4, Device::cpu), "fp32 master weights"), 4 * 17);
}

TEST(MemoryEstimate, Bf16MomentsHalveTheMomentsItems) {
  const SmallTable t;
  RunConfig rc = small_run();
  rc.moments = "bf16";
  const MemoryBill bill = small_bill(rc, t, 4, Device::cpu);
  EXPECT_EQ(item(bill, "AdamW exp_avg (bf16)"), 2 * 17);
  EXPECT_EQ(item(bill, "AdamW exp_avg_sq (bf16)"), 2 * 17);
  EXPECT_EQ(bill.bytes(BillGroup::state), (4 + 4 + 2 + 2) * 17);
}

TEST(MemoryEstimate, KeptUnitsAgainstLayerSlots) {
  const SmallTable t;
  // Slots: embedding, LM head, norms whole (12 + 12 + 4); layers as bf16 shards (2 x (2 + 3)) and
  // two slots of the largest dense (8) and expert (12) unit.
  const MemoryBill slots = small_bill(small_run(), t, 4, Device::cuda);
  EXPECT_EQ(item(slots, "bf16 weights of units kept whole"), 2 * 28);
  EXPECT_EQ(item(slots, "bf16 weight shards of the slotted layers"), 2 * 10);
  EXPECT_EQ(item(slots, "bf16 gathered layer slots"), 2 * 40);
  EXPECT_EQ(item(slots, "fp32 whole gradients of units kept whole"), 4 * 28);
  EXPECT_EQ(item(slots, "fp32 gradient slots of the layers"), 4 * 40);
  // keep_gathered: every unit whole (the working shard is a slice of it), no slots.
  const MemoryBill kept = small_bill(small_run(true), t, 4, Device::cuda);
  EXPECT_EQ(item(kept, "bf16 weights of units kept whole"), 2 * 68);
  EXPECT_EQ(item(kept, "bf16 weight shards of the slotted layers"), 0);
  EXPECT_EQ(item(kept, "bf16 gathered layer slots"), 0);
  EXPECT_EQ(item(kept, "fp32 whole gradients of units kept whole"), 4 * 68);
  EXPECT_EQ(item(kept, "fp32 gradient slots of the layers"), 0);
  // dp_shard = 1 is plain data parallelism: n = 1 everywhere, whatever keep_gathered says.
  RunConfig ddp = small_run(true);
  ddp.dp_shard = 1;
  const MemoryBill replicated = small_bill(ddp, t, 4, Device::cuda);
  EXPECT_EQ(item(replicated, "fp32 master weights' low halves"), 2 * 58);
  EXPECT_EQ(item(replicated, "bf16 weights of units kept whole"), 2 * 58);
  EXPECT_EQ(item(replicated, "fp32 whole gradients of units kept whole"), 0);
}

TEST(MemoryEstimate, ExpertUnitsShardOverFewerProcesses) {
  const SmallTable t;
  RunConfig rc = small_run();
  rc.ep = 2;
  // 4 processes = dp 2 x ep 2: dense units over 4, expert units (this rank's experts) over dp 2.
  // Chunks: 3 + 2 x (2 + 5) + 3 + 1 = 21.
  const MemoryBill bill = small_bill(rc, t, 4, Device::cuda);
  EXPECT_EQ(item(bill, "fp32 master weights' low halves"), 2 * 21);
  EXPECT_EQ(item(bill, "bf16 gathered layer slots"), 2 * 2 * (8 + 10));
}

// DualPipeV's stage costs: work per token over the rates of the H200 (memory_estimate.cpp); the
// small table's numbers by hand. Layer l: dense 7, experts 2 x 5 with top-2 of 2 (all active),
// attention 2 x seq_len x width = 2 x 8 x 4; the head 10 at the head's rate; the prolog free.
TEST(MemoryEstimate, PipelineStageCostsFollowTheMeasuredRates) {
  const SmallTable t;
  RunConfig rc = small_run();
  rc.seq_len = 8;
  const std::vector<ChunkCost> cost = pipeline_stage_costs(rc, t.model(), mesh_shape(1, 1, 1, 1, 0));
  ASSERT_EQ(cost.size(), 4u);
  EXPECT_DOUBLE_EQ(cost[0].forward + cost[0].backward + cost[0].weights, 0.0);
  const double d = 2.0 * 7 / 414, x = 2.0 * 10 / 414, a = 2.0 * 8 * 4 / 420;
  for (size_t l : {1, 2}) {
    EXPECT_DOUBLE_EQ(cost[l].forward, d + x + a);
    EXPECT_DOUBLE_EQ(cost[l].backward, 2 * d + x + 2 * a);
    EXPECT_DOUBLE_EQ(cost[l].weights, x);
  }
  EXPECT_DOUBLE_EQ(cost[3].forward, 2.0 * 10 / 686);
  EXPECT_DOUBLE_EQ(cost[3].backward, 4.0 * 10 / 686);
}

Qwen3MoeConfig bench_config() { return Qwen3MoeConfig::load(MARROW_SOURCE_DIR "/configs/bench-moe.json"); }

RunConfig bench_run(int64_t ep = 1) {
  RunConfig rc;
  rc.global_batch = 4;
  rc.micro_batch = 1;
  rc.seq_len = 4096;
  rc.ep = ep;
  rc.source = "bench.toml";
  rc.master_weights = "fp32";  // the measured figures below are fp32 master weights'
  return rc;
}

TEST(MemoryEstimate, OneProcessIsTodaysArenas) {
  const Qwen3MoeConfig config = bench_config();
  const int64_t n = Qwen3Moe(config, DType::bf16, Device::cuda).num_parameters();
  const MemoryBill bill = estimate_memory<Qwen3Moe>(bench_run(), config, 1, Device::cuda);
  EXPECT_EQ(bill.bytes(BillGroup::state), 16 * n);
  EXPECT_EQ(item(bill, "bf16 weights of units kept whole"), 2 * n);
  EXPECT_EQ(bill.bytes(BillGroup::weights), 2 * n);
  // The trainer's start-up line on the H200: "(total 96255.6 MiB)".
  EXPECT_NEAR((bill.bytes(BillGroup::state) + bill.bytes(BillGroup::weights)) / 1048576.0, 96255.6, 0.1);
}

// train.fp8 adds the FP8 expert weights and their transposes: two bytes an expert parameter and two
// f32 scales a 128 x 128 block.
TEST(MemoryEstimate, Fp8CountsTheExpertWeightsTwiceInOneByte) {
  const Qwen3MoeConfig config = bench_config();
  const Qwen3Moe model(config, DType::bf16, Device::cuda);
  int64_t experts = 0;
  for (const TensorSpec& s : model.specs()) experts += s.is_expert ? s.numel : 0;
  RunConfig rc = bench_run();
  const MemoryBill plain = estimate_memory<Qwen3Moe>(rc, config, 1, Device::cuda);
  rc.fp8 = true;
  const MemoryBill fp8 = estimate_memory<Qwen3Moe>(rc, config, 1, Device::cuda);
  EXPECT_NEAR(double(item(fp8, "fp8 expert weights and their transposes")), 2.0 * double(experts) * (1 + 1 / 4096.0), 2.0 * config.num_layers);
  EXPECT_EQ(fp8.total() - plain.total(), item(fp8, "fp8 expert weights and their transposes"));
}

// The bill of today's trainer (before FSDP: every process holds whole copies of its tensors).
MemoryBill replicated_bill(const RunConfig& rc, int64_t world) {
  return with_estimated_model<Qwen3Moe>(rc, bench_config(), world, Device::cuda, [&](const EstimatedModel& m, const MeshShape& mesh) {
    return estimate_memory(rc, m, mesh, ShardGroups{1, 1}, Device::cuda);
  });
}

TEST(MemoryEstimate, ExpertParallelHoldsItsExperts) {
  const Qwen3MoeConfig config = bench_config();
  const Qwen3Moe local(config, DType::bf16, Device::cuda, ExpertShard{0, 64});
  const int64_t n = local.num_parameters();
  const MemoryBill today = replicated_bill(bench_run(2), 2);
  EXPECT_EQ(today.bytes(BillGroup::state), 16 * n);
  EXPECT_NEAR((today.bytes(BillGroup::state) + today.bytes(BillGroup::weights)) / 1048576.0, 54783.6, 0.1);  // measured line
  // FSDP over the two expert-parallel ranks: the local experts whole, the rest in halves.
  int64_t experts = 0;
  for (const TensorSpec& s : local.specs()) experts += s.is_expert ? s.numel : 0;
  const MemoryBill fsdp = estimate_memory<Qwen3Moe>(bench_run(2), config, 2, Device::cuda);
  const int64_t halves = (n - experts) / 2;
  EXPECT_GE(fsdp.bytes(BillGroup::state), 16 * (experts + halves));
  EXPECT_LE(fsdp.bytes(BillGroup::state), 16 * (experts + halves + 2 * config.num_layers + 3));  // padding: one element per unit
  EXPECT_GE(item(fsdp, "expert all-to-all buffers at the peak"), 0);
}

// docs/performance.md: one H200 peaks at 97.94 GiB (sequence 4096, commit 346c008: h1, q_rope, k_rope
// computed again in the backward), 95.43 GiB (1024, earlier) and 105.75 GiB (16384, 346c008);
// EP = 2 on two H200 at 59.53 GiB per GPU (replicated dense weights, before FSDP). The trainer's
// figure counts arenas and the pool.
// Those were measured before micro-batches paired their expert weight gradients: train.pair_expert_grads off.
TEST(MemoryEstimate, BenchPeaksMatchTheMeasuredOnes) {
  const Qwen3MoeConfig config = bench_config();
  auto peak = [&](RunConfig rc, int64_t world) { return estimate_memory<Qwen3Moe>(rc, config, world, Device::cuda).trainer_peak() / kGiB; };
  auto unpaired = [](RunConfig rc) {
    rc.pair_expert_grads = false;
    return rc;
  };
  EXPECT_NEAR(peak(unpaired(bench_run()), 1), 97.94, 0.03 * 97.94);
  RunConfig short_seq = unpaired(bench_run()), long_seq = unpaired(bench_run());
  short_seq.seq_len = 1024;
  long_seq.seq_len = 16384;
  long_seq.expert_inputs = "gather";  // measured when micro-batches of 8,192 tokens and more dropped x_perm
  EXPECT_NEAR(peak(short_seq, 1), 95.43, 0.03 * 95.43);
  EXPECT_NEAR(peak(long_seq, 1), 105.75, 0.03 * 105.75);
  EXPECT_NEAR(replicated_bill(unpaired(bench_run(2)), 2).trainer_peak() / kGiB, 59.53, 0.03 * 59.53);
}

// Paired micro-batches (engine/model.h): the second of a pair holds the first's expert inputs of
// every layer through its forward (x_perm [R, H]; dout [T, H] and copy_row [T, K] i32 for dy_perm;
// act, dgate_up: [R, 3I]; bf16); not with train.pair_expert_grads = false, one micro-batch a step,
// nor at 512 rows an expert and more (8,192 tokens of the bench model; Qwen3-30B-A3B under EP = 8
// at 4,096), where nothing pairs.
TEST(MemoryEstimate, PairedMicroBatchesHoldTheEarlierOnesExpertInputs) {
  const Qwen3MoeConfig config = bench_config();
  auto bill = [&](RunConfig rc, bool pairs) {
    rc.pair_expert_grads = pairs;
    return estimate_memory<Qwen3Moe>(rc, config, 1, Device::cuda);
  };
  const int64_t R = 4096 * config.top_k, H = config.hidden_size, I = config.expert_intermediate_size;
  const int64_t held = config.num_layers * (R * (H + 3 * I) * 2 + 4096 * H * 2 + R * 4);
  const MemoryBill paired = bill(bench_run(), true), plain = bill(bench_run(), false);
  EXPECT_EQ(item(paired, "previous micro-batch's expert inputs"), held);
  EXPECT_EQ(item(plain, "previous micro-batch's expert inputs"), 0);
  EXPECT_EQ(paired.total() - plain.total(), held);  // the peak stays where it was: the end of the forward
  // docs/performance.md: the bench config paired peaks at 100.20 GiB on the H200 (commit 9b49c87).
  EXPECT_NEAR(paired.trainer_peak() / kGiB, 100.20, 0.03 * 100.20);
  RunConfig one = bench_run(), long_seq = bench_run();
  one.global_batch = 1;
  long_seq.seq_len = 8192;
  EXPECT_EQ(bill(one, true).total(), bill(one, false).total());
  EXPECT_EQ(bill(long_seq, true).total(), bill(long_seq, false).total());
  auto bill_ep8 = [&](bool pairs) {  // every expert takes 8 processes' rows: 2,048 each
    RunConfig rc = bench_run(8);
    rc.pair_expert_grads = pairs;
    return estimate_memory<Qwen3Moe>(rc, config, 8, Device::cuda).total();
  };
  EXPECT_EQ(bill_ep8(true), bill_ep8(false));
}

TEST(MemoryEstimate, LargestFitIsTheEdge) {
  const Qwen3MoeConfig config = bench_config();
  const double gpu = 139.8 * kGiB;
  const LargestFit fit = largest_fit<Qwen3Moe>(bench_run(), config, 1, Device::cuda, gpu);
  ASSERT_GT(fit.micro_batch, 1);
  ASSERT_GT(fit.seq_len, 4096);
  auto total = [&](int64_t micro_batch, int64_t seq_len) {
    RunConfig rc = bench_run();
    rc.micro_batch = micro_batch;
    rc.global_batch = 4 * micro_batch;  // as many micro-batches as largest_fit tries
    rc.seq_len = seq_len;
    return double(estimate_memory<Qwen3Moe>(rc, config, 1, Device::cuda, gpu).total());
  };
  EXPECT_LE(total(fit.micro_batch, 4096), gpu);
  EXPECT_GT(total(fit.micro_batch + 1, 4096), gpu);
  EXPECT_LE(total(1, fit.seq_len), gpu);
  EXPECT_GT(total(1, fit.seq_len + 1), gpu);
  // Weights and optimizer state alone exceed 50 GiB: nothing fits.
  const LargestFit none = largest_fit<Qwen3Moe>(bench_run(), config, 1, Device::cuda, 50 * kGiB);
  EXPECT_EQ(none.micro_batch, 0);
  EXPECT_EQ(none.seq_len, 0);
}

// train.expert_inputs: x_perm ([T x K, H] bf16 a layer) kept to the backward or gathered again;
// "auto" keeps it while the total with it kept stays within 90% of the device's memory, and
// keeps it when that memory is not known; with expert parallelism x_perm is what arrived, kept.
TEST(MemoryEstimate, ExpertInputsKeptWhileTheyFit) {
  const Qwen3MoeConfig config = bench_config();
  RunConfig rc = bench_run();
  rc.global_batch = 1;
  rc.seq_len = 16384;
  auto bill = [&](const std::string& inputs, double device_bytes, const RunConfig& base) {
    RunConfig r = base;
    r.expert_inputs = inputs;
    return estimate_memory<Qwen3Moe>(r, config, 1, Device::cuda, device_bytes);
  };
  const MemoryBill keep = bill("keep", 0, rc), gather = bill("gather", 0, rc);
  // The peak is the epilog's backward, with every layer's activations alive.
  EXPECT_EQ(keep.total() - gather.total(), config.num_layers * 16384 * config.top_k * config.hidden_size * 2);
  const double gpu = 139.8 * kGiB, edge = double(keep.total()) / kKeptExpertInputsShare;
  EXPECT_EQ(bill("auto", gpu, rc).total(), keep.total());
  EXPECT_EQ(bill("auto", 0, rc).total(), keep.total());
  EXPECT_EQ(bill("auto", edge * 1.001, rc).total(), keep.total());
  EXPECT_EQ(bill("auto", edge * 0.999, rc).total(), gather.total());
  EXPECT_NE(format_bill(gather, gpu).find("x_perm gathered again"), std::string::npos);
  EXPECT_EQ(format_bill(keep, gpu).find("x_perm gathered again"), std::string::npos);
  RunConfig gather_rc = rc, ep2 = bench_run(2);
  gather_rc.expert_inputs = "gather";
  EXPECT_TRUE(gathers_expert_inputs_again<Qwen3Moe>(gather_rc, config, 1, Device::cuda, gpu));
  const int64_t ep2_keep = estimate_memory<Qwen3Moe>(ep2, config, 2, Device::cuda).total();
  ep2.expert_inputs = "gather";
  EXPECT_EQ(estimate_memory<Qwen3Moe>(ep2, config, 2, Device::cuda).total(), ep2_keep);
  EXPECT_FALSE(gathers_expert_inputs_again<Qwen3Moe>(ep2, config, 2, Device::cuda, gpu));
}

// The settings that save memory: only those the run has on the side that holds memory and that
// shrink its bill, each alone, then all of them together; each total is the bill of the run config
// it names (bf16 moments: 4 bytes a parameter less).
std::vector<std::string> saving_settings(const RunConfig& rc) {
  std::vector<std::string> settings;
  for (const MemorySaving& s : memory_savings(rc)) settings.push_back(s.setting);
  return settings;
}

TEST(MemoryEstimate, MemoryOptionsNameSettingsThatSave) {
  const Qwen3MoeConfig config = bench_config();
  const RunConfig rc = bench_run();
  EXPECT_EQ(saving_settings(rc), (std::vector<std::string>{"--optimizer.moments=bf16", "--train.master_weights=split",
                                                           "--train.pair_expert_grads=false", "--train.expert_inputs=gather"}));
  const int64_t n = Qwen3Moe(config, DType::bf16, Device::cuda).num_parameters();
  const int64_t before = estimate_memory<Qwen3Moe>(rc, config, 1, Device::cuda).total();
  const std::vector<MemoryOption> options = memory_options<Qwen3Moe>(rc, config, 1, Device::cuda);
  ASSERT_EQ(options.size(), 5u);  // the bench's micro-batches pair their expert weight gradients, so all four save
  EXPECT_EQ(before - options[0].total, 4 * n);
  EXPECT_EQ(before - options[1].total, 2 * n);
  EXPECT_LT(options[2].total, before);
  EXPECT_LT(options[3].total, before);
  EXPECT_EQ(options[4].setting, "all of the above together");
  RunConfig all = rc;
  all.moments = "bf16";
  all.master_weights = "split";
  all.pair_expert_grads = false;
  all.expert_inputs = "gather";
  EXPECT_EQ(options[4].total, estimate_memory<Qwen3Moe>(all, config, 1, Device::cuda).total());
  const std::string text = format_memory_options(options, double(options[0].total));
  EXPECT_NE(text.find("--optimizer.moments=bf16 "), std::string::npos) << text;
  EXPECT_NE(text.find("fits"), std::string::npos) << text;
  EXPECT_NE(text.find("GiB over"), std::string::npos) << text;

  // One sequence a step: no pairs, so that setting saves nothing and is left out.
  RunConfig one = rc;
  one.global_batch = 1;
  const std::vector<MemoryOption> unpaired = memory_options<Qwen3Moe>(one, config, 1, Device::cuda);
  ASSERT_EQ(unpaired.size(), 4u);
  EXPECT_EQ(unpaired[1].setting, "--train.master_weights=split");
  EXPECT_EQ(unpaired[2].setting, "--train.expert_inputs=gather");

  RunConfig saving = rc;  // everything already on the saving side, or bf16 moments refused by beta2
  saving.master_weights = "split";
  saving.pair_expert_grads = false;
  saving.expert_inputs = "gather";
  saving.beta2 = 0.999;
  EXPECT_TRUE(memory_savings(saving).empty());
  EXPECT_EQ(format_memory_options({}, 1.0), "");
  saving.beta2 = 0.95;
  saving.keep_gathered = saving.keep_whole_grads = true;
  EXPECT_EQ(saving_settings(saving), (std::vector<std::string>{"--optimizer.moments=bf16", "--parallel.keep_gathered=false",
                                                               "--parallel.keep_whole_grads=false"}));
}

// Context parallelism: a process holds seq_len / cp tokens of each sequence, so its activations are a
// cp = 1 process's at seq_len / cp on as many processes (the same shard groups, so the same state)
// plus ring attention's buffers where they are alive at the peak.
TEST(MemoryEstimate, ContextParallelHoldsItsShareOfTheSequence) {
  const Qwen3MoeConfig config = bench_config();
  RunConfig cp2 = bench_run(), half = bench_run(), whole = bench_run();
  cp2.cp = 2;
  cp2.seq_len = whole.seq_len = 65536;
  half.seq_len = 32768;
  const MemoryBill ring = estimate_memory<Qwen3Moe>(cp2, config, 2, Device::cuda);
  const MemoryBill plain = estimate_memory<Qwen3Moe>(half, config, 2, Device::cuda);
  const MemoryBill unsplit = estimate_memory<Qwen3Moe>(whole, config, 2, Device::cuda);
  EXPECT_EQ(ring.bytes(BillGroup::state), plain.bytes(BillGroup::state));
  const RingAttentionBytes buffers = ring_attention_bytes(32768, config.num_heads, config.num_kv_heads, config.head_dim, Device::cuda);
  EXPECT_GT(buffers.forward, 0);
  EXPECT_GT(buffers.backward, 0);
  const int64_t extra = ring.bytes(BillGroup::activations) - plain.bytes(BillGroup::activations);
  EXPECT_GE(extra, 0);
  EXPECT_LE(extra, std::max(buffers.forward, buffers.backward));
  // The ring's peak is where its buffers are alive; the plain run's may lie elsewhere (a layer's
  // experts backward), so the ring adds at most its buffers to it.
  const int64_t at_peak = item(ring, "ring attention buffers at the peak");
  EXPECT_TRUE(at_peak == buffers.forward || at_peak == buffers.backward) << at_peak;
  EXPECT_GE(at_peak, extra);
  EXPECT_LT(ring.bytes(BillGroup::activations), 0.55 * unsplit.bytes(BillGroup::activations));
  // The largest sequence that fits is a multiple of 2 x cp, about twice cp = 1's on as many processes.
  const double gpu = 139.8 * kGiB;
  const LargestFit fit = largest_fit<Qwen3Moe>(cp2, config, 2, Device::cuda, gpu), fit1 = largest_fit<Qwen3Moe>(whole, config, 2, Device::cuda, gpu);
  EXPECT_EQ(fit.seq_len % 4, 0);
  EXPECT_GT(fit.seq_len, 1.8 * fit1.seq_len);
  auto total = [&](int64_t seq_len) {
    RunConfig rc = cp2;
    rc.seq_len = seq_len;
    return double(estimate_memory<Qwen3Moe>(rc, config, 2, Device::cuda, gpu).total());
  };
  EXPECT_LE(total(fit.seq_len), gpu);
  EXPECT_GT(total(fit.seq_len + 4), gpu);
}

TEST(MemoryEstimate, ImpossibleLayoutsGiveOneSentence) {
  RunConfig rc = bench_run(2);
  EXPECT_EQ(estimate_error([&] { estimate_mesh(rc, 128, 3); }),
            "the job has 3 processes, which parallel.pp x parallel.cp x parallel.ep = 1 x 1 x 2 = 2 does not divide");
  EXPECT_EQ(estimate_error([&] { estimate_mesh(rc, 127, 2); }), "bench.toml: num_experts (127) is not a multiple of parallel.ep (2)");
  rc.dp_shard = 3;
  EXPECT_EQ(estimate_error([&] { estimate_mesh(rc, 128, 8); }),
            "parallel.dp_shard (3) does not divide the 4 data-parallel ranks of 8 processes (pp 1 x dp 4 x cp 1 x ep 2)");
  RunConfig batch = bench_run();
  batch.micro_batch = 3;
  EXPECT_EQ(estimate_error([&] { check_global_batch(batch, mesh_shape(1, 1, 1, 1)); }),
            "bench.toml: train.global_batch (4) is not a multiple of the 1 data-parallel processes (pp 1 x dp 1 x cp 1 x ep 1) times "
            "train.micro_batch (3)");
  RunConfig split = bench_run();
  split.cp = 2;
  split.seq_len = 4098;
  EXPECT_EQ(estimate_error([&] { estimate_mesh(split, 128, 2); }),
            "bench.toml: train.seq_len (4098) is not a multiple of 2 x parallel.cp = 4 (context parallelism cuts each sequence into 2 x cp "
            "chunks)");
}

}  // namespace
}  // namespace marrow
