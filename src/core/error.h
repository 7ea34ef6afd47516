// Errors: exceptions that carry context (file, tensor, field, expected vs got).
// The CLI catches titan::Error, prints one line and exits non-zero.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace titan {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Concatenates the arguments with operator<< into one message.
template <class... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

template <class... Args>
[[noreturn]] void fail(Args&&... args) {
  throw Error(str_cat(std::forward<Args>(args)...));
}

}  // namespace titan

// TITAN_CHECK(cond, "message parts", ...) throws titan::Error when cond is false.
#define TITAN_CHECK(cond, ...)               \
  do {                                       \
    if (!(cond)) ::titan::fail(__VA_ARGS__); \
  } while (0)
