#include "engine/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <set>
#include <thread>

#include "core/bf16.h"
#include "core/progress.h"
#include "core/safetensors.h"
#include "core/sha256.h"
#include "data/token_corpus.h"
#include "engine/config_changes.h"
#include "engine/hf_format.h"

namespace fs = std::filesystem;

namespace marrow {

namespace {

constexpr const char* kFormat = "marrow-checkpoint";
constexpr int64_t kFormatVersion = 1;
constexpr const char* kMeta = "meta.json";
const char* const kGroups[] = {"weights", "exp_avg", "exp_avg_sq"};

void sync_to_disk(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MARROW_CHECK(fd >= 0, "cannot open {} to sync it: {}", path, std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  MARROW_CHECK(rc == 0, "cannot sync {} to disk: {}", path, std::strerror(err));
}

void rename_path(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  MARROW_CHECK(!ec, "cannot rename {} to {}: {}", from, to, ec.message());
}

void remove_tree(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  MARROW_CHECK(!ec, "cannot remove {}: {}", path, ec.message());
}

// The step of a directory named step-XXXXXXXX, or -1 for any other name.
int64_t step_of(const std::string& name) {
  if (name.size() < 13 || name.compare(0, 5, "step-") != 0) return -1;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return -1;
  return std::stoll(name.substr(5));
}

// Complete checkpoints of a run directory, oldest first.
std::vector<std::pair<int64_t, std::string>> complete_checkpoints(const std::string& run_dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec)) return found;
  for (const auto& entry : fs::directory_iterator(run_dir, ec)) {
    const int64_t step = step_of(entry.path().filename().string());
    if (step >= 0 && entry.is_directory() && fs::exists(entry.path() / kMeta)) found.push_back({step, entry.path().string()});
  }
  std::sort(found.begin(), found.end());
  return found;
}

std::string shape_string(const std::vector<int64_t>& shape) { return host_tensor(nullptr, DType::f32, shape).shape_string(); }

std::string human_bytes(double bytes) {
  return bytes >= 1073741824.0 ? fmt::format("{:.2f} GiB", bytes / 1073741824.0) : fmt::format("{:.1f} MiB", bytes / 1048576.0);
}

std::string now_utc() {
  std::time_t t = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return text;
}

Json run_config_json(const RunConfig& rc) {
  return {{"model", {{"config", rc.model_config}}},
          {"data", {{"path", rc.data_path}, {"validation_fraction", rc.validation_fraction}, {"max_epochs", rc.max_epochs}}},
          {"train",
           {{"steps", rc.steps}, {"global_batch", rc.global_batch}, {"micro_batch", rc.micro_batch}, {"seq_len", rc.seq_len},
            {"seed", rc.seed}, {"device", rc.device}, {"aux_loss_coef", rc.aux_loss_coef}, {"max_bad_steps", rc.max_bad_steps}}},
          {"optimizer",
           {{"lr", rc.lr}, {"min_lr", rc.min_lr}, {"beta1", rc.beta1}, {"beta2", rc.beta2}, {"eps", rc.eps},
            {"weight_decay", rc.weight_decay}, {"grad_clip", rc.grad_clip}, {"moments", rc.moments}, {"kind", rc.optimizer_kind},
            {"muon_momentum", rc.muon_momentum}, {"muon_scale", rc.muon_scale}, {"muon_steps", rc.muon_steps}}},
          {"schedule", {{"kind", rc.schedule}, {"warmup_steps", rc.warmup_steps}, {"decay_fraction", rc.decay_fraction}}},
          {"checkpoint",
           {{"every", rc.checkpoint_every}, {"keep", rc.checkpoint_keep}, {"resume", rc.checkpoint_resume},
            {"optimizer_state", rc.checkpoint_optimizer_state}, {"allow_changes", rc.checkpoint_allow_changes}}},
          {"output", {{"dir", rc.out_dir}, {"log_every", rc.log_every}}},
          {"parallel",
           {{"pp", rc.pp}, {"cp", rc.cp}, {"ep", rc.ep}, {"timeout_s", rc.timeout_s}, {"overlap_grad_reduce", rc.overlap_grad_reduce},
            {"dp_shard", rc.dp_shard}, {"keep_gathered", rc.keep_gathered},
            {"keep_whole_grads", rc.keep_whole_grads}}}};
}

}  // namespace

std::string checkpoint_name(int64_t step) { return fmt::format("step-{:08d}", step); }

