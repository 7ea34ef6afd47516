#pragma once

namespace titan {
const char* version();
}  // namespace titan
