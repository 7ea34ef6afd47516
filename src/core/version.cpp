#include "core/version.h"

namespace titan {
const char* version() {
  return TITAN_VERSION;
}
}  // namespace titan
