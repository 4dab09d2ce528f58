#include "client/cli/spectrum_view.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace attnserve::cli {
namespace {

using Spectra = google::protobuf::RepeatedPtrField<v1::HeadSpectrum>;

std::string Fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// Rows padded to the widest cell per column; the last column is not padded.
std::string Columns(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& r : rows) {
    width.resize(std::max(width.size(), r.size()), 0);
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  std::string out;
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) {
      out += r[i];
      if (i + 1 < r.size()) out += std::string(width[i] - r[i].size() + 2, ' ');
    }
    out += "\n";
  }
  return out;
}

std::string Table(const std::string& title, const Spectra& heads) {
  size_t k = 0;
  for (const auto& h : heads) k = std::max(k, static_cast<size_t>(h.singular_values_size()));
  std::vector<std::vector<std::string>> rows = {
      {"HEAD", "SIGMA1", "FROBENIUS", "STABLE_RANK", "EFFECTIVE_RANK", "R90", "R99", "R99.9"}};
  for (int i = 0; i < heads.size(); ++i) {
    const v1::HeadSpectrum& h = heads[i];
    rows.push_back({std::to_string(i), Fmt("%.4g", h.singular_values_size() ? h.singular_values(0) : 0.0),
                    Fmt("%.4g", h.frobenius()), Fmt("%.2f", h.stable_rank()), Fmt("%.2f", h.effective_rank()),
                    std::to_string(h.rank_90()), std::to_string(h.rank_99()), std::to_string(h.rank_999())});
  }
  return title + " (" + std::to_string(k) + " singular values per head; R90/R99/R99.9: directions keeping " +
         "that share of the energy)\n" + Columns(rows);
}

// ---- SVG ---------------------------------------------------------------------------------------

std::string Escaped(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        // Control characters are not allowed in XML 1.0 text.
        if (static_cast<unsigned char>(c) >= 0x20 || c == '\t' || c == '\n') out += c;
    }
  }
  return out;
}

std::string Px(double v) { return Fmt("%.1f", v); }

// Distinct colours on white: Tableau's ten, then ten darker or purer ones, so up to 20 heads
// each get a colour of their own; beyond that, evenly spaced hues.
std::string HeadColor(int head, int heads) {
  static const char* kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                                   "#7f7f7f", "#bcbd22", "#17becf", "#000080", "#800000", "#808000", "#008080",
                                   "#ff00ff", "#00c000", "#000000", "#4b0082", "#ff69b4", "#a0522d"};
  if (heads <= 20) return kPalette[head];
  return "hsl(" + std::to_string(head * 360 / heads) + ", 70%, " + (head % 2 ? "35%" : "50%") + ")";
}

// Values below this share of the panel's largest σ are numerical zeros: they are not drawn,
// so a rank-deficient head does not stretch the axis over sixteen decades.
constexpr double kFloorShare = 1e-10;

struct Panel {
  std::string title;
  const Spectra* heads;
  double x0, y0, w, h;  // plot area
};

// Tick step for `count` indices: 1, 2, 5, 10, 20, 50, ... giving at most ~10 ticks.
int IndexStep(int count) {
  for (int base = 1;; base *= 10) {
    for (int m : {1, 2, 5}) {
      if (count / (base * m) <= 10) return base * m;
    }
  }
}

std::string PowerOfTen(int e, double x, double y, const char* anchor) {
  // "10" with a raised exponent: plain <tspan>s with dy, which every browser renders.
  return "<text x=\"" + Px(x) + "\" y=\"" + Px(y) + "\" text-anchor=\"" + anchor +
         "\" font-size=\"12\">10<tspan dy=\"-6\" font-size=\"9\">" + std::to_string(e) + "</tspan></text>\n";
}

