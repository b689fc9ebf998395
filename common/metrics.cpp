#include "common/metrics.h"

#include "common/file_io.h"
#include "common/text.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace sf {
namespace {

// Metric names: [a-zA-Z_:][a-zA-Z0-9_:]*.
bool valid_name(const std::string& n) {
  if (n.empty()) return false;
  for (size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

// Label names: a metric name without ':' (metric names only); '__' is reserved for Prometheus.
bool valid_label(const std::string& n) {
  return valid_name(n) && n.find(':') == std::string::npos && n.rfind("__", 0) != 0;
}

// Exposition format 0.0.4 escapes '\' and newlines, and in label values '"' too.
// Invalid UTF-8 becomes U+FFFD first: one bad byte (a GGUF's name in a label) would make a
// scraper refuse the whole file.
std::string escape(const std::string& raw, bool quote) {
  const std::string text = utf8_repaired(raw);
  std::string s;
  for (char c : text) {
    if (c == '\\') s += "\\\\";
    else if (c == '\n') s += "\\n";
    else if (quote && c == '"') s += "\\\"";
    else s += c;
  }
  return s;
}

std::string render_labels(const MetricLabels& labels) {
  if (labels.empty()) return "";
  std::string s = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i) s += ",";
    s += labels[i].first + "=\"" + escape(labels[i].second, true) + "\"";
  }
  return s + "}";
}

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  // Integral values (byte and block counts) print exactly, without an exponent.
  if (v == std::floor(v) && std::fabs(v) < 9.007199254740992e15)
    std::snprintf(buf, sizeof buf, "%.0f", v);
  else  // the shortest form that reads back as v (0.1, not 0.10000000000000001)
    for (int prec = 15; prec <= 17; ++prec) {
      std::snprintf(buf, sizeof buf, "%.*g", prec, v);
      if (std::strtod(buf, nullptr) == v) break;
    }
  return buf;
}

}  // namespace

Status MetricsRegistry::add_family(const std::string& name, MetricKind kind,
                                   const std::string& help) {
  if (!valid_name(name)) return SF_ERR(kInvalidArgument, "metrics: bad metric name '" + name + "'");
  if (kind == MetricKind::kHistogram)
    return SF_ERR(kInvalidArgument, "metrics: '" + name + "': histograms need add_histogram");
  if (kind == MetricKind::kCounter &&
      (name.size() < 6 || name.compare(name.size() - 6, 6, "_total") != 0))
    return SF_ERR(kInvalidArgument, "metrics: counter '" + name + "' must end in _total");
  std::lock_guard<std::mutex> g(mu_);
  auto it = fam_.find(name);
  if (it != fam_.end()) {
    if (it->second.kind != kind)
      return SF_ERR(kInvalidArgument, "metrics: '" + name + "' registered with another kind");
    return Status::ok();
  }
  Family f;
  f.kind = kind;
  f.help = help;
  fam_[name] = std::move(f);
  return Status::ok();
}

Status MetricsRegistry::set(const std::string& name, const MetricLabels& labels, double value) {
  for (const auto& [k, v] : labels)
    if (!valid_label(k)) return SF_ERR(kInvalidArgument, "metrics: bad label name '" + k + "'");
  std::lock_guard<std::mutex> g(mu_);
  auto it = fam_.find(name);
  if (it == fam_.end()) return SF_ERR(kNotFound, "metrics: no family '" + name + "'");
  if (it->second.kind == MetricKind::kHistogram)
    return SF_ERR(kInvalidArgument, "metrics: '" + name + "' is a histogram: observe, not set");
  it->second.series[render_labels(labels)] = value;
  return Status::ok();
}

Status MetricsRegistry::add_histogram(const std::string& name, const std::string& help,
                                      std::vector<double> bounds) {
  if (!valid_name(name)) return SF_ERR(kInvalidArgument, "metrics: bad metric name '" + name + "'");
  if (bounds.empty())
    return SF_ERR(kInvalidArgument, "metrics: histogram '" + name + "' needs bucket bounds");
  for (size_t i = 0; i < bounds.size(); ++i)
    if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1])))
      return SF_ERR(kInvalidArgument,
                    "metrics: histogram '" + name + "' bounds must be finite and ascending");
  std::lock_guard<std::mutex> g(mu_);
  auto it = fam_.find(name);
  if (it != fam_.end()) {
    if (it->second.kind != MetricKind::kHistogram || it->second.bounds != bounds)
      return SF_ERR(kInvalidArgument, "metrics: '" + name + "' registered with another kind");
    return Status::ok();
  }
  Family f;
  f.kind = MetricKind::kHistogram;
  f.help = help;
  f.bounds = std::move(bounds);
  fam_[name] = std::move(f);
  return Status::ok();
}

