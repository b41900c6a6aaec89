#pragma once

#include <poll.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "engine/Wire.h"

namespace smfree::engine {

struct Peer;

// The remote processes as OpControl and the progress loop reach them: control messages out,
// their liveness and their silence. Implemented by PeerTable, over UCX; the engine's C++ tests
// give their own, which link two OpControls in one process. Progress thread only.
class PeerLinks {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  virtual ~PeerLinks() = default;

  // Dropped while the peer has failed.
  virtual void send(Peer& peer, const ControlMessage& message) = 0;
  // Probes the peer if it is on another host and nothing has come from it for a probe
  // interval (nor was it probed within one); for peers that ops wait on.
  virtual void probeIfSilent(Peer& peer, TimePoint now) = 0;
  // What an op that timed out waiting on the peer should say, where the peer is on another
  // host, has reached this process before (a peer that never did, never having connected to
  // it, cannot answer probes), and nothing has come from it (no message, no answer to probes)
  // for two probe intervals or more: how long, and why the transport did not end the
  // connection sooner.
  virtual std::optional<std::string> silence(const Peer& peer, TimePoint now) const = 0;
  // Fails the peers whose failure the transport reported since the last call (from inside its
  // progress); whether there were any.
  virtual bool applyReported() = 0;
  // Fails same-host peers whose process exited; drops what reached failed ones, outside any
  // transport callback.
  virtual void check() = 0;
  // Same-host peers' pidfds, which turn readable when their process exits.
  virtual void appendWatchFds(std::vector<pollfd>& events) const = 0;
};

}  // namespace smfree::engine
