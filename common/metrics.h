// A small metrics registry with Prometheus text exposition (format 0.0.4). Families are
// registered at start with their series so zeros are exported before anything happens; values
// are set from the owner's own counters (snapshots), so a registry never double counts.
// Thread-safe: one mutex.
#pragma once
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace sf {

enum class MetricKind { kCounter, kGauge };

// Label pairs in exposition order, e.g. {{"tier", "host"}}.
using MetricLabels = std::vector<std::pair<std::string, std::string>>;

class MetricsRegistry {
 public:
  // Names must match [a-zA-Z_:][a-zA-Z0-9_:]*; counters must end in _total. Registering a name
  // again with the same kind is a no-op (several owners may share a family).
  [[nodiscard]] Status add_family(const std::string& name, MetricKind kind, const std::string& help);
  // Creates the series when new. The family must exist; label values are escaped on output.
  [[nodiscard]] Status set(const std::string& name, const MetricLabels& labels, double value);
  Result<double> get(const std::string& name, const MetricLabels& labels) const;
  std::string render() const;  // text/plain; version=0.0.4

 private:
  struct Family {
    MetricKind kind = MetricKind::kGauge;
    std::string help;
    std::map<std::string, double> series;  // rendered label set -> value
  };
  mutable std::mutex mu_;
  std::map<std::string, Family> fam_;
};

}  // namespace sf
