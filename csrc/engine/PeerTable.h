#pragma once

#include <poll.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/Channels.h"
#include "engine/Failures.h"
#include "engine/Peer.h"
#include "engine/PeerLinks.h"
#include "engine/ProgressThread.h"
#include "engine/Wire.h"

namespace smfree::engine {

class UcxControl;
class UcxWorker;

// The remote processes this engine talks to, shared by every group, with their control
// endpoints and their liveness: a same-host peer's process is watched, a remote one's failure
// reported by UCX, and a remote one that ops wait on probed when it goes silent. Progress
// thread only.
class PeerTable final : public PeerLinks {
 public:
  // Called once per failed peer, with why it failed, after it is marked failed.
  using OnFailure = std::function<void(Peer&, const std::string& why)>;
  // How peers on other hosts are watched for silence.
  struct Silence {
    std::chrono::milliseconds probeInterval;  // SMFREE_PEER_CHECK_MS
    // Why a cut link shows only at the group timeout here, or empty where UCX ends its
    // connection sooner (ucxCutLinkUnnoticed).
    std::string cutLinkUnnoticed;
  };

  PeerTable(const PeerAddress& local, UcxWorker& worker, UcxControl& control, Channels& channels,
            Failures& failures, const ProgressThread& thread, Silence silence,
            OnFailure onFailure);
  ~PeerTable() override;

  struct Attached {
    Peer* peer;
    std::optional<std::string> unreachable;  // why a new peer cannot be reached: fail() it
  };
  // The peer at `address`, connected (control endpoint and channels) on first use.
  Attached attach(const PeerAddress& address);
  Peer* find(const std::string& processKey);
  // Peers on this host that have not failed.
  long liveSameHostPeers() const;
  // Marks the peer failed (the first time) and reports it.
  void fail(const std::string& processKey, const std::string& why);
  // A failure UCX reported from inside its progress or a call (an endpoint's error callback, a
  // control message it could not send): fail() runs later, from applyReported(), outside
  // UCX's frames, where failing the peer's ops (their requests cancelled, their Works
  // completed) cannot break UCX's state.
  void report(const std::string& processKey, const std::string& why);
  // A control message came from the peer.
  void heard(Peer& peer) {
    peer.lastHeard = Clock::now();
    peer.heardFrom = true;
  }

  // PeerLinks
  void send(Peer& peer, const ControlMessage& message) override;
  void probeIfSilent(Peer& peer, Clock::time_point now) override;
  std::optional<std::string> silence(const Peer& peer, Clock::time_point now) const override;
  bool applyReported() override;
  void check() override;
  void appendWatchFds(std::vector<pollfd>& events) const override;

  // Engine shutdown, the progress thread gone: waits, all endpoints at once and up to
  // `deadline`, until the peers on other hosts have taken what was sent on the control
  // endpoints. Callbacks that run meanwhile find every peer in place.
  void flush(Clock::time_point deadline);
  // Closes every control endpoint (engine shutdown).
  void clear();

 private:
  // A peer with its control endpoint, to its engine's worker (what the channels keep per
  // peer is theirs); the endpoint is null once a failed same-host peer was closed.
  struct Entry;

  std::unique_ptr<Entry> makePeer(const PeerAddress& address,
                                  std::optional<std::string>& unreachable);

  const PeerAddress& local_;
  UcxWorker& worker_;
  UcxControl& control_;
  Channels& channels_;
  Failures& failures_;
  const ProgressThread& thread_;
  const Silence silence_;
  OnFailure onFailure_;
  std::unordered_map<std::string, std::unique_ptr<Entry>> peers_;  // by process key
  // By report(), from callbacks of the engine's worker: one thread at a time progresses it.
  std::vector<std::pair<std::string, std::string>> reported_;  // process key, why
};

}  // namespace smfree::engine
