#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace smfree::engine {

// Thrown for failures outside any single op (bootstrap, transport setup, engine state).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  throw Error(concat("smfree: ", parts...));
}

}  // namespace smfree::engine