int64_t checkpoint_bytes_per_parameter(const RunConfig& rc) {
  return 4 + (rc.checkpoint_optimizer_state ? 2 * (rc.moments == "bf16" ? 2 : 4) : 0);
}

std::string checkpoint_contents(const RunConfig& rc) {
  if (!rc.checkpoint_optimizer_state) return "fp32 weights";
  return rc.moments == "bf16" ? "fp32 weights, bf16 AdamW moments" : "fp32 weights and AdamW moments";
}

std::string Checkpoint::tokenizer_path() const {
  const std::string path = dir + "/tokenizer.json";
  return fs::exists(path) ? path : "";
}

namespace {

std::vector<std::pair<size_t, size_t>> files_of(const std::vector<TensorPiece>& pieces, size_t element_bytes, size_t max_bytes) {
  std::vector<int64_t> counts;
  for (const TensorPiece& p : pieces) counts.push_back(p.count);
  return cut_into_files(counts, element_bytes, max_bytes);
}

// Pieces address the spec's tensor; files address the canonical one (TensorSpec::canonical_first).
bool is_whole(const TensorPiece& p, const TensorSpec& s) { return s.canonical_first + p.first == 0 && p.count == s.stored_numel(); }

// A group's files hold its arena's dtype: f32, or bf16 for moments kept in bf16 (optimizer.moments).
// A loading run may keep another: bf16 widens to f32 exactly, f32 rounds to the nearest bf16.
// Copies src (a host tensor read from a file) into dst (an arena slice, any device).
void copy_converting(Tensor dst, Tensor src) {
  if (dst.dtype == src.dtype) return copy(dst, src);
  Buffer staged(dst.dtype, Device::cpu, {src.numel()});
  if (dst.dtype == DType::f32) bf16_to_float(static_cast<const uint16_t*>(src.data), staged.ptr<float>(), src.numel());
  else float_to_bf16(src.ptr<float>(), static_cast<uint16_t*>(staged.view().data), src.numel());
  copy(dst, staged.view());
}

}  // namespace

std::vector<TensorPiece> whole_tensors(const std::vector<TensorSpec>& specs) {
  std::vector<TensorPiece> pieces;
  for (size_t i = 0; i < specs.size(); ++i) pieces.push_back({i, 0, specs[i].numel, specs[i].offset});
  return pieces;
}

Json write_checkpoint_part(const std::string& tmp, const std::vector<TensorSpec>& specs, const std::vector<TensorPiece>& pieces,
                           const CheckpointArenas& arenas, const std::string& part, size_t shard_bytes, bool show_progress) {
  const Arena* group_arena[] = {arenas.weights, arenas.exp_avg, arenas.exp_avg_sq};
  size_t total = 0;
  for (const Arena* a : group_arena)
    for (const TensorPiece& p : pieces) total += a ? size_t(p.count) * dtype_size(a->all().dtype) : 0;
  Progress progress("checkpoint: writing " + tmp, total, show_progress);
  // Pauses after the first file of each save, so tests can kill a save midway (crash safety).
  const char* pause_ms = std::getenv("MARROW_TEST_SAVE_PAUSE_MS");

  Json files = Json::array();
  std::vector<std::future<std::string>> hashes;  // sha256 of each file, computed while the next is written
  for (int g = 0; g < 3; ++g) {
    const Arena* arena = group_arena[g];
    if (!arena || pieces.empty()) continue;
    const DType dtype = arena->all().dtype;
    const auto file_ranges = files_of(pieces, dtype_size(dtype), shard_bytes);
    for (size_t k = 0; k < file_ranges.size(); ++k) {
      int64_t elements = 0;
      for (size_t i = file_ranges[k].first; i < file_ranges[k].second; ++i) elements += pieces[i].count;
      Buffer host(dtype, Device::cpu, {elements});
      std::vector<SafetensorsEntry> entries;
      Json slices = Json::object();
      int64_t at = 0;
      for (size_t i = file_ranges[k].first; i < file_ranges[k].second; ++i) {
        const TensorPiece& p = pieces[i];
        const TensorSpec& spec = specs.at(p.spec);
        Tensor dst = host.view().rows(at, at + p.count);
        copy(dst, arena->slice(p.offset, {p.count}));
        entries.push_back({spec.name, host_tensor(dst.data, dtype, is_whole(p, spec) ? spec.stored_shape() : std::vector<int64_t>{p.count})});
        if (!is_whole(p, spec))
          slices[spec.name] = {{"first", spec.canonical_first + p.first}, {"count", p.count}, {"shape", spec.stored_shape()}};
        at += p.count;
      }
      const std::string name = fmt::format("{}-{}{:05d}-of-{:05d}.safetensors", kGroups[g], part.empty() ? "" : part + "-", k + 1,
                                           file_ranges.size());
      const std::string path = tmp + "/" + name;
      write_safetensors(path, entries, {{"format", "pt"}, {"marrow", kGroups[g]}});
      sync_to_disk(path);
      files.push_back({{"file", name}, {"group", kGroups[g]}, {"bytes", fs::file_size(path)}});
      if (!slices.empty()) files.back()["slices"] = slices;
      hashes.push_back(std::async(std::launch::async, [path] { return sha256_file(path); }));
      progress.add(host.view().bytes());
      if (pause_ms && files.size() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(std::atol(pause_ms)));
    }
  }
  for (size_t i = 0; i < hashes.size(); ++i) files[i]["sha256"] = hashes[i].get();
  progress.finish();
  return files;
}

