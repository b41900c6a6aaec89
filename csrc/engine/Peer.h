#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "engine/PeerAddress.h"
#include "engine/PeerRoute.h"
#include "engine/ProcessWatch.h"

namespace smfree::engine {

// A remote process, shared by every group that reaches it: its identity and liveness. Its
// control endpoint is the PeerTable's, what its channels keep for it theirs.
struct Peer {
  PeerAddress address;
  bool sameHost = false;
  std::unique_ptr<ProcessWatch> watch;  // same-host peers: UCX cannot notice their death
  PeerRoute route;  // what its channels' connect() decided
  bool failed = false;
  std::string failure;
  // When a control message last came from it, and when it was last probed (PeerTable). One
  // that has come shows that it reaches this process, so it answers probes.
  std::chrono::steady_clock::time_point lastHeard;
  std::chrono::steady_clock::time_point lastProbed;
  bool heardFrom = false;

  std::string describe() const;  // "pid 123 on host node7"
};

}  // namespace smfree::engine
