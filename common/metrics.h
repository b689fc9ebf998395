// A small metrics registry with Prometheus text exposition (format 0.0.4). Families are
// registered at start with their series so zeros are exported before anything happens; counter
// and gauge values are set from the owner's own counters (snapshots), so a registry never double
// counts. Histograms are the one exception: `observe` adds a sample. Thread-safe: one mutex.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace sf {

enum class MetricKind { kCounter, kGauge, kHistogram };

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
  // A histogram with cumulative buckets at `bounds` (finite, strictly ascending; +Inf is added).
  [[nodiscard]] Status add_histogram(const std::string& name, const std::string& help,
                                     std::vector<double> bounds);
  // One sample into the series `labels` (created when new; a label may not be named `le`).
  [[nodiscard]] Status observe(const std::string& name, const MetricLabels& labels, double value);
  // Creates an empty series, so a histogram exports zeros before its first sample.
  [[nodiscard]] Status touch(const std::string& name, const MetricLabels& labels);
  std::string render() const;  // text/plain; version=0.0.4
  // The rendered text written for a node_exporter textfile collector: first to a unique
  // temporary file beside `path` (mkostemp names it `path`.tmp plus six random characters),
  // then renamed over `path`, so a scrape never reads half a file.
  // kIo when the file cannot be written.
  [[nodiscard]] Status write_textfile(const std::string& path) const;

 private:
  struct Histogram {
    std::vector<uint64_t> counts;  // per bucket (not cumulative), the last one +Inf
    double sum = 0;
    uint64_t count = 0;
  };
  struct Family {
    MetricKind kind = MetricKind::kGauge;
    std::string help;
    std::map<std::string, double> series;  // rendered label set -> value
    std::vector<double> bounds;            // histograms: finite bucket bounds
    std::map<std::string, Histogram> hist;  // histograms: rendered label set -> buckets
  };
  Status histogram_series(const std::string& name, const MetricLabels& labels, Histogram** h);
  mutable std::mutex mu_;
  std::map<std::string, Family> fam_;
};

}  // namespace sf