void finish_checkpoint(const std::string& dir, Json files, Json meta, const Json& model_config, const std::string& tokenizer_json) {
  const std::string tmp = dir + ".tmp";
  auto add_file = [&](const std::string& name, const std::string& group) {
    const std::string path = tmp + "/" + name;
    sync_to_disk(path);
    files.push_back({{"file", name}, {"group", group}, {"bytes", fs::file_size(path)}, {"sha256", sha256_file(path)}});
  };
  write_json_file(tmp + "/config.json", model_config);
  add_file("config.json", "config");
  if (!tokenizer_json.empty()) {
    std::error_code ec;
    fs::copy_file(tokenizer_json, tmp + "/tokenizer.json", fs::copy_options::overwrite_existing, ec);
    MARROW_CHECK(!ec, "cannot copy {} into the checkpoint: {}", tokenizer_json, ec.message());
    add_file("tokenizer.json", "tokenizer");
  }
  meta["format"] = kFormat;
  meta["format_version"] = kFormatVersion;
  meta["marrow_version"] = MARROW_VERSION;
  meta["created"] = now_utc();
  meta["files"] = files;
  write_json_file(tmp + "/" + kMeta, meta);
  sync_to_disk(tmp + "/" + kMeta);
  sync_to_disk(tmp);
  // Replacing a checkpoint of the same name (a re-import): the old one is moved aside first, so a
  // crash in between leaves either a complete checkpoint or leftovers that are never read.
  if (fs::exists(dir)) {
    rename_path(dir, dir + ".old.tmp");
    rename_path(tmp, dir);
    remove_tree(dir + ".old.tmp");
  } else {
    rename_path(tmp, dir);
  }
  sync_to_disk(fs::absolute(dir).parent_path().string());
}

void start_checkpoint(const std::string& dir) {
  const std::string tmp = dir + ".tmp";
  remove_tree(tmp);
  std::error_code ec;
  fs::create_directories(tmp, ec);
  MARROW_CHECK(!ec, "cannot create checkpoint directory {}: {}", tmp, ec.message());
}

void write_checkpoint(const std::string& dir, const std::vector<TensorSpec>& specs, const CheckpointArenas& arenas, Json meta,
                      const Json& model_config, const std::string& tokenizer_json, size_t shard_bytes) {
  start_checkpoint(dir);
  Json files = write_checkpoint_part(dir + ".tmp", specs, whole_tensors(specs), arenas, "", shard_bytes);
  finish_checkpoint(dir, std::move(files), std::move(meta), model_config, tokenizer_json);
}

std::optional<std::string> latest_checkpoint(const std::string& run_dir) {
  auto all = complete_checkpoints(run_dir);
  if (all.empty()) return std::nullopt;
  return all.back().second;
}

std::string enclosing_run_data(const std::string& path) {
  std::error_code ec;
  fs::path at = fs::weakly_canonical(fs::absolute(path), ec);
  MARROW_CHECK(!ec, "cannot resolve {}: {}", path, ec.message());
  for (;; at = at.parent_path()) {
    if (fs::exists(at / kMeta) || fs::exists(at / "metrics.jsonl") || fs::exists(at / ".lock") || latest_checkpoint(at.string()))
      return at.string();
    if (at == at.root_path()) return "";
  }
}

