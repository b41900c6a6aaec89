#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "engine/Error.h"

namespace smfree::engine {

// Nothing a peer sends is trusted: every value read from a control message, a channel's data
// or a record in shared memory is bounded where its kind is parsed (docs/design.md, Peer
// values). A value out of bounds throws BadPeerValue, naming the message, the field and the
// bound; whoever called the parser fails the ops of the peer that sent it, naming the peer.
// The checks are compares: the hot path allocates nothing for them.
class BadPeerValue : public Error {
 public:
  BadPeerValue(std::string field, const std::string& message)
      : Error(message), field_(std::move(field)) {}
  // The field that was out of bounds ("flag index", "length", ...).
  const std::string& field() const { return field_; }

 private:
  std::string field_;
};

// Throws "smfree: bad <field> in a <message>: <parts>".
template <typename... Parts>
[[noreturn]] void badPeerValue(const char* message, const char* field, const Parts&... parts) {
  const char* article = std::strchr("aeiou", message[0]) != nullptr ? "an " : "a ";
  throw BadPeerValue(field,
                     concat("smfree: bad ", field, " in ", article, message, ": ", parts...));
}

// `value` must be in [0, bound).
template <typename T>
void checkBelow(const char* message, const char* field, T value, uint64_t bound) {
  static_assert(std::is_integral_v<T>);
  bool negative = false;
  if constexpr (std::is_signed_v<T>) negative = value < 0;
  if (negative || static_cast<uint64_t>(value) >= bound) {
    badPeerValue(message, field, value, " is out of bounds (0 to ", bound - 1, ")");
  }
}

// `length` bytes from `offset` must lie within `size` bytes, without overflow.
inline void checkWithin(const char* message, const char* field, uint64_t offset, uint64_t length,
                        uint64_t size) {
  if (offset > size || length > size - offset) {
    badPeerValue(message, field, length, " B at offset ", offset,
                 " run past the end of the ", size, " B they lie in");
  }
}

}  // namespace smfree::engine
