#include "common/metrics.h"

#include <cmath>
#include <cstdio>

namespace sf {
namespace {

bool valid_name(const std::string& n) {
  if (n.empty()) return false;
  for (size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

std::string render_labels(const MetricLabels& labels) {
  if (labels.empty()) return "";
  std::string s = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i) s += ",";
    s += labels[i].first + "=\"";
    for (char c : labels[i].second) {
      if (c == '\\' || c == '"') s += '\\';
      if (c == '\n') {
        s += "\\n";
        continue;
      }
      s += c;
    }
    s += "\"";
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
  else
    std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

}  // namespace

Status MetricsRegistry::add_family(const std::string& name, MetricKind kind,
                                   const std::string& help) {
  if (!valid_name(name)) return SF_ERR(kInvalidArgument, "metrics: bad metric name '" + name + "'");
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
  fam_[name] = Family{kind, help, {}};
  return Status::ok();
}

Status MetricsRegistry::set(const std::string& name, const MetricLabels& labels, double value) {
  for (const auto& [k, v] : labels)
    if (!valid_name(k)) return SF_ERR(kInvalidArgument, "metrics: bad label name '" + k + "'");
  std::lock_guard<std::mutex> g(mu_);
  auto it = fam_.find(name);
  if (it == fam_.end()) return SF_ERR(kNotFound, "metrics: no family '" + name + "'");
  it->second.series[render_labels(labels)] = value;
  return Status::ok();
}

Result<double> MetricsRegistry::get(const std::string& name, const MetricLabels& labels) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = fam_.find(name);
  if (it == fam_.end()) return SF_ERR(kNotFound, "metrics: no family '" + name + "'");
  auto s = it->second.series.find(render_labels(labels));
  if (s == it->second.series.end())
    return SF_ERR(kNotFound, "metrics: no series " + name + render_labels(labels));
  return s->second;
}

std::string MetricsRegistry::render() const {
  std::lock_guard<std::mutex> g(mu_);
  std::string out;
  for (const auto& [name, f] : fam_) {
    out += "# HELP " + name + " " + f.help + "\n";
    out += "# TYPE " + name + (f.kind == MetricKind::kCounter ? " counter\n" : " gauge\n");
    for (const auto& [labels, v] : f.series) out += name + labels + " " + format_value(v) + "\n";
  }
  return out;
}

}  // namespace sf
