// Prometheus metrics on prometheus-cpp (DESIGN §4): a thin adapter that keeps the services'
// call sites small. Families have fixed label names declared once; a child is looked up by its
// label values, positionally, and kept by reference on hot paths.
//
//   metrics::Registry registry;
//   K3_ASSIGN_OR_RETURN(auto* requests,
//                       registry.AddCounter("k3serve_requests_total", "Requests.", {"code"}));
//   metrics::Counter& ok = requests->WithLabels({"OK"});  // look up once (takes a lock) ...
//   ok.Inc();                                              // ... then update it directly
//   std::string text = registry.Expose();                  // prometheus::TextSerializer
//
// Label values must come from bounded sets (status codes, layers, registered nodes), never from
// what a caller sends: every distinct tuple is a series kept for the process's lifetime.
// Errors in a metric's definition (invalid or duplicate names, bad bucket bounds, a counter not
// named *_total) come back as absl::Status from Registry::Add*. Passing the wrong number of label
// values to WithLabels is a programming error and aborts with a message.
#pragma once

#include <algorithm>
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

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace k3::metrics {

template <typename T>
class Family;

// A value that only goes up (Prometheus reads a drop as a process restart).
class Counter {
 public:
  using NativeFamily = prometheus::Family<prometheus::Counter>;
  void Inc(double v = 1.0);  // v < 0 is ignored
  double Value() const;

 private:
  friend class Family<Counter>;
  explicit Counter(prometheus::Counter& c) : c_(c) {}
  prometheus::Counter& c_;
};

// A value that goes up and down.
class Gauge {
 public:
  using NativeFamily = prometheus::Family<prometheus::Gauge>;
  void Set(double v);
  void Add(double v);
  void Inc() { Add(1.0); }
  void Dec() { Add(-1.0); }
  double Value() const;

 private:
  friend class Family<Gauge>;
  explicit Gauge(prometheus::Gauge& g) : g_(g) {}
  prometheus::Gauge& g_;
};

// Observations counted into buckets by upper bound (`le`), plus their sum and count.
class Histogram {
 public:
  using NativeFamily = prometheus::Family<prometheus::Histogram>;
  void Observe(double v);

 private:
  friend class Family<Histogram>;
  explicit Histogram(prometheus::Histogram& h) : h_(h) {}
  prometheus::Histogram& h_;
};

// `count` bounds start, start*factor, start*factor^2, ... (for latencies, sizes).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

namespace internal {

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

}  // namespace internal

// All children of one metric name, one per tuple of label values. Owned by the Registry.
template <typename T>
class Family {
 public:
  // Returns the child for these label values (one per label name, in declaration order; none
  // for a family without labels), creating it at zero. The reference stays valid for the
  // Registry's lifetime.
  T& WithLabels(absl::Span<const std::string_view> values = {});

 private:
  friend class Registry;
  Family(typename T::NativeFamily& native, std::string name, std::vector<std::string> label_names,
         std::vector<double> bounds)
      : native_(native), name_(std::move(name)), label_names_(std::move(label_names)),
        bounds_(std::move(bounds)) {}

  typename T::NativeFamily& native_;
  const std::string name_;
  const std::vector<std::string> label_names_;
  const std::vector<double> bounds_;  // histograms only
  std::mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<T>, internal::LabelValuesLess> children_;
};

extern template class Family<Counter>;
extern template class Family<Gauge>;
extern template class Family<Histogram>;

class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // name: [a-zA-Z_:][a-zA-Z0-9_:]*, a counter's ending in _total; label names:
  // [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__", distinct, and not "le" for histograms; help:
  // non-empty. A name (or a histogram's _bucket, _sum, _count series) that clashes with an
  // existing family is AlreadyExists. A family without labels exposes its child from the start.
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

  // The text exposition format 0.0.4 (prometheus::TextSerializer).
  std::string Expose() const;

 private:
  template <typename T>
  absl::StatusOr<Family<T>*> Add(std::string name, std::string help,
                                 std::vector<std::string> label_names, std::vector<double> bounds);

  std::unique_ptr<prometheus::Registry> registry_;
  mutable std::mutex mu_;
  std::set<std::string> used_names_;  // family names and their series names
  std::vector<std::shared_ptr<void>> families_;  // Family<T>s, each with its own deleter

  // Separate from mu_ so collectors may create children or read the registry's families.
  mutable std::mutex collectors_mu_;
  uint64_t next_collector_id_ = 1;
  std::map<uint64_t, std::function<void()>> collectors_;
};

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
