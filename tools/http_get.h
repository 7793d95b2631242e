// A minimal blocking HTTP/1.0 GET over loopback, to scrape /metrics in tools and tests.
#pragma once

#include <initializer_list>
#include <string>

#include "common/status.h"

namespace k3 {

absl::StatusOr<std::string> HttpGet(const std::string& host, int port, const std::string& path);
// POST with an empty body (admin endpoints such as an attention node's /admin/drain).
absl::StatusOr<std::string> HttpPost(const std::string& host, int port, const std::string& path);
// The value of a sample line "name{labels} value" or "name value" in a text exposition; the sum
// over every series of that name whose line contains `label_filter`.
double MetricValue(const std::string& exposition, const std::string& name, const std::string& label_filter = "");
// The same over the series whose line contains every one of `label_filters` (label order is the exporter's).
double MetricValue(const std::string& exposition, const std::string& name, std::initializer_list<std::string> label_filters);

}  // namespace k3