Checkpoint open_checkpoint(const std::string& path) {
  MARROW_CHECK(fs::exists(path), "checkpoint {} does not exist", path);
  Checkpoint c;
  c.dir = path;
  if (!fs::exists(fs::path(path) / kMeta)) {
    auto latest = latest_checkpoint(path);
    MARROW_CHECK(latest.has_value(),
                 "{} is not a checkpoint: it has no {} (a save that did not finish leaves none) and no step-XXXXXXXX checkpoint inside",
                 path, kMeta);
    c.dir = *latest;
  }
  const std::string meta_path = c.dir + "/" + kMeta;
  c.meta = read_json_file(meta_path);
  JsonFields f(c.meta, meta_path);
  MARROW_CHECK(f.string("format") == kFormat, "{}: format is '{}' but a Marrow checkpoint has '{}'", meta_path, f.string("format"),
               kFormat);
  MARROW_CHECK(f.integer("format_version") <= kFormatVersion,
               "{}: checkpoint format version {} is newer than this Marrow reads ({}); update Marrow", meta_path,
               f.integer("format_version"), kFormatVersion);
  c.step = f.integer("step");
  const Json& files = f.raw("files");
  MARROW_CHECK(files.is_array(), "{}: key 'files' must be a list", meta_path);
  for (const Json& file : files) {
    JsonFields ff(file, meta_path + ": files[]");
    const std::string name = ff.string("file"), full = c.dir + "/" + name;
    MARROW_CHECK(name.find('/') == std::string::npos, "{}: file name '{}' must not contain '/'", meta_path, name);
    MARROW_CHECK(fs::exists(full), "checkpoint {} is incomplete: {} is missing", c.dir, full);
    const auto size = fs::file_size(full);
    MARROW_CHECK(int64_t(size) == ff.integer("bytes"), "{} is truncated or was changed: it has {} bytes but {} records {}", full, size,
                 meta_path, ff.integer("bytes"));
    c.has_optimizer_state = c.has_optimizer_state || ff.string("group") == "exp_avg";
  }
  return c;
}

void verify_checkpoint(const Checkpoint& c, bool show_progress) {
  std::vector<std::pair<std::string, std::future<std::string>>> hashes;
  double bytes = 0;
  for (const Json& file : c.meta["files"]) bytes += file.value("bytes", 0.0);
  Progress progress("checkpoint: verifying the sha256 of " + c.dir, uint64_t(bytes), show_progress);
  for (const Json& file : c.meta["files"]) {
    const std::string path = c.dir + "/" + file["file"].get<std::string>();
    hashes.push_back({path, std::async(std::launch::async, [path] { return sha256_file(path); })});
  }
  size_t i = 0;
  for (auto& [path, hash] : hashes) {
    const Json& file = c.meta["files"][i++];
    const std::string want = file.value("sha256", "");
    const std::string got = hash.get();
    MARROW_CHECK(got == want, "{} is corrupt: its sha256 is {} but {}/{} records {}", path, got, c.dir, kMeta, want);
    progress.add(uint64_t(file.value("bytes", 0.0)));
  }
  progress.finish();
}

namespace {

// Where a group's elements of one tensor are stored: [first, first + count) of the flat tensor.
struct StoredSlice {
  const SafetensorsFile* file;
  int64_t first, count;
  bool whole;  // stored with the tensor's shape, not as a recorded slice
};

// Every stored slice of a group, by tensor name, sorted by first element.
std::map<std::string, std::vector<StoredSlice>> stored_slices(const Checkpoint& c, const std::string& group,
                                                             std::vector<std::unique_ptr<SafetensorsFile>>& files) {
  std::map<std::string, std::vector<StoredSlice>> where;
  for (const Json& file : c.meta["files"]) {
    if (file.value("group", "") != group) continue;
    files.push_back(std::make_unique<SafetensorsFile>(c.dir + "/" + file["file"].get<std::string>()));
    const Json slices = file.value("slices", Json::object());
    for (const std::string& name : files.back()->names()) {
      const Tensor t = files.back()->get(name);
      MARROW_CHECK(t.dtype == DType::f32 || (t.dtype == DType::bf16 && group != "weights"),
                   "{}: tensor '{}' is {} but checkpoints hold f32 (weights) or f32 and bf16 (moments)", files.back()->path(), name,
                   dtype_name(t.dtype));
      const Json slice = slices.value(name, Json::object());
      const int64_t first = slice.value("first", int64_t(0));
      MARROW_CHECK(!slices.contains(name) || slice.value("count", int64_t(-1)) == t.numel(),
                   "{}: slice '{}' holds {} elements but {}/meta.json records {}", files.back()->path(), name, t.numel(), c.dir, slice.dump());
      where[name].push_back({files.back().get(), first, t.numel(), !slices.contains(name)});
    }
  }
  for (auto& [name, list] : where)
    std::sort(list.begin(), list.end(), [](const StoredSlice& a, const StoredSlice& b) { return a.first < b.first; });
  return where;
}

// A whole stored tensor must have the model's shape; a slice must lie inside it.
void check_stored(const StoredSlice& s, const TensorSpec& spec) {
  const Tensor t = s.file->get(spec.name);
  const std::vector<int64_t> shape(t.shape.begin(), t.shape.begin() + t.ndim);
  MARROW_CHECK(!s.whole || shape == spec.stored_shape(),
               "{}: tensor '{}' has shape {} but the model's is {}: the checkpoint was written for another model", s.file->path(), spec.name,
               t.shape_string(), shape_string(spec.stored_shape()));
  MARROW_CHECK(s.first >= 0 && s.first + s.count <= spec.stored_numel(),
               "{}: tensor '{}' holds elements [{}, {}) but the model's has {}: the checkpoint was written for another model",
               s.file->path(), spec.name, s.first, s.first + s.count, spec.stored_numel());
}

}  // namespace

