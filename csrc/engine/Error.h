#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

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

// An Error's message without its "smfree: " prefix, to be quoted inside another's.
inline std::string_view reasonOf(const Error& error) {
  constexpr std::string_view kPrefix = "smfree: ";
  std::string_view text = error.what();
  if (text.substr(0, kPrefix.size()) == kPrefix) text.remove_prefix(kPrefix.size());
  return text;
}

}  // namespace smfree::engine
