#include "common/metrics.h"

#include <cassert>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "absl/memory/memory.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace k3::metrics {
namespace {

using internal::MetricType;

// Go's strconv.ParseFloat reads everything written here. Integral values print without an
// exponent (1000000, not 1e+06) because counters of bytes and tokens are read by people too.
void AppendValue(std::string& out, double v) {
  if (std::isnan(v)) {
    out += "NaN";
    return;
  }
  if (std::isinf(v)) {
    out += v > 0 ? "+Inf" : "-Inf";
    return;
  }
  char buf[32];
  std::to_chars_result r;
  if (v == std::trunc(v) && std::fabs(v) < 0x1p53) {
    r = std::to_chars(buf, buf + sizeof(buf), static_cast<int64_t>(v));
  } else {
    r = std::to_chars(buf, buf + sizeof(buf), v);  // shortest form that round-trips
  }
  out.append(buf, r.ptr);
}

// Label values escape \, " and newline; HELP text escapes \ and newline.
void AppendEscaped(std::string& out, std::string_view s, bool is_label_value) {
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && is_label_value) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
}

// One sample line: name+suffix{labels,le="..."} value.
void AppendSample(std::string& out, std::string_view name, std::string_view suffix,
                  std::string_view labels, std::string_view le, double value) {
  out += name;
  out += suffix;
  if (!labels.empty() || !le.empty()) {
    out += '{';
    out += labels;
    if (!le.empty()) {
      if (!labels.empty()) out += ',';
      out += "le=\"";
      out += le;
      out += '"';
    }
    out += '}';
  }
  out += ' ';
  AppendValue(out, value);
  out += '\n';
}

void AppendSamples(std::string& out, const std::string& name, const std::string& labels,
                   const std::vector<double>&, const Counter& c) {
  AppendSample(out, name, "", labels, "", c.Value());
}

void AppendSamples(std::string& out, const std::string& name, const std::string& labels,
                   const std::vector<double>&, const Gauge& g) {
  AppendSample(out, name, "", labels, "", g.Value());
}

void AppendSamples(std::string& out, const std::string& name, const std::string& labels,
                   const std::vector<double>& bounds, const Histogram& h) {
  const Histogram::Snapshot s = h.Read();
  std::string le;
  for (size_t i = 0; i < bounds.size(); ++i) {
    le.clear();
    AppendValue(le, bounds[i]);
    AppendSample(out, name, "_bucket", labels, le, static_cast<double>(s.cumulative[i]));
  }
  AppendSample(out, name, "_bucket", labels, "+Inf", static_cast<double>(s.count));
  AppendSample(out, name, "_sum", labels, "", s.sum);
  AppendSample(out, name, "_count", labels, "", static_cast<double>(s.count));
}

template <typename T>
constexpr const char* TypeName() {
  if constexpr (std::is_same_v<T, Counter>) return "counter";
  if constexpr (std::is_same_v<T, Gauge>) return "gauge";
  if constexpr (std::is_same_v<T, Histogram>) return "histogram";
}

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
std::vector<std::string> SeriesNames(MetricType type, const std::string& name) {
  if (type != MetricType::kHistogram) return {name};
  return {name, name + "_bucket", name + "_sum", name + "_count"};
}

absl::Status Validate(MetricType type, const std::string& name, const std::string& help,
                      const std::vector<std::string>& label_names,
                      const std::vector<double>& bounds) {
  if (!IsValidMetricName(name)) {
    return absl::InvalidArgumentError(absl::StrCat("invalid metric name \"", name, "\""));
  }
  if (help.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("metric ", name, " has no help text"));
  }
  std::set<std::string_view> seen;
  for (const std::string& label : label_names) {
    if (!IsValidLabelName(label)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metric ", name, ": invalid label name \"", label, "\""));
    }
    if (type == MetricType::kHistogram && label == "le") {
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

}  // namespace

void Counter::Inc(double v) {
  assert(v >= 0 && "a counter only goes up");
  value_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Histogram(absl::Span<const double> bounds)
    : bounds_(bounds), buckets_(std::make_unique<std::atomic<uint64_t>[]>(bounds.size() + 1)) {}

void Histogram::Observe(double v) {
  // The first bucket with v <= bound; NaN fails every comparison and lands in +Inf.
  const size_t i = std::partition_point(bounds_.begin(), bounds_.end(),
                                        [v](double bound) { return !(v <= bound); }) -
                   bounds_.begin();
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  s.cumulative.resize(bounds_.size() + 1);
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    total += buckets_[i].load(std::memory_order_relaxed);
    s.cumulative[i] = total;
  }
  s.count = total;
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> bounds;
  bounds.reserve(count > 0 ? count : 0);
  for (int i = 0; i < count; ++i) bounds.push_back(start * std::pow(factor, i));
  return bounds;
}

