#include "engine/loss_plot.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>

#include "core/errors.h"
#include "core/json.h"

namespace marrow {
namespace {

// The picture's frame, in SVG user units (pixels).
constexpr double kWidth = 800, kHeight = 500;
constexpr double kLeft = 80, kRight = 30, kTop = 50, kBottom = 70;
const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};

struct Axis {
  double low, high, step;  // covers the data; ticks at the multiples of step in [low, high]
};

// Ticks 1, 2 or 5 x 10^k apart, about five of them, from below min to above max.
Axis nice_axis(double min, double max) {
  if (!(max > min)) {
    const double pad = std::max(std::abs(min) * 0.1, 1.0);
    min -= pad;
    max += pad;
  }
  const double rough = (max - min) / 5, power = std::pow(10.0, std::floor(std::log10(rough)));
  const double fraction = rough / power;
  const double step = power * (fraction <= 1 ? 1 : fraction <= 2 ? 2 : fraction <= 5 ? 5 : 10);
  return {std::floor(min / step) * step, std::ceil(max / step) * step, step};
}

// The multiples of step from low to high, each computed from its index so that no rounding error adds up.
std::vector<double> ticks(const Axis& axis) {
  std::vector<double> out;
  const double first = std::ceil(axis.low / axis.step - 1e-9);
  for (int i = 0; (first + i) * axis.step <= axis.high + axis.step * 1e-9; ++i) out.push_back((first + i) * axis.step);
  return out;
}

// Token counts as 0, 500k, 1.5M, 2G.
std::string si_label(double value) {
  const char* suffix[] = {"", "k", "M", "G", "T"};
  int i = 0;
  for (; i < 4 && std::abs(value) >= 1000; ++i) value /= 1000;
  return fmt::format("{:g}{}", std::round(value * 1000) / 1000, suffix[i]);
}

std::string decimal_label(double value, double step) {
  const int decimals = std::max(0, int(-std::floor(std::log10(step) + 1e-9)));
  return fmt::format("{:.{}f}", value, decimals);
}

std::string xml_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// At most kMaxPointsPerLine points, each the mean of a run of consecutive ones.
std::vector<std::pair<double, double>> thin(const std::vector<std::pair<double, double>>& points) {
  if (points.size() <= kMaxPointsPerLine) return points;
  const size_t per = (points.size() + kMaxPointsPerLine - 1) / kMaxPointsPerLine;
  std::vector<std::pair<double, double>> out;
  for (size_t begin = 0; begin < points.size(); begin += per) {
    const size_t end = std::min(points.size(), begin + per);
    double x = 0, y = 0;
    for (size_t i = begin; i < end; ++i) {
      x += points[i].first;
      y += points[i].second;
    }
    out.push_back({x / double(end - begin), y / double(end - begin)});
  }
  return out;
}

struct Frame {
  Axis x, y;
  double px(double v) const { return kLeft + (v - x.low) / (x.high - x.low) * (kWidth - kLeft - kRight); }
  double py(double v) const { return kHeight - kBottom - (v - y.low) / (y.high - y.low) * (kHeight - kTop - kBottom); }
};

Frame frame_of(const std::vector<LossCurve>& runs) {
  double x_max = 0, y_min = std::numeric_limits<double>::infinity(), y_max = -y_min;
  for (const LossCurve& run : runs)
    for (const auto* points : {&run.train, &run.validation})
      for (const auto& [x, y] : *points) {
        x_max = std::max(x_max, x);
        y_min = std::min(y_min, y);
        y_max = std::max(y_max, y);
      }
  // Tokens start at 0 and the axis ends with the data; the loss axis ends on ticks.
  const Axis x = nice_axis(0, x_max);
  return {{0, x_max > 0 ? x_max : x.high, x.step}, nice_axis(y_min, y_max)};
}

std::string axes_svg(const Frame& f) {
  std::string out = "<g class=\"axes\" font-size=\"12\" fill=\"#333\">\n";
  for (const double v : ticks(f.x))
    out += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"#e5e5e5\"/>"
                       "<text class=\"tick\" x=\"{0:.1f}\" y=\"{3:.1f}\" text-anchor=\"middle\">{4}</text>\n",
                       f.px(v), kTop, kHeight - kBottom, kHeight - kBottom + 18, si_label(v));
  for (const double v : ticks(f.y))
    out += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{2:.1f}\" y2=\"{1:.1f}\" stroke=\"#e5e5e5\"/>"
                       "<text class=\"tick\" x=\"{3:.1f}\" y=\"{4:.1f}\" text-anchor=\"end\">{5}</text>\n",
                       kLeft, f.py(v), kWidth - kRight, kLeft - 8, f.py(v) + 4, decimal_label(v, f.y.step));
  out += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"none\" stroke=\"#333\"/>\n", kLeft, kTop,
                     kWidth - kLeft - kRight, kHeight - kTop - kBottom);
  out += fmt::format("<text class=\"axis-label\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" font-size=\"14\">tokens seen</text>\n",
                     (kLeft + kWidth - kRight) / 2, kHeight - 20);
  out += fmt::format("<text class=\"axis-label\" x=\"{0:.1f}\" y=\"{1:.1f}\" text-anchor=\"middle\" font-size=\"14\" "
                     "transform=\"rotate(-90 {0:.1f} {1:.1f})\">loss</text>\n",
                     22.0, (kTop + kHeight - kBottom) / 2);
  return out + "</g>\n";
}

