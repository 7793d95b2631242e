// Status helpers used across module boundaries (absl::Status / absl::StatusOr).
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define K3_CONCAT_INNER(a, b) a##b
#define K3_CONCAT(a, b) K3_CONCAT_INNER(a, b)

#define K3_RETURN_IF_ERROR(expr)                 \
  do {                                           \
    ::absl::Status k3_status_ = (expr);          \
    if (!k3_status_.ok()) return k3_status_;     \
  } while (0)

#define K3_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()

#define K3_ASSIGN_OR_RETURN(lhs, expr) \
  K3_ASSIGN_OR_RETURN_IMPL(K3_CONCAT(k3_statusor_, __LINE__), lhs, expr)
