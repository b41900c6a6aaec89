#pragma once

#include <cuda.h>

#include <cstdint>

#include "engine/cuda/IpcExport.h"

namespace smfree::engine::cuda {

// Device memory smfree allocates for itself (outside PyTorch's caching allocator), freed when
// destroyed. From cuMemAlloc, so a legacy IPC handle exports it.
class DeviceMemory {
 public:
  DeviceMemory(int device, uint64_t bytes);
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  // A legacy IPC handle of the whole allocation, for peers of this host to map.
  IpcExport exportIpc() const;
  CUdeviceptr address() const { return address_; }
  uint64_t bytes() const { return bytes_; }
  int device() const { return device_; }

 private:
  int device_;
  uint64_t bytes_;
  CUdeviceptr address_ = 0;
};

}  // namespace smfree::engine::cuda