std::string points_attribute(const Frame& f, const std::vector<std::pair<double, double>>& points) {
  std::string out;
  for (const auto& [x, y] : thin(points)) out += fmt::format("{}{:.1f},{:.1f}", out.empty() ? "" : " ", f.px(x), f.py(y));
  return out;
}

std::string curves_svg(const Frame& f, const std::vector<LossCurve>& runs) {
  std::string out = "<g class=\"curves\" fill=\"none\" stroke-width=\"1.5\">\n";
  for (size_t r = 0; r < runs.size(); ++r) {
    const char* color = kColors[r % std::size(kColors)];
    const std::string name = xml_escape(runs[r].name);
    out += fmt::format("<polyline class=\"train\" data-run=\"{}\" stroke=\"{}\" points=\"{}\"/>\n", name, color,
                       points_attribute(f, runs[r].train));
    if (runs[r].validation.empty()) continue;
    out += fmt::format("<polyline class=\"validation\" data-run=\"{}\" stroke=\"{}\" stroke-width=\"2\" stroke-dasharray=\"6 4\" points=\"{}\"/>\n",
                       name, color, points_attribute(f, runs[r].validation));
    for (const auto& [x, y] : thin(runs[r].validation))
      out += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"{}\" stroke=\"none\"/>\n", f.px(x), f.py(y), color);
  }
  return out + "</g>\n";
}

// Top right inside the plot, where loss curves (which fall) leave room.
std::string legend_svg(const std::vector<LossCurve>& runs) {
  std::vector<std::pair<std::string, std::string>> rows;  // (label, line style)
  for (size_t r = 0; r < runs.size(); ++r) {
    const std::string color = kColors[r % std::size(kColors)];
    rows.push_back({runs[r].name + " training", "stroke=\"" + color + "\" stroke-width=\"1.5\""});
    if (!runs[r].validation.empty())
      rows.push_back({runs[r].name + " validation", "stroke=\"" + color + "\" stroke-width=\"2\" stroke-dasharray=\"6 4\""});
  }
  size_t longest = 0;
  for (const auto& row : rows) longest = std::max(longest, row.first.size());
  const double width = 46 + 7.0 * double(longest), x = kWidth - kRight - width - 10, y = kTop + 10;
  std::string out = fmt::format("<g class=\"legend\" font-size=\"12\" fill=\"#333\">\n<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" "
                                "height=\"{:.1f}\" fill=\"white\" fill-opacity=\"0.85\" stroke=\"#bbb\"/>\n",
                                x, y, width, 18.0 * double(rows.size()) + 8);
  for (size_t i = 0; i < rows.size(); ++i) {
    const double row_y = y + 16 + 18.0 * double(i);
    out += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" {}/><text x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n",
                       x + 8, row_y - 4, x + 36, row_y - 4, rows[i].second, x + 42, row_y, xml_escape(rows[i].first));
  }
  return out + "</g>\n";
}

}  // namespace

LossCurve read_loss_curve(const std::string& run_dir, const std::string& name) {
  const std::string path = run_dir + "/metrics.jsonl";
  std::ifstream in(path);
  MARROW_CHECK(in.good(), "{} has no metrics.jsonl: it is not the output.dir of a marrow train run", run_dir);
  LossCurve curve{name, {}, {}};
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    const Json j = Json::parse(line, nullptr, false);
    MARROW_CHECK(!j.is_discarded() && j.is_object(), "{}:{}: not a JSON object", path, number);
    MARROW_CHECK(j.contains("tokens_seen") && j["tokens_seen"].is_number(),
                 "{}:{}: no tokens_seen (the run was written by a Marrow older than marrow plot; train it again to plot it)", path,
                 number);
    const double tokens = j["tokens_seen"].get<double>();
    if (j.contains("loss") && j["loss"].is_number() && std::isfinite(j["loss"].get<double>()))
      curve.train.push_back({tokens, j["loss"].get<double>()});
    if (j.contains("val_loss") && j["val_loss"].is_number() && std::isfinite(j["val_loss"].get<double>()))
      curve.validation.push_back({tokens, j["val_loss"].get<double>()});
  }
  MARROW_CHECK(!in.bad(), "cannot read {}", path);
  MARROW_CHECK(!curve.train.empty(), "{} holds no step with a finite loss", path);
  return curve;
}

std::string loss_plot_svg(const std::vector<LossCurve>& runs) {
  MARROW_CHECK(!runs.empty(), "internal: a loss plot needs at least one run");
  const Frame f = frame_of(runs);
  std::string svg = fmt::format("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
                                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0:.0f}\" height=\"{1:.0f}\" viewBox=\"0 0 {0:.0f} {1:.0f}\" "
                                "font-family=\"sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
                                kWidth, kHeight);
  svg += fmt::format("<text class=\"title\" x=\"{:.1f}\" y=\"30\" text-anchor=\"middle\" font-size=\"16\">Loss against tokens seen</text>\n",
                     kWidth / 2);
  return svg + axes_svg(f) + curves_svg(f, runs) + legend_svg(runs) + "</svg>\n";
}

}  // namespace marrow