void load_checkpoint_pieces(const Checkpoint& c, const std::string& group, const std::vector<TensorSpec>& specs,
                            const std::vector<TensorPiece>& pieces, const Arena& arena, size_t model_tensors, bool show_progress) {
  if (model_tensors == 0) model_tensors = specs.size();
  uint64_t total = 0;
  for (const TensorPiece& p : pieces) total += uint64_t(p.count) * dtype_size(arena.all().dtype);
  Progress progress(fmt::format("checkpoint: reading {} of {}", group, c.dir), total, show_progress);
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  const auto where = stored_slices(c, group, files);
  MARROW_CHECK(!files.empty(), "checkpoint {} holds no {} tensors", c.dir, group);
  for (const TensorPiece& p : pieces) {
    const TensorSpec& spec = specs.at(p.spec);
    auto it = where.find(spec.name);
    MARROW_CHECK(it != where.end(), "checkpoint {} has no tensor '{}' in its {} files: it was written for another model", c.dir,
                 spec.name, group);
    const int64_t begin = spec.canonical_first + p.first;  // the piece in the canonical tensor
    int64_t at = begin;                                     // the next element of the piece to fill
    for (const StoredSlice& s : it->second) {
      check_stored(s, spec);
      const int64_t first = std::max(at, s.first), end = std::min(begin + p.count, s.first + s.count);
      if (first != at || first >= end) continue;
      const Tensor src = s.file->get(spec.name).reshape({s.count}).rows(first - s.first, end - s.first);
      copy_converting(arena.slice(p.offset + first - begin, {end - first}), src);
      at = end;
    }
    MARROW_CHECK(at == begin + p.count, "checkpoint {} lacks elements [{}, {}) of tensor '{}' in its {} files: a part is missing",
                 c.dir, at, begin + p.count, spec.name, group);
    progress.add(uint64_t(p.count) * dtype_size(arena.all().dtype));
  }
  progress.finish();
  MARROW_CHECK(where.size() == model_tensors, "checkpoint {} holds {} {} tensors but the model has {}: it was written for another model",
               c.dir, where.size(), group, model_tensors);
}

void load_checkpoint_tensors(const Checkpoint& c, const std::string& group, const std::vector<TensorSpec>& specs, const Arena& arena,
                             size_t model_tensors, bool show_progress) {
  load_checkpoint_pieces(c, group, specs, whole_tensors(specs), arena, model_tensors, show_progress);
}

std::string model_config_difference(const Json& saved, const Json& current) {
  // Keys that describe files, defaults for new runs or generation, not the model's arithmetic.
  static const std::set<std::string> ignored = {"architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
                                                "use_cache", "initializer_range", "router_aux_loss_coef", "output_router_logits",
                                                "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"};
  std::set<std::string> keys;
  for (auto& [k, v] : saved.items()) keys.insert(k);
  for (auto& [k, v] : current.items()) keys.insert(k);
  for (const std::string& k : keys) {
    if (ignored.count(k)) continue;
    const Json a = saved.contains(k) ? saved[k] : Json(), b = current.contains(k) ? current[k] : Json();
    if (a != b) return fmt::format("{} is {} there but {} here", k, a.is_null() ? "absent" : a.dump(), b.is_null() ? "absent" : b.dump());
  }
  return "";
}

