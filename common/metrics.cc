#include "common/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <cmath>
#include <type_traits>

#include "absl/memory/memory.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace k3::metrics {
namespace {

bool IsValidMetricName(std::string_view s) {
  if (s.empty() || absl::ascii_isdigit(s[0])) return false;
  for (char c : s) {
    if (!absl::ascii_isalnum(c) && c != '_' && c != ':') return false;
  }
  return true;
}

bool IsValidLabelName(std::string_view s) {
  if (s.empty() || absl::ascii_isdigit(s[0]) || s.substr(0, 2) == "__") return false;
  for (char c : s) {
    if (!absl::ascii_isalnum(c) && c != '_') return false;
  }
  return true;
}

// The names a family writes: its own (HELP/TYPE) and its samples'.
template <typename T>
std::vector<std::string> SeriesNames(const std::string& name) {
  if constexpr (!std::is_same_v<T, Histogram>) return {name};
  return {name, name + "_bucket", name + "_sum", name + "_count"};
}

// prometheus-cpp throws on some of these; checking first turns them into a Status that names
// the metric, and catches what it lets through (a counter without _total, unsorted bounds).
template <typename T>
absl::Status Validate(const std::string& name, const std::string& help,
                      const std::vector<std::string>& label_names,
                      const std::vector<double>& bounds) {
  if (!IsValidMetricName(name)) {
    return absl::InvalidArgumentError(absl::StrCat("invalid metric name \"", name, "\""));
  }
  if (std::is_same_v<T, Counter> && !absl::EndsWith(name, "_total")) {
    return absl::InvalidArgumentError(
        absl::StrCat("counter ", name, ": a counter's name ends in _total"));
  }
  if (help.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("metric ", name, " has no help text"));
  }
  // prometheus-cpp 1.0.1 writes HELP text unescaped: a newline would end the comment.
  if (help.find_first_of("\\\n") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric ", name, ": help text with a newline or backslash"));
  }
  std::set<std::string_view> seen;
  for (const std::string& label : label_names) {
    if (!IsValidLabelName(label)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metric ", name, ": invalid label name \"", label, "\""));
    }
    if (std::is_same_v<T, Histogram> && label == "le") {
      return absl::InvalidArgumentError(
          absl::StrCat("histogram ", name, ": label name \"le\" is reserved for buckets"));
    }
    if (!seen.insert(label).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("metric ", name, ": duplicate label name \"", label, "\""));
    }
  }
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1]))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "histogram ", name,
          ": bucket bounds must be finite and strictly increasing (+Inf is implicit)"));
    }
  }
  return absl::OkStatus();
}

template <typename T>
auto Builder() {
  if constexpr (std::is_same_v<T, Counter>) return prometheus::BuildCounter();
  if constexpr (std::is_same_v<T, Gauge>) return prometheus::BuildGauge();
  if constexpr (std::is_same_v<T, Histogram>) return prometheus::BuildHistogram();
}

}  // namespace

void Counter::Inc(double v) { c_.Increment(v); }
double Counter::Value() const { return c_.Value(); }

void Gauge::Set(double v) { g_.Set(v); }
void Gauge::Add(double v) { g_.Increment(v); }
double Gauge::Value() const { return g_.Value(); }

void Histogram::Observe(double v) { h_.Observe(v); }

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> bounds;
  bounds.reserve(count > 0 ? count : 0);
  for (int i = 0; i < count; ++i) bounds.push_back(start * std::pow(factor, i));
  return bounds;
}

template <typename T>
T& Family<T>::WithLabels(absl::Span<const std::string_view> values) {
  if (values.size() != label_names_.size()) {
    std::fprintf(stderr, "k3::metrics: %s takes %zu label values, got %zu\n", name_.c_str(),
                 label_names_.size(), values.size());
    std::abort();
  }
  std::lock_guard lock(mu_);
  auto it = children_.find(values);
  if (it != children_.end()) return *it->second;
  prometheus::Labels labels;
  for (size_t i = 0; i < values.size(); ++i) labels.emplace(label_names_[i], values[i]);
  T* child;
  if constexpr (std::is_same_v<T, Histogram>) {
    child = new T(native_.Add(labels, prometheus::Histogram::BucketBoundaries(bounds_)));
  } else {
    child = new T(native_.Add(labels));
  }
  children_.emplace(std::vector<std::string>(values.begin(), values.end()), absl::WrapUnique(child));
  return *child;
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

Registry::Registry() : registry_(std::make_unique<prometheus::Registry>()) {}
Registry::~Registry() = default;

template <typename T>
absl::StatusOr<Family<T>*> Registry::Add(std::string name, std::string help,
                                         std::vector<std::string> label_names,
                                         std::vector<double> bounds) {
  K3_RETURN_IF_ERROR(Validate<T>(name, help, label_names, bounds));
  const std::vector<std::string> series = SeriesNames<T>(name);
  const bool has_labels = !label_names.empty();

  std::lock_guard lock(mu_);
  for (const std::string& s : series) {
    if (used_names_.contains(s)) {
      return absl::AlreadyExistsError(
          absl::StrCat("metric ", name, ": series name ", s, " is already registered"));
    }
  }
  used_names_.insert(series.begin(), series.end());
  auto& native = Builder<T>().Name(name).Help(help).Register(*registry_);
  auto family = absl::WrapUnique(
      new Family<T>(native, std::move(name), std::move(label_names), std::move(bounds)));
  Family<T>* raw = family.get();
  families_.push_back(std::shared_ptr<Family<T>>(std::move(family)));
  if (!has_labels) raw->WithLabels();
  return raw;
}

absl::StatusOr<Family<Counter>*> Registry::AddCounter(std::string name, std::string help,
                                                      std::vector<std::string> label_names) {
  return Add<Counter>(std::move(name), std::move(help), std::move(label_names), {});
}

absl::StatusOr<Family<Gauge>*> Registry::AddGauge(std::string name, std::string help,
                                                  std::vector<std::string> label_names) {
  return Add<Gauge>(std::move(name), std::move(help), std::move(label_names), {});
}

absl::StatusOr<Family<Histogram>*> Registry::AddHistogram(std::string name, std::string help,
                                                          std::vector<double> bounds,
                                                          std::vector<std::string> label_names) {
  return Add<Histogram>(std::move(name), std::move(help), std::move(label_names),
                        std::move(bounds));
}

Registry::CollectorHandle Registry::AddCollector(std::function<void()> collect) {
  std::lock_guard lock(collectors_mu_);
  const uint64_t id = next_collector_id_++;
  collectors_.emplace(id, std::move(collect));
  return CollectorHandle(this, id);
}

Registry::CollectorHandle::CollectorHandle(CollectorHandle&& other) noexcept
    : registry_(std::exchange(other.registry_, nullptr)), id_(other.id_) {}

Registry::CollectorHandle& Registry::CollectorHandle::operator=(CollectorHandle&& other) noexcept {
  if (this != &other) {
    Reset();
    registry_ = std::exchange(other.registry_, nullptr);
    id_ = other.id_;
  }
  return *this;
}

Registry::CollectorHandle::~CollectorHandle() { Reset(); }

void Registry::CollectorHandle::Reset() {
  if (registry_ == nullptr) return;
  std::lock_guard lock(registry_->collectors_mu_);
  registry_->collectors_.erase(id_);
  registry_ = nullptr;
}

std::string Registry::Expose() const {
  {
    std::lock_guard lock(collectors_mu_);
    for (const auto& [id, collect] : collectors_) collect();
  }
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

}  // namespace k3::metrics
