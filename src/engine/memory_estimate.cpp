#include "engine/memory_estimate.h"

#include <algorithm>
#include <array>
#include <map>
#include <tuple>

#include "core/blas.h"
#include "parallel/dualpipev.h"
#include "parallel/ring_attention.h"

namespace marrow {

namespace {

constexpr double kMiB = 1048576.0, kGiB = 1073741824.0;
// Measured on the H200 (docs/logs, the start-up line "GPU free ... of 139.8 GiB" against the arenas):
// the CUDA context with its loaded kernels takes 0.5 GiB; two processes' NCCL communicators (the
// mesh's groups) 0.8 GiB more.
constexpr int64_t kCudaContextBytes = int64_t(0.5 * kGiB), kNcclBytes = int64_t(0.8 * kGiB);
// With ep > 1 a process's experts receive a routing-dependent share of the token copies: T*K when
// balanced. On the bench model (EP = 2) the peak of step 1 (near-uniform routing) matched T*K and
// trained routing settled 0.33 GiB higher, ~10% more rows over the 8 layers.
constexpr double kExpertRowSkew = 1.10;
// Byte counts stay far from overflowing int64 below 2^31 tokens per micro-batch (x vocabulary x 2 B).
constexpr int64_t kMaxTokens = int64_t(1) << 31;

// A shard unit of parallel/sharded_params.h: n processes share it, each holding `chunk` elements.
struct Unit {
  bool expert = false, decoder_layer = false;
  int64_t numel = 0, n = 1, chunk = 0;
  bool weights_kept = true, grads_kept = true;  // whole for the step (else the layers' slots)
};

// The units of a parameter table on one pipeline rank: the norms of each chunk together, else one
// per (layer, expert or not); stage_chunk as ShardedParameters takes it (-1: another rank's).
std::vector<Unit> cut_units(const std::vector<TensorSpec>& specs, int64_t num_layers, const std::vector<int64_t>& stage_chunk,
                            int64_t dense_n, int64_t expert_n, bool keep_gathered, bool keep_whole_grads, bool cast_on_use) {
  std::vector<Unit> units;
  std::map<std::tuple<bool, int64_t, bool>, size_t> index;
  for (const TensorSpec& s : specs) {
    const int64_t chunk = stage_chunk[size_t(s.layer + 1)];
    if (chunk < 0) continue;
    const auto key = s.is_norm ? std::tuple{true, -1 - chunk, false} : std::tuple{false, s.layer, s.is_expert};
    auto [it, added] = index.try_emplace(key, units.size());
    if (added) units.push_back({s.is_expert, !s.is_norm && s.layer >= 0 && s.layer < num_layers});
    units[it->second].numel += s.numel;
  }
  for (Unit& u : units) {
    u.n = u.expert ? expert_n : dense_n;
    u.chunk = (u.numel + u.n - 1) / u.n;
    u.weights_kept = keep_gathered || (u.n == 1 && !cast_on_use) || !u.decoder_layer;
    u.grads_kept = keep_whole_grads || u.n == 1 || !u.decoder_layer;
  }
  return units;
}

std::string mib(int64_t bytes) { return fmt::format("{:.1f} MiB", bytes / kMiB); }

// fp32 master weights and gradients, the AdamW moments in their storage: this process's chunks.
// split: the master's low halves only (its high halves are the bf16 weights of add_weights).
void add_state(MemoryBill& bill, const std::vector<Unit>& units, DType moments, bool split) {
  int64_t chunks = 0, whole = 0;
  for (const Unit& u : units) {
    chunks += u.chunk;
    whole += u.numel;
  }
  auto note = [&](int64_t size) {
    return chunks == whole ? fmt::format("{:.2f}M elements x {} B, whole", whole / 1e6, size)
                           : fmt::format("{:.2f}M of {:.2f}M elements x {} B (shards)", chunks / 1e6, whole / 1e6, size);
  };
  if (split) bill.items.push_back({BillGroup::state, "fp32 master weights' low halves", 2 * chunks, note(2) + "; high halves: the bf16 weights"});
  else bill.items.push_back({BillGroup::state, "fp32 master weights", 4 * chunks, note(4)});
  bill.items.push_back({BillGroup::state, "fp32 gradients", 4 * chunks, note(4)});
  const int64_t size = int64_t(dtype_size(moments));
  const std::string dtype = moments == DType::bf16 ? "bf16" : "fp32", key = moments == DType::bf16 ? "; optimizer.moments" : "";
  for (const char* name : {"exp_avg", "exp_avg_sq"})
    bill.items.push_back({BillGroup::state, fmt::format("AdamW {} ({})", name, dtype), size * chunks, note(size) + key});
}

// Compute copies of the weights and whole fp32 gradients. On the CPU the model computes on the fp32
// master shard itself: only units with n > 1 need a gathered copy there.
void add_weights(MemoryBill& bill, const std::vector<Unit>& units, Device device, bool fp8) {
  const bool gpu = device == Device::cuda;
  const int64_t w = gpu ? 2 : 4;
  const std::string dtype = gpu ? "bf16" : "fp32";
  int64_t kept_whole = 0, kept_grads = 0, layer_shards = 0, experts = 0;
  std::array<int64_t, 2> slot{0, 0}, grad_slot{0, 0};  // the largest slotted unit, dense and expert: n*c elements
  for (const Unit& u : units) {
    if (u.weights_kept) {
      if (gpu || u.n > 1) kept_whole += u.n * u.chunk;
    } else {
      slot[u.expert] = std::max(slot[u.expert], u.n * u.chunk);
      if (gpu && u.n > 1) layer_shards += u.chunk;  // n = 1: cast from the master into the slot
    }
    if (!u.grads_kept) grad_slot[u.expert] = std::max(grad_slot[u.expert], u.n * u.chunk);
    else if (u.n > 1) kept_grads += u.n * u.chunk;
    if (u.expert) experts += u.n * u.chunk;
  }
  const int64_t slots = 2 * (slot[0] + slot[1]), grad_slots = 2 * (grad_slot[0] + grad_slot[1]);
  bill.items.push_back({BillGroup::weights, dtype + " weights of units kept whole", w * kept_whole,
                        "prolog, epilog, norms; units with n = 1 or keep_gathered"});
  bill.items.push_back({BillGroup::weights, dtype + " weight shards of the slotted layers", w * layer_shards, ""});
  bill.items.push_back({BillGroup::weights, dtype + " gathered layer slots", w * slots, "2 dense + 2 expert"});
  bill.items.push_back({BillGroup::weights, "fp32 whole gradients of units kept whole", 4 * kept_grads, ""});
  bill.items.push_back({BillGroup::weights, "fp32 gradient slots of the layers", 4 * grad_slots, "2 dense + 2 expert"});
  // Two bytes an element and two f32 scales a 128 x 128 block (models/common.h: Fp8ExpertWeights).
  if (fp8) bill.items.push_back({BillGroup::weights, "fp8 expert weights and their transposes", 2 * experts + experts / 2048, "train.fp8"});
}

// What one micro-batch holds from the forward for the backward, by kind; and what the previous
// micro-batch left for its expert weight gradients, paired with this one's (engine/trainer.h).
enum Kept { kBatch, kAttention, kRoutes, kExperts, kEpilog, kEarlier, kKeptKinds };

struct Moment {
  std::string where;
  std::array<int64_t, kKeptKinds> kept{};
  int64_t scratch = 0, exchange = 0, ring = 0;  // temporaries; of them the expert all-to-all and the ring attention buffers
  int64_t total() const {
    int64_t sum = scratch;
    for (int64_t k : kept) sum += k;
    return sum;
  }
};

// The engine's buffers of one decoder layer (engine/step.h, parallel/expert_parallel.cpp), for
// T tokens, R expert rows, activations of a bytes and statistics of s bytes.
struct EngineBytes {
  int64_t residual = 0;  // x, dx, dh2, dx_in: [T, H]
  int64_t rows = 0;      // x_perm, y_perm, dy_perm, dx_perm: [R, H]
  // x_perm kept from the forward to the backward, or gathered again from h2 at the layer's experts
  // backward (train.expert_inputs, resolved: gathers_expert_inputs_again).
  int64_t x_perm_kept = 0, x_perm_again = 0;
  int64_t route = 0;     // kept until the layer's backward ends, besides y_perm
  // y_perm kept to the backward (ep > 1: the expert's process takes the routing weights' gradient
  // from it), or freed after combine (ep = 1: engine/step.h, swiglu_weighted_backward in ops/swiglu.h).
  int64_t y_perm_kept = 0, y_perm_until_combine = 0;
  int64_t dtopk = 0;     // [T, K] statistics
  // What stands for dy_perm in a layer whose weight gradients wait (engine/step.h's DeferredExperts):
  // dout and copy_row with one expert-parallel rank, else dy_perm.
  int64_t waiting_dy = 0;
  int64_t dispatch_scratch = 0;
  // ep > 1: rows sent to and received from the group (deduplicated per token and member).
  int64_t sent_rows = 0, recv_rows = 0, sent_weights = 0, recv_weights = 0;
  RingAttentionBytes ring;  // cp > 1: ring attention's buffers in the attention forward and backward
};

// The chance that a token's K experts (uniform, distinct) include one of a member's E/P.
double member_hit(int64_t E, int64_t K, int64_t P) {
  double miss = 1;
  for (int64_t j = 0; j < K; ++j) {
    if (E - E / P - j <= 0) return 1;
    miss *= double(E - E / P - j) / double(E - j);
  }
  return 1 - miss;
}

// gather_again: x_perm is dropped after the experts forward (rc.expert_inputs resolved to "gather").
EngineBytes engine_bytes(const EstimatedModel& m, const AttentionHeads& heads, int64_t T, int64_t R, const MeshShape& mesh,
                         Device device, bool gather_again) {
  const int64_t a = device == Device::cuda ? 2 : 4, s = 4, i32 = 4, H = m.hidden_size, K = m.top_k, ep = mesh.ep;
  EngineBytes e;
  if (mesh.cp > 1) e.ring = ring_attention_bytes(T, heads.q_heads, heads.kv_heads, heads.head_dim, device);
  e.residual = T * H * a;
  e.rows = R * H * a;
  e.dtopk = T * K * s;
  (gather_again && ep == 1 ? e.x_perm_again : e.x_perm_kept) = e.rows;
  (ep > 1 ? e.y_perm_kept : e.y_perm_until_combine) = e.rows;
  e.waiting_dy = ep == 1 ? e.residual + T * K * i32 : e.rows;
  if (ep == 1) {
    e.route = T * K * i32;  // copy_row
    e.dispatch_scratch = device == Device::cuda ? 4 * T * K * i32 : 0;  // the plan's radix sort
    return e;
  }
  const int64_t rows = int64_t(double(T * ep) * member_hit(m.num_experts, K, ep));  // each way, balanced
  e.sent_rows = e.recv_rows = rows * H * a;
  e.sent_weights = e.recv_weights = rows * K * s;
  e.route = T * ep * (i32 + s) + rows * K * (s + i32);  // send_row, unit_weight; recv_weight, copy_row
  return e;
}

// A layer's expert inputs held for its weight gradients: x_perm, dy_perm (or what stands for it)
// and the model's.
int64_t held_for_weights(const ModelActivationBytes& model, const EngineBytes& engine) {
  return engine.rows + engine.waiting_dy + model.experts.held_for_weights;
}

// Replays forward() and backward() of engine/step.h for one micro-batch, keeping the largest moment;
// with `paired`, the second of a pair of micro-batches (the previous one's expert inputs held
// through this one's forward, each layer's released by its experts backward).
class Walk {
 public:
  Walk(const ModelActivationBytes& model, const EngineBytes& engine, int64_t layers, int64_t batch_bytes, bool paired)
      : m_(model), e_(engine), layers_(layers), earlier_per_layer_(paired ? held_for_weights(model, engine) : 0) {
    now_[kBatch] = batch_bytes;
    now_[kEarlier] = layers_ * earlier_per_layer_;
  }
  void forward() {
    at("the prolog's forward", m_.prolog.forward_scratch + e_.residual);
    for (int64_t l = 0; l < layers_; ++l) {
      now_[kAttention] += m_.attention.kept;
      // The ring's buffers are freed before the router's logits are made.
      const int64_t forward = std::max(m_.attention.forward_scratch, e_.ring.forward);
      at(fmt::format("layer {}'s attention forward", l), forward, 0, e_.ring.forward == forward ? forward : 0);
      now_[kRoutes] += e_.route;
      // The plan's scratch is gone when x_perm is made; the exchange buffers live until dispatch returns.
      const int64_t exchange = e_.sent_rows + e_.recv_rows + e_.sent_weights;
      at(fmt::format("layer {}'s dispatch", l), std::max(e_.dispatch_scratch, e_.rows + exchange), exchange);
      now_[kRoutes] += e_.y_perm_kept;
      now_[kExperts] += m_.experts.kept + e_.x_perm_kept;
      at(fmt::format("layer {}'s experts forward", l), m_.experts.forward_scratch + e_.x_perm_again + e_.y_perm_until_combine);
      at(fmt::format("layer {}'s combine", l), e_.residual + e_.recv_rows + e_.sent_rows + e_.y_perm_until_combine,
         e_.recv_rows + e_.sent_rows);
    }
    now_[kEpilog] += m_.epilog.kept;
    at("the epilog's forward", m_.epilog.forward_scratch);
  }
  void backward() {
    at("the epilog's backward", e_.residual + m_.epilog.backward_scratch);
    now_[kEpilog] -= m_.epilog.kept;
    for (int64_t l = layers_ - 1; l >= 0; --l) layer_backward(l);
    at("the prolog's backward", e_.residual + m_.prolog.backward_scratch);
  }
  const Moment& peak() const { return peak_; }
  const Moment& largest_exchange() const { return exchange_; }
  int64_t largest_scratch() const { return largest_scratch_; }

