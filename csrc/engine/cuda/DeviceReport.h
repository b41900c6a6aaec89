#pragma once

#include <string>
#include <utility>
#include <vector>

namespace smfree::engine::cuda {

// What `python -m smfree_pg.doctor` shows of each GPU: the capabilities the copy-engine
// path relies on.
struct DeviceReport {
  int index = 0;
  std::string name;
  std::vector<std::pair<std::string, int>> attributes;
  std::vector<int> peerAccess;  // by device index: 1 if this device can access that one
};

// Throws Error when no CUDA driver can be loaded.
std::vector<DeviceReport> deviceReports();

}  // namespace smfree::engine::cuda
