#pragma once

#include <cstdint>
#include <string>

namespace smfree::engine {

// Identity of a group as every member knows it.
struct GroupConfig {
  std::string name;  // the c10d group name, equal on every member
  int rank = 0;
  int size = 0;
};

uint64_t groupIdOf(const std::string& name);

}  // namespace smfree::engine