// Caller holds mu_.
Status MetricsRegistry::histogram_series(const std::string& name, const MetricLabels& labels,
                                         Histogram** h) {
  for (const auto& [k, v] : labels)
    if (!valid_label(k) || k == "le")
      return SF_ERR(kInvalidArgument, "metrics: bad histogram label name '" + k + "'");
  auto it = fam_.find(name);
  if (it == fam_.end()) return SF_ERR(kNotFound, "metrics: no family '" + name + "'");
  if (it->second.kind != MetricKind::kHistogram)
    return SF_ERR(kInvalidArgument, "metrics: '" + name + "' is not a histogram");
  Histogram& s = it->second.hist[render_labels(labels)];
  if (s.counts.empty()) s.counts.assign(it->second.bounds.size() + 1, 0);
  *h = &s;
  return Status::ok();
}

Status MetricsRegistry::observe(const std::string& name, const MetricLabels& labels,
                                double value) {
  if (std::isnan(value))
    return SF_ERR(kInvalidArgument, "metrics: NaN observed into '" + name + "'");
  std::lock_guard<std::mutex> g(mu_);
  Histogram* h = nullptr;
  SF_TRY(histogram_series(name, labels, &h));
  const auto& b = fam_.at(name).bounds;
  // The first bucket whose upper bound (inclusive, as `le` says) holds the value.
  const size_t i = size_t(std::lower_bound(b.begin(), b.end(), value) - b.begin());
  ++h->counts[i];
  h->sum += value;
  ++h->count;
  return Status::ok();
}

Status MetricsRegistry::touch(const std::string& name, const MetricLabels& labels) {
  std::lock_guard<std::mutex> g(mu_);
  Histogram* h = nullptr;
  return histogram_series(name, labels, &h);
}

Result<double> MetricsRegistry::get(const std::string& name, const MetricLabels& labels) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = fam_.find(name);
  if (it == fam_.end()) return SF_ERR(kNotFound, "metrics: no family '" + name + "'");
  if (it->second.kind == MetricKind::kHistogram)
    return SF_ERR(kInvalidArgument, "metrics: '" + name + "' is a histogram");
  auto s = it->second.series.find(render_labels(labels));
  if (s == it->second.series.end())
    return SF_ERR(kNotFound, "metrics: no series " + name + render_labels(labels));
  return s->second;
}

std::string MetricsRegistry::render() const {
  std::lock_guard<std::mutex> g(mu_);
  std::string out;
  for (const auto& [name, f] : fam_) {
    out += "# HELP " + name + " " + escape(f.help, false) + "\n";
    out += "# TYPE " + name +
           (f.kind == MetricKind::kCounter     ? " counter\n"
            : f.kind == MetricKind::kHistogram ? " histogram\n"
                                                : " gauge\n");
    for (const auto& [labels, v] : f.series) out += name + labels + " " + format_value(v) + "\n";
    for (const auto& [labels, h] : f.hist) {
      // `le` goes last inside the series' own braces.
      const std::string open = labels.empty() ? "{" : labels.substr(0, labels.size() - 1) + ",";
      uint64_t cum = 0;
      for (size_t i = 0; i < h.counts.size(); ++i) {
        cum += h.counts[i];
        const std::string le = i < f.bounds.size() ? format_value(f.bounds[i]) : "+Inf";
        out += name + "_bucket" + open + "le=\"" + le + "\"} " + format_value(double(cum)) + "\n";
      }
      out += name + "_sum" + labels + " " + format_value(h.sum) + "\n";
      out += name + "_count" + labels + " " + format_value(double(h.count)) + "\n";
    }
  }
  return out;
}

Status MetricsRegistry::write_textfile(const std::string& path) const {
  // The temporary name (PATH.tmp. and six random characters) does not end in .prom, so a collector never reads it.
  return write_file_atomic(path, render());
}

}  // namespace sf