std::string DrawPanel(const Panel& p, bool* dropped) {
  const Spectra& heads = *p.heads;
  double hi = 0;
  int k = 1;
  for (const auto& h : heads) {
    k = std::max(k, h.singular_values_size());
    for (double s : h.singular_values()) hi = std::max(hi, s);
  }
  double lo = hi;
  for (const auto& h : heads) {
    for (double s : h.singular_values()) {
      if (s >= hi * kFloorShare) lo = std::min(lo, s);
    }
  }
  std::string out = "<g>\n<text x=\"" + Px(p.x0 + p.w / 2) + "\" y=\"" + Px(p.y0 - 12) +
                    "\" text-anchor=\"middle\" font-size=\"14\" font-weight=\"bold\">" + Escaped(p.title) + "</text>\n";
  out += "<rect x=\"" + Px(p.x0) + "\" y=\"" + Px(p.y0) + "\" width=\"" + Px(p.w) + "\" height=\"" + Px(p.h) +
         "\" fill=\"#ffffff\" stroke=\"#333333\"/>\n";
  if (hi <= 0) {
    out += "<text x=\"" + Px(p.x0 + p.w / 2) + "\" y=\"" + Px(p.y0 + p.h / 2) +
           "\" text-anchor=\"middle\" font-size=\"13\" fill=\"#666666\">all singular values are zero</text>\n</g>\n";
    return out;
  }
  const int e_lo = static_cast<int>(std::floor(std::log10(lo) + 1e-9));
  int e_hi = static_cast<int>(std::ceil(std::log10(hi) - 1e-9));
  if (e_hi <= e_lo) e_hi = e_lo + 1;
  const auto x_of = [&](double index) { return p.x0 + (k > 1 ? (index - 1) / (k - 1) : 0.5) * p.w; };
  const auto y_of = [&](double v) {
    return p.y0 + p.h - (std::log10(v) - e_lo) / static_cast<double>(e_hi - e_lo) * p.h;
  };

  // Grid and ticks: every decade labelled; with few decades also 2× and 5×.
  const int decades = e_hi - e_lo;
  for (int e = e_lo; e <= e_hi; ++e) {
    const double y = y_of(std::pow(10.0, e));
    out += "<line x1=\"" + Px(p.x0) + "\" y1=\"" + Px(y) + "\" x2=\"" + Px(p.x0 + p.w) + "\" y2=\"" + Px(y) +
           "\" stroke=\"#d0d0d0\"/>\n";
    out += PowerOfTen(e, p.x0 - 6, y + 4, "end");
    if (e == e_hi || decades > 3) continue;
    for (int m : {2, 5}) {
      const double ym = y_of(m * std::pow(10.0, e));
      out += "<line x1=\"" + Px(p.x0) + "\" y1=\"" + Px(ym) + "\" x2=\"" + Px(p.x0 + p.w) + "\" y2=\"" + Px(ym) +
             "\" stroke=\"#eeeeee\"/>\n";
      if (decades <= 2) {
        out += "<text x=\"" + Px(p.x0 - 6) + "\" y=\"" + Px(ym + 4) + "\" text-anchor=\"end\" font-size=\"10\" " +
               "fill=\"#555555\">" + std::to_string(m) + "</text>\n";
      }
    }
  }
  const int step = IndexStep(k);
  for (int i = 1; i <= k; i += (i == 1 && step > 1 ? step - 1 : step)) {
    const double x = x_of(i);
    out += "<line x1=\"" + Px(x) + "\" y1=\"" + Px(p.y0 + p.h) + "\" x2=\"" + Px(x) + "\" y2=\"" + Px(p.y0 + p.h + 5) +
           "\" stroke=\"#333333\"/>\n";
    out += "<text x=\"" + Px(x) + "\" y=\"" + Px(p.y0 + p.h + 18) + "\" text-anchor=\"middle\" font-size=\"12\">" +
           std::to_string(i) + "</text>\n";
  }
  out += "<text x=\"" + Px(p.x0 + p.w / 2) + "\" y=\"" + Px(p.y0 + p.h + 38) +
         "\" text-anchor=\"middle\" font-size=\"13\">index i of the singular value (descending)</text>\n";
  const double ly = p.y0 + p.h / 2, lx = p.x0 - 48;
  out += "<text x=\"" + Px(lx) + "\" y=\"" + Px(ly) + "\" text-anchor=\"middle\" font-size=\"13\" transform=\"rotate(-90 " +
         Px(lx) + " " + Px(ly) + ")\">singular value σ<tspan dy=\"4\" font-size=\"10\">i</tspan>" +
         "<tspan dy=\"-4\"> (log scale)</tspan></text>\n";

  // One curve per head; points below the floor end the curve there.
  for (int i = 0; i < heads.size(); ++i) {
    const v1::HeadSpectrum& h = heads[i];
    const std::string color = HeadColor(i, heads.size());
    std::string points, dots;
    for (int j = 0; j < h.singular_values_size(); ++j) {
      const double s = h.singular_values(j);
      if (!(s >= hi * kFloorShare)) {
        *dropped = true;
        break;
      }
      const std::string xy = Px(x_of(j + 1)) + "," + Px(y_of(s));
      points += (points.empty() ? "" : " ") + xy;
      if (k <= 64) {
        dots += "<circle cx=\"" + Px(x_of(j + 1)) + "\" cy=\"" + Px(y_of(s)) + "\" r=\"1.8\" fill=\"" + color + "\"/>";
      }
    }
    out += "<g><title>head " + std::to_string(i) + ": σ1=" + Fmt("%.4g", h.singular_values_size() ? h.singular_values(0) : 0) +
           ", stable rank " + Fmt("%.2f", h.stable_rank()) + ", effective rank " + Fmt("%.2f", h.effective_rank()) +
           ", r90/r99/r99.9 " + std::to_string(h.rank_90()) + "/" + std::to_string(h.rank_99()) + "/" +
           std::to_string(h.rank_999()) + "</title><polyline fill=\"none\" stroke=\"" + color +
           "\" stroke-width=\"1.5\" points=\"" + points + "\"/>" + dots + "</g>\n";
  }
  return out + "</g>\n";
}

}  // namespace

