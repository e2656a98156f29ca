// Watching a run (engine/event_file.h, engine/tensorboard.h, engine/loss_plot.h, core/progress.h):
// CRC-32C against its published check value, Event records that read back with their steps, a
// resume's cut-back of earlier event files, progress lines, and the loss picture's structure.
// tests/python/test_tensorboard.py reads real runs' files with TensorBoard's own reader.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "core/crc32c.h"
#include "core/progress.h"
#include "data_test_util.h"
#include "engine/event_file.h"
#include "engine/loss_plot.h"
#include "engine/tensorboard.h"

namespace marrow {
namespace {

using data_testing::read_file;
using data_testing::ScratchDir;
using data_testing::write_file;

TEST(Crc32c, MatchesTheCheckValues) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);  // the CRC catalogue's check value for CRC-32C
  EXPECT_EQ(crc32c(""), 0u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros), 0x8A9136AAu);  // RFC 3720 (iSCSI), B.4: 32 bytes of zeros
  // Continuing a checksum equals checksumming the whole.
  EXPECT_EQ(crc32c("6789", 4, crc32c("12345", 5)), crc32c("123456789"));
}

TEST(EventFile, RecordsReadBackWithTheirSteps) {
  ScratchDir dir;
  const std::string path = dir / "events.out.tfevents.1.test";
  {
    EventFileWriter out(path);
    out.write(file_version_event(1.5));
    for (int64_t step = 1; step <= 5; ++step) out.write(scalars_event(2.0, step, {{"train/loss", 1.0f / float(step)}}));
    out.write(text_event(3.0, 5, "run_config", "    marrow train x.toml"));
    out.close();
  }
  const EventRecords records = read_event_file(path);
  EXPECT_TRUE(records.whole);
  ASSERT_EQ(records.events.size(), 7u);
  EXPECT_EQ(event_step(records.events[0], path), 0);
  EXPECT_NE(records.events[0].find("brain.Event:2"), std::string::npos);
  for (int64_t step = 1; step <= 5; ++step) EXPECT_EQ(event_step(records.events[size_t(step)], path), step);
  EXPECT_NE(records.events[6].find("run_config"), std::string::npos);
}

TEST(EventFile, ACutShortTailIsDroppedAndADamagedRecordEndsTheFile) {
  ScratchDir dir;
  const std::string path = dir / "events";
  {
    EventFileWriter out(path);
    for (int64_t step = 1; step <= 3; ++step) out.write(scalars_event(1.0, step, {{"a", 1.0f}}));
    out.close();
  }
  const std::string whole = read_file(path);
  write_file(path, whole.substr(0, whole.size() - 5));  // a writer killed in the last record
  EventRecords records = read_event_file(path);
  EXPECT_FALSE(records.whole);
  EXPECT_EQ(records.events.size(), 2u);
  std::string damaged = whole;
  damaged[whole.size() / 2] ^= 0x40;  // a flipped bit in the second record
  write_file(path, damaged);
  records = read_event_file(path);
  EXPECT_FALSE(records.whole);
  EXPECT_EQ(records.events.size(), 1u);
}

TEST(EventFile, KeepEventsThroughCutsTheLaterSteps) {
  ScratchDir dir;
  const std::string path = dir / "events";
  {
    EventFileWriter out(path);
    out.write(file_version_event(1.0));
    for (int64_t step = 1; step <= 6; ++step) out.write(scalars_event(1.0, step, {{"train/loss", float(step)}}));
    out.close();
  }
  keep_events_through(path, 4);
  const EventRecords records = read_event_file(path);
  ASSERT_EQ(records.events.size(), 5u);  // the file version and steps 1..4
  EXPECT_EQ(event_step(records.events.back(), path), 4);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(EventFile, AMalformedEventIsNamed) {
  try {
    event_step(std::string("\x12\x7f", 2), "events.x");  // a length past the end
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("events.x holds a record that is not a TensorBoard Event"), std::string::npos) << e.what();
  }
}

TEST(Progress, LinesSayDoneRateAndTimeLeft) {
  EXPECT_EQ(progress_line("export", 1'500'000'000, 3'000'000'000, 10), "export: 1.50 GB of 3.00 GB, 150.0 MB/s, 10 s left");
  EXPECT_EQ(progress_line("x", 0, 100, 5), "x: 0 B of 100 B, 0 B/s, time left unknown");
  EXPECT_EQ(progress_done_line("import", 2'000'000, 4), "import: 2.0 MB in 4.0 s, 500.0 kB/s");
  EXPECT_EQ(human_duration(200), "3 min 20 s");
  EXPECT_EQ(human_duration(7500), "2 h 05 min");
}

LossCurve curve(const std::string& name, double scale) {
  LossCurve c{name, {}, {}};
  for (int step = 1; step <= 100; ++step) c.train.push_back({step * 1024.0, scale * (10 - std::log(double(step)))});
  for (int step = 25; step <= 100; step += 25) c.validation.push_back({step * 1024.0, scale * (10.2 - std::log(double(step)))});
  return c;
}

TEST(LossPlot, HasBothCurvesOfEachRunAxesAndALegend) {
  const std::string svg = loss_plot_svg({curve("base", 1), curve("a&b", 1.1)});
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_NE(svg.find("<polyline class=\"train\" data-run=\"base\""), std::string::npos);
  EXPECT_NE(svg.find("<polyline class=\"validation\" data-run=\"base\""), std::string::npos);
  EXPECT_NE(svg.find("<polyline class=\"train\" data-run=\"a&amp;b\""), std::string::npos);
  EXPECT_NE(svg.find(">tokens seen</text>"), std::string::npos);
  EXPECT_NE(svg.find(">loss</text>"), std::string::npos);
  EXPECT_NE(svg.find(">a&amp;b validation</text>"), std::string::npos);
  EXPECT_NE(svg.find(">100k</text>"), std::string::npos);  // x ticks 0, 50k, 100k, 150k cover 102,400 tokens
  EXPECT_EQ(svg.find("nan"), std::string::npos);
}

TEST(LossPlot, LongRunsAreThinned) {
  LossCurve c{"long", {}, {}};
  for (int step = 1; step <= 100000; ++step) c.train.push_back({double(step), 5.0 + (step % 2)});
  const std::string svg = loss_plot_svg({c});
  const size_t begin = svg.find("points=\""), end = svg.find('"', begin + 8);
  const std::string points = svg.substr(begin + 8, end - begin - 8);
  EXPECT_EQ(size_t(std::count(points.begin(), points.end(), ',')), kMaxPointsPerLine);
}

TEST(LossPlot, ARunWithoutMetricsIsNamed) {
  ScratchDir dir;
  try {
    read_loss_curve(dir.path(), "x");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no metrics.jsonl"), std::string::npos) << e.what();
  }
  write_file(dir / "metrics.jsonl", "{\"step\": 1, \"loss\": 3.0}\n");
  try {
    read_loss_curve(dir.path(), "x");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("metrics.jsonl:1: no tokens_seen"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace marrow