ModelSource find_model(const std::string& path) {
  MARROW_CHECK(fs::exists(path), "{} does not exist", path);
  ModelSource m;
  if (fs::exists(fs::path(path) / kMeta) || latest_checkpoint(path)) {
    const Checkpoint c = open_checkpoint(path);
    m.dir = c.dir;
    m.is_checkpoint = true;
    m.config_path = c.config_path();
    m.config = read_json_file(m.config_path);
    m.tokenizer = c.tokenizer_path();
    return m;
  }
  MARROW_CHECK(is_hf_model_dir(path),
               "{} is neither a Marrow checkpoint (meta.json), a run directory holding checkpoints, nor a Hugging Face model "
               "directory (config.json with model.safetensors or model.safetensors.index.json)",
               path);
  m.dir = path;
  m.config_path = path + "/config.json";
  m.config = read_json_file(m.config_path);
  if (fs::exists(path + "/tokenizer.json")) m.tokenizer = path + "/tokenizer.json";
  return m;
}

void load_model_weights(const ModelSource& source, const std::vector<TensorSpec>& specs, const Arena& params, bool show_progress) {
  if (!source.is_checkpoint) return read_hf_weights(source.dir, specs, params, show_progress);
  const Checkpoint c = open_checkpoint(source.dir);
  verify_checkpoint(c, show_progress);
  load_checkpoint_tensors(c, "weights", specs, params, 0, show_progress);
}

TrainCheckpoints::TrainCheckpoints(const RunConfig& rc, const Json& model_config, const std::vector<TensorSpec>& specs,
                                   CheckpointArenas arenas, CheckpointSharing sharing)
    : rc_(rc),
      model_config_(model_config),
      specs_(specs),
      arenas_(arenas),
      sharing_(std::move(sharing)),
      pieces_(sharing_.pieces.empty() ? whole_tensors(specs) : sharing_.pieces) {}

int64_t TrainCheckpoints::resume() {
  std::string from;
  const std::optional<std::string> latest = latest_checkpoint(rc_.out_dir);
  continues_output_dir_ = latest.has_value();
  if (latest) from = *latest;
  else if (!rc_.checkpoint_resume.empty()) from = rc_.checkpoint_resume;
  else return 0;
  const Checkpoint c = open_checkpoint(from);
  const std::string diff = model_config_difference(c.meta.value("model_config", Json::object()), model_config_);
  MARROW_CHECK(diff.empty(), "cannot resume from {}: {}/{} was written for another model than {} ({}); train this model in another output.dir",
               c.dir, c.dir, kMeta, rc_.model_config, diff);
  config_changes_ = check_config_changes(c.meta, rc_, read_manifest(rc_.data_path));
  const bool show = !rc_.quiet && sharing_.world.rank() == 0;
  verify_checkpoint(c, show);
  load_checkpoint_pieces(c, "weights", specs_, pieces_, *arenas_.weights, sharing_.model_tensors, show);
  if (c.has_optimizer_state) {
    load_checkpoint_pieces(c, "exp_avg", specs_, pieces_, *arenas_.exp_avg, sharing_.model_tensors, show);
    load_checkpoint_pieces(c, "exp_avg_sq", specs_, pieces_, *arenas_.exp_avg_sq, sharing_.model_tensors, show);
    // Checkpoints from before the count was saved applied one update per step.
    const Json optimizer = c.meta.value("optimizer", Json::object());
    const std::string kind = optimizer.value("name", std::string("adamw"));
    MARROW_CHECK(kind == rc_.optimizer_kind,
                 "cannot resume from {}: its optimizer state is {}'s but optimizer.kind is \"{}\" (resume with the same kind, or from a "
                 "checkpoint saved with checkpoint.optimizer_state = false)",
                 c.dir, kind, rc_.optimizer_kind);
    resumed_updates_ = optimizer.value("updates", optimizer.value("step", c.step));
  } else {
    arenas_.exp_avg->fill_zero();
    arenas_.exp_avg_sq->fill_zero();
    resumed_updates_ = 0;
  }
  if (expert_bias_.data) {
    std::vector<float> bias = c.meta.value("expert_bias", std::vector<float>(size_t(expert_bias_.numel())));
    MARROW_CHECK(int64_t(bias.size()) == expert_bias_.numel(), "{}/{}: expert_bias holds {} values, not the model's {}", c.dir, kMeta, bias.size(),
                 expert_bias_.numel());
    copy(expert_bias_, host_tensor(bias.data(), DType::f32, {expert_bias_.numel()}));
  }
  resumed_step_ = c.step;
  resumed_samples_ = c.meta.value("samples_seen", c.step * rc_.global_batch);
  resumed_tokens_ = c.meta.value("tokens_seen", resumed_samples_ * rc_.seq_len);
  std::printf("resuming from %s at step %lld%s\n", c.dir.c_str(), (long long)c.step,
              c.has_optimizer_state ? "" : " (no optimizer state in it: AdamW moments start at zero)");
  if (!rc_.checkpoint_resume.empty() && from != rc_.checkpoint_resume)
    std::printf("note: checkpoint.resume = %s is not used: output.dir already holds this run's own checkpoint, which comes first\n",
                rc_.checkpoint_resume.c_str());
  std::fflush(stdout);
  return c.step;
}

