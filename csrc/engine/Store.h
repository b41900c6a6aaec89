#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace smfree::engine {

// The key-value store a group bootstraps through (the c10d Store, seen without torch).
class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Blocks until the key exists; throws when the store's own timeout expires.
  virtual std::vector<uint8_t> get(const std::string& key) = 0;
};

}  // namespace smfree::engine