 private:
  void layer_backward(int64_t l) {
    int64_t held = e_.residual + e_.rows + e_.dtopk + e_.recv_weights;  // dx, dy_perm, dtopk_weight, dweight_recv
    at(fmt::format("layer {}'s combine backward", l), held + e_.sent_rows + e_.recv_rows, e_.sent_rows + e_.recv_rows);
    at(fmt::format("layer {}'s experts backward", l), held + e_.rows + e_.x_perm_again + m_.experts.backward_scratch);
    now_[kExperts] -= m_.experts.kept + e_.x_perm_kept;
    now_[kEarlier] -= earlier_per_layer_;
    held += e_.rows + e_.residual;  // dx_perm, dh2
    const int64_t back = e_.recv_rows + e_.sent_rows + e_.sent_weights;
    at(fmt::format("layer {}'s dispatch backward", l), held + back, back);
    // With cp > 1 the ring's buffers join the op's scratch (a bound: the model's figure is the larger
    // of the op's scratch and the gradients that follow it).
    at(fmt::format("layer {}'s attention backward", l), held + e_.residual + m_.attention.backward_scratch + e_.ring.backward, 0,
       e_.ring.backward);
    now_[kAttention] -= m_.attention.kept;
    now_[kRoutes] -= e_.route + e_.y_perm_kept;
  }
  void at(const std::string& where, int64_t scratch, int64_t exchange = 0, int64_t ring = 0) {
    const Moment m{where, now_, scratch, exchange, ring};
    if (m.total() > peak_.total()) peak_ = m;
    if (exchange > exchange_.exchange) exchange_ = m;
    largest_scratch_ = std::max(largest_scratch_, scratch);
  }
  const ModelActivationBytes& m_;
  const EngineBytes& e_;
  int64_t layers_, earlier_per_layer_;
  std::array<int64_t, kKeptKinds> now_{};
  Moment peak_, exchange_;
  int64_t largest_scratch_ = 0;
};

ModelActivationBytes with_chain(ModelActivationBytes m, int64_t cp) {
  if (cp > 1) m.attention.kept += m.chain_kept;
  return m;
}

// One micro-batch of rc through the whole model: its stages' bytes and the walk over them. With
// context parallelism a process holds seq_len / cp tokens of each sequence.
struct OneMicroBatch {
  int64_t tokens, rows;  // rows: the expert rows of each layer on this process
  ModelActivationBytes model;
  EngineBytes engine;
  Walk walk;
  OneMicroBatch(const RunConfig& rc, const EstimatedModel& m, const MeshShape& mesh, Device device, bool paired = false)
      : tokens(rc.micro_batch * rc.seq_len / mesh.cp),
        rows(mesh.ep == 1 ? tokens * m.top_k : int64_t(double(tokens * m.top_k) * kExpertRowSkew)),
        model(with_chain(m.activation_bytes(rc.micro_batch, rc.seq_len / mesh.cp, rows), mesh.cp)),
        engine(engine_bytes(m, model.attention_heads, tokens, rows, mesh, device, rc.expert_inputs == "gather")),
        walk(model, engine, m.num_layers, 3 * tokens * 4, paired) {
    walk.forward();
    walk.backward();
  }
};

// What the experts' line says of x_perm, with one expert-parallel rank (rc.expert_inputs resolved).
std::string expert_inputs_note(const RunConfig& rc, const MeshShape& mesh) {
  if (mesh.ep > 1) return "";
  return rc.expert_inputs == "gather" ? "; x_perm gathered again for the backward (train.expert_inputs)"
                                      : "; x_perm among them (train.expert_inputs)";
}

// paired: the step's micro-batches pair their expert weight gradients (engine/trainer.h).
void add_activations(MemoryBill& bill, const RunConfig& rc, const EstimatedModel& m, const MeshShape& mesh, Device device, bool paired) {
  const OneMicroBatch one(rc, m, mesh, device, paired);
  const ModelActivationBytes& model = one.model;
  const EngineBytes& engine = one.engine;
  const Moment& p = one.walk.peak();
  bill.activation_peak_at = p.where;
  auto per_layer = [&](int64_t bytes) { return fmt::format("kept: {} per layer", mib(bytes)); };
  const std::vector<std::pair<std::string, std::string>> kinds = {
      {"token ids, targets, positions", ""},
      {"attention + router (stage 1)", per_layer(model.attention.kept)},
      {"dispatch/combine rows and routes", per_layer(engine.route + engine.y_perm_kept)},
      {"experts (stage 3)", per_layer(model.experts.kept + engine.x_perm_kept) + expert_inputs_note(rc, mesh)},
      {"epilog: final norm, logits, loss", fmt::format("kept: {}", mib(model.epilog.kept))},
      {"previous micro-batch's expert inputs", paired ? fmt::format("{} per layer until its weight gradients, paired with this one's (train.pair_expert_grads=false frees it)",
                                                                     mib(held_for_weights(model, engine))) : "none: no pairs"}};
  for (size_t k = 0; k < kinds.size(); ++k) bill.items.push_back({BillGroup::activations, kinds[k].first, p.kept[k], kinds[k].second});
  bill.items.push_back({BillGroup::activations, "temporaries at the peak", p.scratch - p.exchange - p.ring, "gradients flowing back, op scratch"});
  if (mesh.cp > 1)
    bill.items.push_back({BillGroup::activations, "ring attention buffers at the peak", p.ring,
                          fmt::format("context parallelism over {}: {} in a layer's forward, {} in its backward", mesh.cp,
                                      mib(engine.ring.forward), mib(engine.ring.backward))});
  if (mesh.ep > 1) {
    const Moment& x = one.walk.largest_exchange();
    bill.items.push_back({BillGroup::activations, "expert all-to-all buffers at the peak", p.exchange,
                          fmt::format("largest {} in {}; expert rows {} per layer (+{:.0f}% for routing skew)", mib(x.exchange), x.where,
                                      one.rows, (kExpertRowSkew - 1) * 100)});
  }
}

// Activations of one pipeline rank under DualPipeV: every micro-batch chunk whose forward ran and
// whose backward (or, deferred, its W) has not, at the heaviest op of the rank's order, plus the
// largest temporaries of one micro-batch (a bound: the op's own are at most those).
struct PipelinePlace {
  const std::vector<PipelineChunk>& chunks;
  int64_t pp, rank, micro_batches;
};

void add_pipeline_activations(MemoryBill& bill, const RunConfig& rc, const EstimatedModel& m, const MeshShape& mesh, Device device,
                              const PipelinePlace& place) {
  const OneMicroBatch one(rc, m, mesh, device);
  const ModelActivationBytes& model = one.model;
  const EngineBytes& engine = one.engine;
  const int64_t T = one.tokens;
  const int64_t per_layer = model.attention.kept + engine.route + engine.y_perm_kept + model.experts.kept + engine.x_perm_kept;
  const int64_t waiting = held_for_weights(model, engine);  // a deferred W's
  auto chunk = [&](int phase) -> const PipelineChunk& { return place.chunks[size_t(phase == 0 ? place.rank : 2 * place.pp - 1 - place.rank)]; };
  auto layers = [&](int phase) { return chunk(phase).layers(m.num_layers); };
  auto kept = [&](int phase) { return layers(phase) * per_layer + (chunk(phase).last == m.num_layers ? model.epilog.kept : 0); };
  int64_t live = 0, peak = 0;
  std::string peak_at;
  for (const PipelineOp& op : dualpipev_order(place.pp, place.rank, place.micro_batches)) {
    const bool forward = op.kind == PipelineOp::forward || op.kind == PipelineOp::forward_backward;
    if (forward) live += kept(op.phase);
    if (live > peak) {
      peak = live;
      peak_at = describe_order({op});
    }
    if (op.kind == PipelineOp::forward_backward) live -= kept(1 - op.phase);
    if (op.kind == PipelineOp::backward) live -= op.defer_weights ? kept(op.phase) - layers(op.phase) * waiting : kept(op.phase);
    if (op.kind == PipelineOp::weights) live -= layers(op.phase) * waiting;
  }
  bill.activation_peak_at = "DualPipeV op " + peak_at + " of pipeline rank " + std::to_string(place.rank);
  bill.items.push_back({BillGroup::activations, "token ids, targets, positions", 3 * T * 4 * place.micro_batches, "every micro-batch of the step"});
  bill.items.push_back({BillGroup::activations, "micro-batch chunks alive", peak, fmt::format("kept: {} per layer", mib(per_layer))});
  bill.items.push_back({BillGroup::activations, "temporaries (one micro-batch's largest)", one.walk.largest_scratch(), "gradients flowing back, op scratch"});
}

void add_runtime(MemoryBill& bill, const MeshShape& mesh) {
  bill.items.push_back({BillGroup::runtime, "CUDA context and kernels", kCudaContextBytes, "measured on the H200"});
  bill.items.push_back({BillGroup::runtime, "cuBLAS/cuBLASLt workspace", int64_t(kBlasWorkspaceBytes), "one compute stream"});
  if (mesh.world() > 1)
    bill.items.push_back({BillGroup::runtime, "NCCL communicators", kNcclBytes, "measured with 2 processes; more with larger groups"});
}

// The largest v in [1, limit] with fits(v), for fits true up to some v and false beyond; 0 if none.
int64_t largest_fitting(const std::function<bool(int64_t)>& fits, int64_t limit) {
  if (!fits(1)) return 0;
  int64_t good = 1, bad = 2;
  while (bad <= limit && fits(bad)) {
    good = bad;
    bad *= 2;
  }
  bad = std::min(bad, limit + 1);
  while (bad - good > 1) {
    const int64_t mid = good + (bad - good) / 2;
    (fits(mid) ? good : bad) = mid;
  }
  return good;
}

}  // namespace

int64_t MemoryBill::bytes(BillGroup group) const {
  int64_t sum = 0;
  for (const BillItem& i : items)
    if (i.group == group) sum += i.bytes;
  return sum;
}

int64_t MemoryBill::total() const {
  int64_t sum = 0;
  for (const BillItem& i : items) sum += i.bytes;
  return sum;
}

MeshShape estimate_mesh(const RunConfig& rc, int64_t num_experts, int64_t world) {
  MARROW_CHECK(world >= 1, "--world must be at least 1, got {}", world);
  const MeshShape mesh = mesh_shape(world, rc.pp, rc.cp, rc.ep, rc.dp_shard);
  MARROW_CHECK(num_experts % mesh.ep == 0, "{}: num_experts ({}) is not a multiple of parallel.ep ({})", rc.source, num_experts, mesh.ep);
  MARROW_CHECK(mesh.cp == 1 || rc.seq_len % (2 * mesh.cp) == 0,
               "{}: train.seq_len ({}) is not a multiple of 2 x parallel.cp = {} (context parallelism cuts each sequence into 2 x cp chunks)",
               rc.source, rc.seq_len, 2 * mesh.cp);
  return mesh;
}

void check_global_batch(const RunConfig& rc, const MeshShape& mesh) {
  const int64_t round = mesh.data_parallel() * rc.micro_batch;
  MARROW_CHECK(rc.global_batch % round == 0,
               "{}: train.global_batch ({}) is not a multiple of the {} data-parallel processes ({}) times train.micro_batch ({})",
               rc.source, rc.global_batch, mesh.data_parallel(), mesh.describe(), rc.micro_batch);
  MARROW_CHECK(rc.pipeline_schedule != "sequential" || mesh.pp == 1, "{}: parallel.schedule = sequential runs no pipeline; parallel.pp = {} needs dualpipev",
               rc.source, mesh.pp);
  MARROW_CHECK(rc.pp_layers == "auto" || rc.uses_dualpipev(),
               "{}: parallel.pp_layers = {} splits DualPipeV's chunks, but this run has none (it needs parallel.pp > 1 or parallel.schedule = "
               "dualpipev)",
               rc.source, rc.pp_layers);
  const int64_t micro_batches = rc.global_batch / round;
  MARROW_CHECK(!rc.uses_dualpipev() || micro_batches >= 2 * mesh.pp,
               "{}: DualPipeV needs at least 2 x parallel.pp = {} micro-batches per step, but train.global_batch / (train.micro_batch x {} "
               "data-parallel processes) = {}",
               rc.source, 2 * mesh.pp, mesh.data_parallel(), micro_batches);
}

ShardGroups shard_groups(const MeshShape& mesh) {
  return {mesh.dp_shard * mesh.cp * mesh.ep, mesh.dp_shard * mesh.cp};
}

namespace {

// The bill of pipeline rank `rank` (with DualPipeV; else the only one).
MemoryBill rank_bill(const RunConfig& rc, const EstimatedModel& m, const MeshShape& mesh, ShardGroups groups, Device device, int64_t rank) {
  const bool pipelined = rc.uses_dualpipev();
  const int64_t micro_batches = std::max<int64_t>(1, rc.global_batch / (rc.micro_batch * mesh.data_parallel()));
  const std::vector<PipelineChunk> chunks = pipelined ? pipeline_layout(rc, m, mesh) : std::vector<PipelineChunk>{};
  const std::vector<int64_t> held = pipelined ? held_stage_chunks(chunks, m.num_layers, rank) : std::vector<int64_t>(size_t(m.num_layers + 2), 0);
  const bool keep_gathered = rc.keep_gathered || pipelined, keep_whole_grads = rc.keep_whole_grads || pipelined;
  MemoryBill bill;
  bill.device = device;
  bill.context = {
      "model: " + m.description,
      fmt::format("layout: {} process{} ({}); shard groups: {} (dense units), {} (expert units){}", mesh.world(), mesh.world() > 1 ? "es" : "",
                  mesh.describe(), groups.dense, groups.expert, fmt::format("{}{}", keep_gathered ? "; parallel.keep_gathered" : "", keep_whole_grads ? "; parallel.keep_whole_grads" : "")),
      fmt::format("micro-batch: {} x {} tokens{}, {} per optimizer step; {} ({})", rc.micro_batch, rc.seq_len,
                  mesh.cp > 1 ? fmt::format(" ({} of each sequence on this process: context parallelism)", rc.seq_len / mesh.cp) : "",
                  micro_batches, device_name(device), device == Device::cuda ? "bf16 compute, fp32 master weights" : "fp32")};
  if (pipelined)
    bill.context.push_back(fmt::format("DualPipeV: pipeline rank {} of {} (chunks {} and {}), the rank with the largest bill", rank, mesh.pp,
                                       rank, 2 * mesh.pp - 1 - rank));
  const bool cast_on_use = !rc.bf16_weight_copy && device == Device::cuda;
  const std::vector<Unit> units = cut_units(m.specs, m.num_layers, held, groups.dense, groups.expert, keep_gathered, keep_whole_grads, cast_on_use);
  add_state(bill, units, moments_dtype(rc), device == Device::cuda && rc.master_weights == "split");
  add_weights(bill, units, device, rc.fp8);
  if (pipelined) add_pipeline_activations(bill, rc, m, mesh, device, {chunks, mesh.pp, rank, micro_batches});
  else
    add_activations(bill, rc, m, mesh, device,
                    pairs_expert_weight_gradients(rc.pair_expert_grads, rc.micro_batch * rc.seq_len / mesh.cp, m.top_k, mesh.ep, m.num_experts) &&
                        micro_batches >= 2 && (keep_whole_grads || groups.expert == 1));
  if (device == Device::cuda) add_runtime(bill, mesh);
  return bill;
}

// The bill with train.expert_inputs already "keep" or "gather".
MemoryBill resolved_bill(const RunConfig& rc, const EstimatedModel& m, const MeshShape& mesh, ShardGroups groups, Device device) {
  MemoryBill largest = rank_bill(rc, m, mesh, groups, device, 0);
  for (int64_t r = 1; rc.uses_dualpipev() && r < mesh.pp; ++r) {
    MemoryBill bill = rank_bill(rc, m, mesh, groups, device, r);
    if (bill.total() > largest.total()) largest = std::move(bill);
  }
  return largest;
}

RunConfig with_expert_inputs(const RunConfig& rc, bool gather_again) {
  RunConfig out = rc;
  out.expert_inputs = gather_again ? "gather" : "keep";
  return out;
}

std::string layer_list(const std::vector<PipelineChunk>& chunks, int64_t num_layers) {
  return fmt::format("{}", fmt::join(chunk_layer_counts(chunks, num_layers), " "));
}

}  // namespace

bool gathers_expert_inputs_again(const RunConfig& rc, const EstimatedModel& m, const MeshShape& mesh, ShardGroups groups, Device device,
                                 double device_bytes) {
  if (mesh.ep > 1 || rc.expert_inputs == "keep") return false;
  if (rc.expert_inputs == "gather") return true;
  if (device_bytes <= 0) return false;
  return double(resolved_bill(with_expert_inputs(rc, false), m, mesh, groups, device).total()) > kKeptExpertInputsShare * device_bytes;
}

MemoryBill estimate_memory(const RunConfig& rc, const EstimatedModel& m, const MeshShape& mesh, ShardGroups groups, Device device,
                           double device_bytes) {
  MARROW_CHECK(rc.micro_batch <= kMaxTokens / rc.seq_len,
               "{}: train.micro_batch x train.seq_len ({} x {}) is beyond the 2^31 tokens per micro-batch that the estimate counts", rc.source,
               rc.micro_batch, rc.seq_len);
  return resolved_bill(with_expert_inputs(rc, gathers_expert_inputs_again(rc, m, mesh, groups, device, device_bytes)), m, mesh, groups, device);
}

std::vector<ChunkCost> pipeline_stage_costs(const RunConfig& rc, const EstimatedModel& m, const MeshShape& mesh) {
  // Rates of the bench model's step on one H200 (docs/performance.md, "DualPipeV's layer partition"):
  // a decoder layer's matmuls with all that runs around them (norms, router, dispatch, combine),
  // causal attention, and the LM head with the loss. The head's GEMMs are large and run near
  // cuBLAS's best, so by work alone it would look twice as heavy as it is.
  constexpr double kLayerTflops = 414, kAttentionTflops = 420, kHeadTflops = 686;
  std::vector<double> dense(size_t(m.num_layers + 2), 0), experts(size_t(m.num_layers + 2), 0);
  for (const TensorSpec& s : m.specs)
    if (!s.is_norm && s.layer >= 0) (s.is_expert ? experts : dense)[size_t(s.layer + 1)] += double(s.numel);
  // The specs hold this process's experts: a token's top-k fall on them with this share.
  const double active_share = double(m.top_k * mesh.ep) / double(m.num_experts);
  // Causal attention per token: 2 S x width multiply-adds forward, twice that backward.
  const double attention = 2.0 * double(rc.seq_len) * double(m.attention_width);
  std::vector<ChunkCost> cost(size_t(m.num_layers + 2), ChunkCost{0, 0, 0});  // the prolog's embedding gather: ~0
  for (int64_t layer = 0; layer < m.num_layers; ++layer) {
    const double d = 2 * dense[size_t(layer + 1)] / kLayerTflops, x = 2 * experts[size_t(layer + 1)] * active_share / kLayerTflops;
    // backward: input gradients, and the dense weight gradients computed inline; weights: the
    // expert weight gradients a W may take later.
    cost[size_t(layer + 1)] = {d + x + attention / kAttentionTflops, d + x + d + 2 * attention / kAttentionTflops, x};
  }
  const double head = 2 * dense.back() / kHeadTflops;
  cost.back() = {head, 2 * head, 0};
  return cost;
}

std::vector<PipelineChunk> pipeline_layout(const RunConfig& rc, const EstimatedModel& m, const MeshShape& mesh) {
  const int64_t micro_batches = rc.global_batch / (rc.micro_batch * mesh.data_parallel());
  return chosen_pipeline_chunks(rc.pp_layers, m.num_layers, mesh.pp, micro_batches, pipeline_stage_costs(rc, m, mesh));
}

std::string pipeline_report(const RunConfig& rc, const EstimatedModel& m, const MeshShape& mesh) {
  const int64_t micro_batches = rc.global_batch / (rc.micro_batch * mesh.data_parallel());
  const std::vector<PipelineChunk> chunks = pipeline_layout(rc, m, mesh), even = pipeline_chunks(m.num_layers, mesh.pp);
  const std::vector<ChunkCost> stage_cost = pipeline_stage_costs(rc, m, mesh);
  const std::vector<ChunkCost> cost = chunk_costs(chunks, stage_cost);
  const PipelineSimulation sim = simulate_dualpipev(mesh.pp, micro_batches, cost);
  const PipelineSimulation even_sim = simulate_dualpipev(mesh.pp, micro_batches, chunk_costs(even, stage_cost));
  std::string out = fmt::format("DualPipeV: {} pipeline ranks, {} micro-batches per step; layers per chunk: {} (parallel.pp_layers = {})",
                                mesh.pp, micro_batches, layer_list(chunks, m.num_layers), rc.pp_layers);
  out += fmt::format("\nsimulated step against the even split ({}): {:.3f}x its time", layer_list(even, m.num_layers),
                     sim.makespan / even_sim.makespan);
  out += fmt::format("\nsimulated bubble: {:.1f}% of the step idle (costs: work per stage at the H200's measured rates; no transfer time); per rank:",
                     100 * sim.bubble());
  for (double busy : sim.busy) out += fmt::format(" {:.1f}%", 100 * (1 - busy / sim.makespan));
  out += "\npeak live micro-batch chunks per rank:";
  for (int64_t live : sim.peak_live) out += fmt::format(" {}", live);
  out += "\n";
  out += "chunk passes in forward-backward pairs per rank (only those can hide expert exchanges):";
  for (int64_t r = 0; r < mesh.pp; ++r) {
    const std::vector<PipelineOp> order = dualpipev_order(mesh.pp, r, micro_batches);
    const auto pairs = std::count_if(order.begin(), order.end(), [](const PipelineOp& op) { return op.kind == PipelineOp::forward_backward; });
    const auto single = std::count_if(order.begin(), order.end(), [](const PipelineOp& op) {
      return op.kind == PipelineOp::forward || op.kind == PipelineOp::backward;
    });
    out += fmt::format(" {} of {}", 2 * pairs, 2 * pairs + single);
  }
  out += "\n";
  for (int64_t r = 0; r < mesh.pp; ++r) out += fmt::format("schedule: pipeline rank {}: {}\n", r, describe_order(dualpipev_order(mesh.pp, r, micro_batches)));
  double lightest = cost.front().forward;
  for (const ChunkCost& k : cost) lightest = std::min(lightest, k.forward);
  return out + "timeline (6 columns = the lightest chunk's forward; blank: idle):\n" + draw_timeline(mesh.pp, micro_batches, sim, 6 / lightest);
}

LargestFit largest_fit(const RunConfig& rc, const EstimatedModel& m, const MeshShape& mesh, Device device, double gpu_bytes) {
  auto fits = [&](int64_t micro_batch, int64_t seq_len) {
    RunConfig trial = rc;
    trial.micro_batch = micro_batch;
    trial.seq_len = seq_len;
    // As many micro-batches per step as rc has (DualPipeV's order depends on their number).
    trial.global_batch = rc.global_batch / rc.micro_batch * micro_batch;
    return double(estimate_memory(trial, m, mesh, shard_groups(mesh), device, gpu_bytes).total()) <= gpu_bytes;
  };
  // Context parallelism cuts a sequence into 2 x cp chunks: the sequences tried are multiples of that.
  const int64_t unit = mesh.cp > 1 ? 2 * mesh.cp : 1;
  const int64_t most_sequences = kMaxTokens / rc.seq_len, most_chunks = kMaxTokens / rc.micro_batch / unit;
  LargestFit fit{largest_fitting([&](int64_t b) { return fits(b, rc.seq_len); }, most_sequences),
                 unit * largest_fitting([&](int64_t s) { return fits(rc.micro_batch, unit * s); }, most_chunks)};
  fit.micro_batch_at_limit = fit.micro_batch == most_sequences;
  fit.seq_len_at_limit = fit.seq_len == unit * most_chunks;
  return fit;
}

std::string format_bill(const MemoryBill& bill, double gpu_bytes) {
  static const std::array<const char*, 4> kGroups = {"parameters and optimizer state", "compute weights and whole gradients",
                                                     "activations of one micro-batch", "runtime (outside the trainer's peak figure)"};
  std::string out;
  for (const std::string& line : bill.context) out += line + "\n";
  out += fmt::format("\n{:<46} {:>10} {:>8}\n", "", "MiB", "GiB");
  for (size_t g = 0; g < kGroups.size(); ++g) {
    const auto group = BillGroup(g);
    if (group == BillGroup::runtime && bill.bytes(group) == 0) continue;
    out += fmt::format("{:<46} {:>10.1f} {:>8.2f}{}\n", kGroups[g], bill.bytes(group) / kMiB, bill.bytes(group) / kGiB,
                       group == BillGroup::activations ? "  what is alive at the peak, " + bill.activation_peak_at : "");
    for (const BillItem& i : bill.items)
      if (i.group == group && (i.bytes > 0 || group == BillGroup::activations))
        out += fmt::format("  {:<44} {:>10.1f} {:>8.2f}  {}\n", i.name, i.bytes / kMiB, i.bytes / kGiB, i.note);
  }
  out += fmt::format("{:<46} {:>10.1f} {:>8.2f}\n", "trainer's peak figure (arenas + activations)", bill.trainer_peak() / kMiB,
                     bill.trainer_peak() / kGiB);
  out += fmt::format("{:<46} {:>10.1f} {:>8.2f}\n", "total", bill.total() / kMiB, bill.total() / kGiB);
  if (bill.device != Device::cuda) return out;
  const double spare = gpu_bytes - double(bill.total());
  out += spare >= 0 ? fmt::format("fits in {:.2f} GiB of GPU memory with {:.2f} GiB to spare\n", gpu_bytes / kGiB, spare / kGiB)
                    : fmt::format("does NOT fit in {:.2f} GiB of GPU memory: {:.2f} GiB over\n", gpu_bytes / kGiB, -spare / kGiB);
  return out;
}

DType moments_dtype(const RunConfig& rc) { return rc.moments == "bf16" ? DType::bf16 : DType::f32; }

std::vector<MemorySaving> memory_savings(const RunConfig& rc) {
  std::vector<MemorySaving> out;
  if (rc.moments == "fp32" && rc.beta2 <= 0.99 && rc.optimizer_kind == "adamw")
    out.push_back({"--optimizer.moments=bf16", [](RunConfig& c) { c.moments = "bf16"; }});
  // The split saves what dropping the weight copy would, and costs no casts: the one offered.
  if (rc.master_weights == "fp32" && rc.bf16_weight_copy)
    out.push_back({"--train.master_weights=split", [](RunConfig& c) { c.master_weights = "split"; }});
  if (rc.pair_expert_grads) out.push_back({"--train.pair_expert_grads=false", [](RunConfig& c) { c.pair_expert_grads = false; }});
  if (rc.expert_inputs != "gather") out.push_back({"--train.expert_inputs=gather", [](RunConfig& c) { c.expert_inputs = "gather"; }});
  if (rc.keep_gathered) out.push_back({"--parallel.keep_gathered=false", [](RunConfig& c) { c.keep_gathered = false; }});
  if (rc.keep_whole_grads) out.push_back({"--parallel.keep_whole_grads=false", [](RunConfig& c) { c.keep_whole_grads = false; }});
  return out;
}

std::string format_memory_options(const std::vector<MemoryOption>& options, double gpu_bytes) {
  if (options.empty()) return "";
  std::string out = "settings that save memory, each alone (total against the GPU's memory):\n";
  for (const MemoryOption& o : options) {
    const double spare = gpu_bytes - double(o.total);
    out += fmt::format("  {:<44} {:>8.2f} GiB  {}\n", o.setting, o.total / kGiB,
                       spare >= 0 ? "fits" : fmt::format("{:.2f} GiB over", -spare / kGiB));
  }
  return out;
}

}  // namespace marrow