namespace {

// Bytes free for this process at path (or the nearest directory above it that exists);
// MARROW_TEST_DISK_FREE=<bytes> stands in for the file system in tests.
uint64_t available_bytes(const std::string& path) {
  if (const char* test = std::getenv("MARROW_TEST_DISK_FREE")) return std::strtoull(test, nullptr, 10);
  fs::path at = fs::absolute(path);
  while (!fs::exists(at) && at.has_parent_path() && at != at.parent_path()) at = at.parent_path();
  std::error_code ec;
  const fs::space_info space = fs::space(at, ec);
  MARROW_CHECK(!ec, "cannot read the free space of {}: {}", at.string(), ec.message());
  return space.available;
}

}  // namespace

void TrainCheckpoints::require_disk_space() const {
  if (rc_.checkpoint_every <= 0) return;
  int64_t elements = 0;
  if (sharing_.saves)
    for (const TensorPiece& p : pieces_) elements += p.count;
  const double bytes = sharing_.world.sum(double(elements) * double(checkpoint_bytes_per_parameter(rc_)), "checkpoint size (sum)");
  if (sharing_.world.rank() != 0) return;
  const uint64_t free = available_bytes(rc_.out_dir);
  MARROW_CHECK(double(free) >= bytes,
               "output.dir {} has {:.2f} GiB free but one checkpoint of this run takes {:.2f} GiB ({}): free space, choose another "
               "output.dir, or set checkpoint.every = 0",
               rc_.out_dir, double(free) / 1073741824.0, bytes / 1073741824.0,
               checkpoint_contents(rc_));
}

bool TrainCheckpoints::due(int64_t step, bool stopping) const {
  return rc_.checkpoint_every > 0 && (step % rc_.checkpoint_every == 0 || step == rc_.steps || stopping);
}

