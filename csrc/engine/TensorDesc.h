#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace smfree::engine {

// What a matched send and recv must agree on. The engine never interprets dtype names;
// it compares them and prints them.
struct TensorDesc {
  uint64_t bytes = 0;
  std::string dtype;
  std::string device;  // "cpu" or "cuda"
  std::vector<int64_t> shape;

  // Shapes may differ (a flat recv of a 2-D send is fine); bytes, dtype and device type may not.
  bool compatibleWith(const TensorDesc& other) const {
    return bytes == other.bytes && dtype == other.dtype && device == other.device;
  }
  std::string describe() const;  // e.g. "float32[4, 8] (128 B)", with " on cuda" for GPU buffers
};

}  // namespace smfree::engine
