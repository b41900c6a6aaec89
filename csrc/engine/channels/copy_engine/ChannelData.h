#pragma once

#include <cstring>
#include <optional>
#include <string>
#include <type_traits>

namespace smfree::engine {

// The copy-engine channel's data in control messages (a clear-to-send's header, an eager
// announcement, a staging notice): fixed-layout structs, sent as their bytes between
// processes of one build on one host.
template <typename T>
std::string toBytes(const T& value) {
  static_assert(std::is_trivially_copyable_v<T>);
  return std::string(reinterpret_cast<const char*>(&value), sizeof(T));
}

// The struct `data` holds; none if its size is not the struct's.
template <typename T>
std::optional<T> fromBytes(const std::string& data) {
  static_assert(std::is_trivially_copyable_v<T>);
  if (data.size() != sizeof(T)) return std::nullopt;
  T value;
  std::memcpy(&value, data.data(), sizeof(T));
  return value;
}

}  // namespace smfree::engine