bool HasSpectrum(const v1::LayerInfo& info) { return info.ov_spectrum_size() > 0 || info.qk_spectrum_size() > 0; }

std::string SpectrumTable(const v1::LayerInfo& info) {
  return Table("OV spectrum: W_V·W_O per query head", info.ov_spectrum()) + "\n" +
         Table("QK spectrum: W_Q·W_Kᵀ per query head", info.qk_spectrum());
}

std::string SpectrumSvg(const v1::LayerInfo& info) {
  const int heads = std::max(info.ov_spectrum_size(), info.qk_spectrum_size());
  constexpr double kPlotW = 420, kPlotH = 340, kLeft = 80, kGap = 90, kTop = 78, kBottom = 62;
  constexpr double kLegendRow = 17;
  const int legend_rows = std::max(1, static_cast<int>(kPlotH / kLegendRow));
  const int legend_cols = std::max(1, (heads + legend_rows - 1) / legend_rows);
  const double legend_x = kLeft + 2 * kPlotW + kGap + 30;
  const double width = legend_x + legend_cols * 78 + 10;
  const double height = kTop + kPlotH + kBottom + 18;

  bool dropped = false;
  std::string body;
  body += DrawPanel({"OV: W_V·W_O of each head", &info.ov_spectrum(), kLeft, kTop, kPlotW, kPlotH}, &dropped);
  body += DrawPanel({"QK: W_Q·W_Kᵀ of each head", &info.qk_spectrum(), kLeft + kPlotW + kGap, kTop, kPlotW, kPlotH},
                    &dropped);
  // The legend: one swatch per head, in columns when there are many.
  body += "<g font-size=\"12\">\n<text x=\"" + Px(legend_x) + "\" y=\"" + Px(kTop - 12) +
          "\" font-weight=\"bold\">head</text>\n";
  for (int i = 0; i < heads; ++i) {
    const double x = legend_x + (i / legend_rows) * 78, y = kTop + 8 + (i % legend_rows) * kLegendRow;
    body += "<line x1=\"" + Px(x) + "\" y1=\"" + Px(y) + "\" x2=\"" + Px(x + 22) + "\" y2=\"" + Px(y) + "\" stroke=\"" +
            HeadColor(i, heads) + "\" stroke-width=\"3\"/><text x=\"" + Px(x + 28) + "\" y=\"" + Px(y + 4) + "\">" +
            std::to_string(i) + "</text>\n";
  }
  body += "</g>\n";

  const v1::LayerConfig& c = info.config();
  std::string subtitle = "d_model " + std::to_string(c.d_model()) + ", " + std::to_string(c.heads()) + " heads (" +
                         std::to_string(c.kv_heads()) + " key/value), d_head " + std::to_string(c.d_head()) +
                         " — source " + info.source();
  if (dropped) subtitle += " — values below 1e-10 of the largest (numerical zeros) not drawn";
  std::string svg = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  svg += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + Px(width) + "\" height=\"" + Px(height) +
         "\" viewBox=\"0 0 " + Px(width) + " " + Px(height) + "\" font-family=\"Helvetica, Arial, sans-serif\">\n";
  svg += "<title>Per-head singular values of layer " + Escaped(info.name()) + "</title>\n";
  svg += "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n";
  svg += "<text x=\"" + Px(kLeft) + "\" y=\"26\" font-size=\"17\" font-weight=\"bold\">Layer " + Escaped(info.name()) +
         ": singular values per head</text>\n";
  svg += "<text x=\"" + Px(kLeft) + "\" y=\"46\" font-size=\"12\" fill=\"#444444\">" + Escaped(subtitle) + "</text>\n";
  return svg + body + "</svg>\n";
}

