#include "eplb/core/error.h"

#include <cstring>

namespace eplb::detail {

std::string where(const char* file, int line) {
  // Keep the path from "src/" or "include/" on: enough to find the line, stable across checkouts.
  const char* shown = file;
  for (const char* marker : {"/src/", "/include/", "/tests/"}) {
    if (const char* at = std::strstr(file, marker)) {
      shown = at + 1;
      break;
    }
  }
  return concat(shown, ":", line);
}

}  // namespace eplb::detail
