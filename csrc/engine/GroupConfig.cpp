#include "engine/GroupConfig.h"

namespace smfree::engine {

uint64_t groupIdOf(const std::string& name) {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name) {
    hash = (hash ^ c) * 1099511628211ull;
  }
  return hash;
}

}  // namespace smfree::engine