std::string LowRankSummary(const v1::LayerInfo& info) {
  const v1::FormInfo* factored = nullptr;
  const v1::FormInfo* lowrank = nullptr;
  for (const v1::FormInfo& f : info.forms()) {
    if (f.form() == v1::FORM_FACTORED) factored = &f;
    if (f.form() == v1::FORM_LOWRANK) lowrank = &f;
  }
  if (lowrank == nullptr) {
    if (!info.has_live_calibration()) return "";
    const v1::LiveCalibration& live = info.live_calibration();
    return "lowrank: selection=" + live.rank_selection() + " calibration=live rows_seen=" +
           std::to_string(live.rows_seen()) + " rows_wanted=" + std::to_string(live.rows_wanted()) +
           (live.error().empty() ? std::string(" (not built yet)") : " error=" + live.error()) + "\n";
  }
  std::string ranks;
  int64_t total = 0;
  for (int64_t r : lowrank->ranks()) {
    ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
    total += r;
  }
  std::string line = "lowrank: selection=" + (lowrank->rank_selection().empty() ? "-" : lowrank->rank_selection()) +
                     " ranks=" + (ranks.empty() ? "-" : ranks) + " total_rank=" + std::to_string(total) +
                     " kept_energy=" + Fmt("%.6g", lowrank->kept_energy());
  if (factored != nullptr && factored->parameters() > 0 && factored->flops_per_token() > 0) {
    line += " params_vs_factored=" + Fmt("%.3f", static_cast<double>(lowrank->parameters()) / factored->parameters()) +
            " flops_vs_factored=" + Fmt("%.3f", lowrank->flops_per_token() / factored->flops_per_token());
  }
  const bool calibrated = lowrank->calibration_rows() > 0;
  if (calibrated) {
    line += " calibration_divergence=" + Fmt("%.4g", lowrank->calibration_divergence()) +
            " calibration_rows=" + std::to_string(lowrank->calibration_rows());
  }
  line += "\n";
  // Per head: its rank, the share of its energy kept and (calibrated) its output divergence.
  if (lowrank->head_kept_energy_size() == lowrank->ranks_size() && lowrank->ranks_size() > 0) {
    line += calibrated ? "HEAD RANK KEPT_ENERGY DIVERGENCE\n" : "HEAD RANK KEPT_ENERGY\n";
    for (int i = 0; i < lowrank->ranks_size(); ++i) {
      line += std::to_string(i) + " " + std::to_string(lowrank->ranks(i)) + " " + Fmt("%.6g", lowrank->head_kept_energy(i));
      if (calibrated && i < lowrank->head_divergence_size()) line += " " + Fmt("%.4g", lowrank->head_divergence(i));
      line += "\n";
    }
  }
  return line;
}

}  // namespace attnserve::cli