namespace internal {

std::string FamilyBase::RenderLabels(absl::Span<const std::string_view> values) const {
  std::string out;
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out += ',';
    out += label_names_[i];
    out += "=\"";
    AppendEscaped(out, values[i], /*is_label_value=*/true);
    out += '"';
  }
  return out;
}

void FamilyBase::CheckArity(size_t n) const {
  if (n != label_names_.size()) {
    std::fprintf(stderr, "k3::metrics: %s takes %zu label values, got %zu\n", name_.c_str(),
                 label_names_.size(), n);
    std::abort();
  }
}

}  // namespace internal

template <typename T>
Family<T>::Family(std::string name, std::string help, std::vector<std::string> label_names,
                  std::vector<double> bounds)
    : FamilyBase(std::move(name), std::move(help), std::move(label_names)),
      bounds_(std::move(bounds)) {}

template <typename T>
T& Family<T>::WithLabels(absl::Span<const std::string_view> values) {
  CheckArity(values.size());
  std::lock_guard lock(mu_);
  auto it = children_.find(values);
  if (it == children_.end()) {
    std::unique_ptr<T> metric;
    if constexpr (std::is_same_v<T, Histogram>) {
      metric.reset(new Histogram(bounds_));  // private: only a family makes one
    } else {
      metric = std::make_unique<T>();
    }
    it = children_
             .emplace(std::vector<std::string>(values.begin(), values.end()),
                      Child{RenderLabels(values), std::move(metric)})
             .first;
  }
  return *it->second.metric;
}

template <typename T>
void Family<T>::AppendText(std::string& out) const {
  out += "# HELP ";
  out += name_;
  out += ' ';
  AppendEscaped(out, help_, /*is_label_value=*/false);
  out += "\n# TYPE ";
  out += name_;
  out += ' ';
  out += TypeName<T>();
  out += '\n';
  std::lock_guard lock(mu_);
  for (const auto& [values, child] : children_) {
    AppendSamples(out, name_, child.labels, bounds_, *child.metric);
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

template <typename T>
absl::StatusOr<Family<T>*> Registry::Add(MetricType type, std::string name, std::string help,
                                         std::vector<std::string> label_names,
                                         std::vector<double> bounds) {
  K3_RETURN_IF_ERROR(Validate(type, name, help, label_names, bounds));
  const std::vector<std::string> series = SeriesNames(type, name);
  const bool has_labels = !label_names.empty();

  std::lock_guard lock(mu_);
  for (const std::string& s : series) {
    if (used_names_.contains(s)) {
      return absl::AlreadyExistsError(
          absl::StrCat("metric ", name, ": series name ", s, " is already registered"));
    }
  }
  used_names_.insert(series.begin(), series.end());
  auto family = absl::WrapUnique(
      new Family<T>(name, std::move(help), std::move(label_names), std::move(bounds)));
  Family<T>* raw = family.get();
  families_.emplace(std::move(name), std::move(family));
  if (!has_labels) raw->WithLabels();
  return raw;
}

absl::StatusOr<Family<Counter>*> Registry::AddCounter(std::string name, std::string help,
                                                      std::vector<std::string> label_names) {
  return Add<Counter>(MetricType::kCounter, std::move(name), std::move(help),
                      std::move(label_names), {});
}

absl::StatusOr<Family<Gauge>*> Registry::AddGauge(std::string name, std::string help,
                                                  std::vector<std::string> label_names) {
  return Add<Gauge>(MetricType::kGauge, std::move(name), std::move(help), std::move(label_names),
                    {});
}

absl::StatusOr<Family<Histogram>*> Registry::AddHistogram(std::string name, std::string help,
                                                          std::vector<double> bounds,
                                                          std::vector<std::string> label_names) {
  return Add<Histogram>(MetricType::kHistogram, std::move(name), std::move(help),
                        std::move(label_names), std::move(bounds));
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
  std::string out;
  std::lock_guard lock(mu_);
  for (const auto& [name, family] : families_) family->AppendText(out);
  return out;
}

}  // namespace k3::metrics