std::string TrainCheckpoints::save(int64_t step, int64_t updates) {
  const auto start = std::chrono::steady_clock::now();
  const Comm& world = sharing_.world;
  const bool leader = world.rank() == 0;
  const std::string dir = rc_.out_dir + "/" + checkpoint_name(step);
  if (leader) prepare_directory(dir);
  world.barrier("checkpoint directory (barrier)");
  Json files = write_parts(dir);
  if (leader) {
    const std::string tokenizer = rc_.data_path + "/" + kCorpusTokenizerFile;
    Json meta = meta_json(step, updates);
    if (expert_bias_.data) {
      const Buffer bias = to_host(expert_bias_);
      meta["expert_bias"] = std::vector<float>(bias.ptr<float>(), bias.ptr<float>() + bias.view().numel());
    }
    finish_checkpoint(dir, std::move(files), std::move(meta), model_config_, fs::exists(tokenizer) ? tokenizer : "");
    delete_old_checkpoints();
    size_t bytes = 0;
    for (const auto& entry : fs::directory_iterator(dir)) bytes += entry.file_size();
    std::printf("checkpoint: saved %s (%s in %.1f s)\n", dir.c_str(), human_bytes(double(bytes)).c_str(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    std::fflush(stdout);
  }
  world.barrier("checkpoint complete (barrier)");
  return dir;
}

void TrainCheckpoints::prepare_directory(const std::string& dir) const {
  std::error_code ec;
  fs::create_directories(rc_.out_dir, ec);
  MARROW_CHECK(!ec, "cannot create {}: {}", rc_.out_dir, ec.message());
  std::vector<std::string> leftovers;
  for (const auto& entry : fs::directory_iterator(rc_.out_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.ends_with(".tmp") && name.starts_with("step-")) leftovers.push_back(entry.path().string());
  }
  for (const std::string& path : leftovers) remove_tree(path);
  start_checkpoint(dir);
}

Json TrainCheckpoints::write_parts(const std::string& dir) const {
  const Comm& world = sharing_.world;
  CheckpointArenas arenas = arenas_;
  if (!rc_.checkpoint_optimizer_state) arenas.exp_avg = arenas.exp_avg_sq = nullptr;
  const std::string part = world.size() > 1 ? fmt::format("rank{:05d}", world.rank()) : "";
  const Json files =
      sharing_.saves ? write_checkpoint_part(dir + ".tmp", specs_, pieces_, arenas, part, kCheckpointShardBytes, !rc_.quiet && world.rank() == 0)
                     : Json::array();
  const std::vector<std::string> parts = world.all_gather_text(files.dump(), "checkpoint file lists (all_gather)");
  Json all_files = Json::array();
  for (const std::string& text : parts)
    for (const Json& file : Json::parse(text)) all_files.push_back(file);
  return all_files;
}

Json TrainCheckpoints::meta_json(int64_t step, int64_t updates) const {
  const CorpusManifest manifest = read_manifest(rc_.data_path);
  return {{"step", step},
          {"samples_seen", samples_seen(step)},
          {"tokens_seen", tokens_seen(step)},
          {"seed", rc_.seed},
          // The parallel layout that wrote it; the tensors themselves do not depend on it.
          {"mesh", sharing_.mesh},
          // updates: AdamW steps applied (skipped non-finite steps are not), what bias correction counts.
          {"optimizer", {{"name", rc_.optimizer_kind}, {"step", step}, {"updates", updates}, {"state_saved", rc_.checkpoint_optimizer_state}}},
          {"model_config", model_config_},
          {"run_config", run_config_json(rc_)},
          {"config_changes", config_changes_},
          {"data",
           {{"path", rc_.data_path}, {"tokenizer_sha256", manifest.tokenizer_sha256}, {"corpus_sha256", corpus_fingerprint(manifest)},
            {"eos_id", manifest.eos_id}, {"eos_token", manifest.eos_token}}}};
}

void TrainCheckpoints::delete_old_checkpoints() const {
  auto all = complete_checkpoints(rc_.out_dir);
  const size_t keep = size_t(std::max<int64_t>(1, rc_.checkpoint_keep));
  for (size_t i = 0; i + keep < all.size(); ++i) {
    // Renamed first so that a crash midway never leaves a half-deleted checkpoint that looks complete.
    rename_path(all[i].second, all[i].second + ".tmp");
    remove_tree(all[i].second + ".tmp");
  }
}

void keep_metrics_through(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in.good()) return;
  std::string kept, line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    Json j = Json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.value("step", int64_t(0)) <= step) kept += line + "\n";
  }
  in.close();
  {
    std::ofstream out(path + ".tmp", std::ios::trunc);
    out << kept;
    out.flush();  // a full disk shows at the flush: never rename a truncated copy over the metrics
    MARROW_CHECK(out.good(), "cannot write {}.tmp (is the disk full?); {} is unchanged", path, path);
  }
  rename_path(path + ".tmp", path);
}

namespace {

volatile std::sig_atomic_t g_stop_signal = 0;
struct sigaction g_previous_term, g_previous_int;

extern "C" void on_stop_signal(int sig) {
  if (g_stop_signal != 0) _exit(128 + sig);
  g_stop_signal = sig;
  // A constant (a handler may only write): the loop's own line then says whether a checkpoint was saved.
  const char message[] =
      "\nmarrow: stop requested: finishing the current step, then a checkpoint unless checkpoint.every = 0 (signal again to quit at once)\n";
  ssize_t written = ::write(2, message, sizeof message - 1);
  (void)written;
}

}  // namespace

StopSignals::StopSignals() {
  g_stop_signal = 0;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, &g_previous_term);
  sigaction(SIGINT, &action, &g_previous_int);
}

StopSignals::~StopSignals() {
  sigaction(SIGTERM, &g_previous_term, nullptr);
  sigaction(SIGINT, &g_previous_int, nullptr);
}

int StopSignals::received() { return g_stop_signal; }

}  // namespace marrow
