// A small Prometheus metrics registry: counter, gauge and histogram families with fixed label
// names, exposed in the text format 0.0.4 (prometheus-cpp is not packaged on Debian 12).
//
//   metrics::Registry registry;
//   K3_ASSIGN_OR_RETURN(auto* requests,
//                       registry.AddCounter("k3serve_requests_total", "Requests.", {"code"}));
//   metrics::Counter& ok = requests->WithLabels({"200"});  // look up once (takes a lock) ...
//   ok.Inc();                                               // ... update lock-free on the hot path
//   std::string text = registry.Expose();
//
// Errors in a metric's definition (invalid or duplicate names, bad bucket bounds) come back as
// absl::Status from Registry::Add*. Passing the wrong number of label values to WithLabels is a
// programming error and aborts with a message.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/types/span.h"
#include "common/status.h"

namespace k3::metrics {

// A value that only goes up (Prometheus reads a drop as a process restart).
class Counter {
 public:
  // v must be >= 0 (checked in debug builds).
  void Inc(double v = 1.0);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down.
class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v) { value_.fetch_add(v, std::memory_order_relaxed); }
  void Inc() { Add(1.0); }
  void Dec() { Add(-1.0); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

template <typename T>
class Family;

// Observations counted into buckets by upper bound (`le`), plus their sum and count.
class Histogram {
 public:
  void Observe(double v);

  struct Snapshot {
    std::vector<uint64_t> cumulative;  // one per bound, then +Inf (== count)
    double sum = 0.0;
    uint64_t count = 0;
  };
  // Buckets and count are consistent with each other; sum may trail concurrent observations.
  Snapshot Read() const;

 private:
  friend class Family<Histogram>;
  // bounds: the family's, which outlive this child.
  explicit Histogram(absl::Span<const double> bounds);

  absl::Span<const double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // non-cumulative, bounds_.size() + 1
  std::atomic<double> sum_{0.0};
};

// `count` bounds start, start*factor, start*factor^2, ... (for latencies, sizes).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

namespace internal {

enum class MetricType { kCounter, kGauge, kHistogram };

// Orders label-value tuples so a lookup by string_views needs no allocation.
struct LabelValuesLess {
  using is_transparent = void;
  template <typename A, typename B>
  bool operator()(const A& a, const B& b) const {
    return std::lexicographical_compare(
        a.begin(), a.end(), b.begin(), b.end(),
        [](std::string_view x, std::string_view y) { return x < y; });
  }
};

class FamilyBase {
 public:
  FamilyBase(std::string name, std::string help, std::vector<std::string> label_names)
      : name_(std::move(name)), help_(std::move(help)), label_names_(std::move(label_names)) {}
  virtual ~FamilyBase() = default;
  FamilyBase(const FamilyBase&) = delete;
  FamilyBase& operator=(const FamilyBase&) = delete;

  virtual void AppendText(std::string& out) const = 0;

 protected:
  // `a="x",b="y"` with values escaped; computed once per child.
  std::string RenderLabels(absl::Span<const std::string_view> values) const;
  void CheckArity(size_t n) const;

  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
};

}  // namespace internal

// All children of one metric name, one per tuple of label values. Owned by the Registry.
template <typename T>
class Family final : public internal::FamilyBase {
 public:
  // Returns the child for these label values (one per label name, in declaration order; none
  // for a family without labels), creating it at zero. The reference stays valid for the
  // Registry's lifetime, so hot paths should look it up once and keep it.
  T& WithLabels(absl::Span<const std::string_view> values = {});

  void AppendText(std::string& out) const override;

 private:
  friend class Registry;
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         std::vector<double> bounds);

  struct Child {
    std::string labels;  // rendered, see RenderLabels
    std::unique_ptr<T> metric;
  };

  const std::vector<double> bounds_;  // histograms only
  mutable std::mutex mu_;
  std::map<std::vector<std::string>, Child, internal::LabelValuesLess> children_;
};

extern template class Family<Counter>;
extern template class Family<Gauge>;
extern template class Family<Histogram>;

class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // name: [a-zA-Z_:][a-zA-Z0-9_:]*; label names: [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__",
  // distinct, and not "le" for histograms; help: non-empty. A name (or a histogram's _bucket,
  // _sum, _count series) that clashes with an existing family is AlreadyExists. A family
  // without labels exposes its single child from the start.
  absl::StatusOr<Family<Counter>*> AddCounter(std::string name, std::string help,
                                              std::vector<std::string> label_names = {});
  absl::StatusOr<Family<Gauge>*> AddGauge(std::string name, std::string help,
                                          std::vector<std::string> label_names = {});
  // bounds: finite and strictly increasing; the +Inf bucket is implicit.
  absl::StatusOr<Family<Histogram>*> AddHistogram(std::string name, std::string help,
                                                  std::vector<double> bounds,
                                                  std::vector<std::string> label_names = {});

  // Unregisters its collector on destruction, waiting for a scrape that is running it.
  class CollectorHandle {
   public:
    CollectorHandle() = default;
    CollectorHandle(CollectorHandle&& other) noexcept;
    CollectorHandle& operator=(CollectorHandle&& other) noexcept;
    ~CollectorHandle();

   private:
    friend class Registry;
    CollectorHandle(Registry* registry, uint64_t id) : registry_(registry), id_(id) {}
    void Reset();
    Registry* registry_ = nullptr;
    uint64_t id_ = 0;
  };

  // `collect` runs at the start of every Expose(), for values cheaper to read on scrape than to
  // maintain (e.g. Gauge::Set of a pool's live sequences). It must not add or remove collectors.
  // The registry must outlive the handle.
  [[nodiscard]] CollectorHandle AddCollector(std::function<void()> collect);

  // The text exposition format 0.0.4, families ordered by name and children by label values.
  std::string Expose() const;

 private:
  template <typename T>
  absl::StatusOr<Family<T>*> Add(internal::MetricType type, std::string name, std::string help,
                                 std::vector<std::string> label_names, std::vector<double> bounds);

  mutable std::mutex mu_;
  std::set<std::string> used_names_;  // family names and their series names
  std::map<std::string, std::unique_ptr<internal::FamilyBase>> families_;

  // Separate from mu_ so collectors may create children or read the registry's families.
  mutable std::mutex collectors_mu_;
  uint64_t next_collector_id_ = 1;
  std::map<uint64_t, std::function<void()>> collectors_;
};

}  // namespace k3::metrics

namespace k3::metrics {

// For families registered once at startup with fixed, valid names: a failure is a programming
// error, reported and fatal.
template <typename T>
T* Must(absl::StatusOr<T*> family) {
  if (!family.ok()) {
    std::fprintf(stderr, "metrics: %s\n", std::string(family.status().message()).c_str());
    std::abort();
  }
  return *family;
}

}  // namespace k3::metrics
