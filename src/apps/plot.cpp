// marrow plot <run-dir>... [--out plot.svg]: the runs' training and validation loss against tokens
// seen, from their metrics.jsonl, as one SVG picture (engine/loss_plot.h).
#include <filesystem>
#include <fstream>
#include <set>

#include "apps/commands.h"
#include "core/errors.h"
#include "engine/loss_plot.h"

namespace fs = std::filesystem;

namespace marrow {
namespace {

// Each run's name in the legend: its directory's name, or the path as given where two names clash.
std::vector<std::string> run_names(const std::vector<std::string>& dirs) {
  std::vector<std::string> names;
  std::multiset<std::string> seen;
  for (const std::string& dir : dirs) {
    fs::path path = fs::absolute(dir).lexically_normal();
    if (path.filename().empty()) path = path.parent_path();  // "runs/tiny-moe/"
    const std::string base = path.filename().string();
    names.push_back(base.empty() ? dir : base);
    seen.insert(names.back());
  }
  for (size_t i = 0; i < dirs.size(); ++i)
    if (seen.count(names[i]) > 1) names[i] = dirs[i];
  return names;
}

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc | std::ios::binary);
  MARROW_CHECK(out.good(), "cannot create {}", path);
  out << text;
  out.close();
  MARROW_CHECK(out.good(), "cannot write {} (is the disk full?)", path);
}

}  // namespace

int plot_command(int argc, char** argv) {
  CLI::App app{"Plot training and validation loss against tokens seen for one or more runs, as an SVG picture.", "marrow plot"};
  std::vector<std::string> dirs;
  std::string out = "plot.svg";
  app.add_option("run-dir", dirs, "run directories (a run's output.dir, holding metrics.jsonl)")->required();
  app.add_option("--out", out, "the SVG file to write")->capture_default_str();
  if (const int code = parse_command_line(app, argc, argv); code >= 0) return code;
  MARROW_CHECK(fs::path(out).extension() == ".svg",
               "--out {} must name an .svg file: plot writes an SVG picture there, and would replace any other file (a run's "
               "metrics.jsonl, say)",
               out);
  const std::vector<std::string> names = run_names(dirs);
  std::vector<LossCurve> runs;
  for (size_t i = 0; i < dirs.size(); ++i) runs.push_back(read_loss_curve(dirs[i], names[i]));
  write_text_file(out, loss_plot_svg(runs));
  size_t evaluations = 0;
  for (const LossCurve& run : runs) evaluations += run.validation.size();
  std::printf("plot: %zu run%s (%zu validation points) -> %s\n", runs.size(), runs.size() == 1 ? "" : "s", evaluations, out.c_str());
  return 0;
}

}  // namespace marrow
