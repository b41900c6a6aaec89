#pragma once

#include <string>
#include <vector>

namespace smfree::engine {

// What `python -m smfree_pg.doctor` shows of UCX: its version and the transports and devices
// a context opened with smfree's features finds here (e.g. "posix/memory", "tcp/eth0").
struct UcxReport {
  std::string version;
  std::vector<std::string> resources;
};

UcxReport ucxReport();

}  // namespace smfree::engine
