// Loss curves of training runs as one self-contained SVG picture (`marrow plot`): training (solid)
// and validation (dashed, a dot per evaluation) loss against tokens seen, a colour per run, ticks at
// 1, 2 or 5 times a power of ten, a legend; no script or font, a pure function of the curves. Its
// elements carry classes for tools and tests: polyline.train and polyline.validation (data-run =
// the run's name), text.axis-label, g.legend.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace marrow {

struct LossCurve {
  std::string name;                                           // the run's name in the legend
  std::vector<std::pair<double, double>> train, validation;  // (tokens seen, loss) in step order
};

// The curves of a run directory's metrics.jsonl: each line's tokens_seen with its loss, and its
// val_loss where evaluated; non-finite losses (skipped steps) are left out. A missing file, an empty
// one or a line without these numbers is an Error naming the file (and line).
LossCurve read_loss_curve(const std::string& run_dir, const std::string& name);

// The SVG document. Long runs are drawn with at most kMaxPointsPerLine points per line, each the
// mean of consecutive points (file size stays small; the curve's shape stays).
constexpr size_t kMaxPointsPerLine = 2000;
std::string loss_plot_svg(const std::vector<LossCurve>& runs);

}  // namespace marrow
