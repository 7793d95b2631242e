// Command-line spelling: accept --max-tokens as well as --max_tokens (Abseil flags use '_').
#pragma once

#include <cstring>

namespace k3 {

// Rewrites '-' to '_' in the name part of each "--flag[=value]" argument, in place.
inline void NormalizeFlagNames(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    char* a = argv[i];
    if (std::strncmp(a, "--", 2) != 0 || a[2] == '\0') continue;
    for (char* p = a + 2; *p != '\0' && *p != '='; ++p)
      if (*p == '-') *p = '_';
  }
}

}  // namespace k3
