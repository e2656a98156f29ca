// TensorBoard event files: TFRecord records, each one serialized `Event` protocol buffer
// (tensorboard/compat/proto/event.proto, summary.proto):
//   record = uint64 length | uint32 masked CRC-32C of the 8 length bytes | data | uint32 masked CRC-32C of data
// all little-endian. The few fields a run writes are encoded by hand: wall_time (1), step (2),
// file_version (3), summary (5) with values of tag (1), simple_value (2), metadata (9), tensor (8).
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace marrow {

// The first Event of every file: Event{wall_time, file_version: "brain.Event:2"}.
std::string file_version_event(double wall_time);
// Event{wall_time, step, summary: one simple_value per (tag, value)}: a point on each tag's curve.
std::string scalars_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& scalars);
// Event{wall_time, step, summary: tag -> text}: markdown that TensorBoard's Text tab shows.
std::string text_event(double wall_time, int64_t step, const std::string& tag, std::string_view markdown);

// The step of an encoded Event (protobuf's default 0 when it has none); a malformed one is an Error
// naming `where`.
int64_t event_step(std::string_view event, const std::string& where);

// Appends records to a new event file; each is flushed at once, so TensorBoard shows a running job.
// A failed write (a full disk) is an Error naming the file.
class EventFileWriter {
 public:
  explicit EventFileWriter(std::string path);
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;
  void write(std::string_view event);
  // Closes the file, checking that every byte reached it (the destructor cannot report that).
  void close();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

// The Events of an event file, in order. A record cut short at the end (a writer killed midway) ends
// the list silently; a damaged record (CRC mismatch) ends it with a warning on stderr.
struct EventRecords {
  std::vector<std::string> events;
  bool whole = true;  // false when bytes after the last good record were dropped
};
EventRecords read_event_file(const std::string& path);

// Rewrites an event file keeping only the Events of steps <= step (the file version, which has no
// step, stays): what a resume from the checkpoint at `step` does to the files of the earlier run.
void keep_events_through(const std::string& path, int64_t step);

}  // namespace marrow
