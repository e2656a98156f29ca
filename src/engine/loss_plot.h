// Loss curves of training runs as one self-contained SVG picture (`marrow plot`): training and
// validation loss against tokens seen, one colour per run (training: a solid line; validation: a
// dashed line with a dot per evaluation), axes with ticks at 1, 2 or 5 times a power of ten, axis
// labels, a title and a legend. No script, font file or style sheet: any browser or viewer shows it.
// The picture is a pure function of the curves. Its elements carry classes for tools and tests:
// polyline.train and polyline.validation (attribute data-run = the run's name), text.axis-label,
// g.legend.
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
