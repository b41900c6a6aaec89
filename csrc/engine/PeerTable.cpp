#include "engine/PeerTable.h"

#include <algorithm>

#include "engine/Error.h"
#include "engine/transports/ucx/UcxControl.h"
#include "engine/transports/ucx/UcxStatus.h"
#include "engine/transports/ucx/UcxWorker.h"

namespace smfree::engine {

// Every Peer this table hands out is one: send() finds the endpoint without a lookup.
struct PeerTable::Entry : Peer {
  std::unique_ptr<UcxEndpoint> endpoint;
};

PeerTable::PeerTable(const PeerAddress& local, UcxWorker& worker, UcxControl& control,
                     Channels& channels, Failures& failures, const ProgressThread& thread,
                     Silence silence, OnFailure onFailure)
    : local_(local),
      worker_(worker),
      control_(control),
      channels_(channels),
      failures_(failures),
      thread_(thread),
      silence_(std::move(silence)),
      onFailure_(std::move(onFailure)) {}

PeerTable::~PeerTable() = default;

PeerTable::Attached PeerTable::attach(const PeerAddress& address) {
  thread_.check("PeerTable::attach");
  if (Peer* existing = find(address.processKey)) {
    return {existing, std::nullopt};
  }
  std::optional<std::string> unreachable;
  std::unique_ptr<Entry> added = makePeer(address, unreachable);
  Peer* peer = added.get();
  peers_.emplace(address.processKey, std::move(added));
  return {peer, unreachable};
}

std::unique_ptr<PeerTable::Entry> PeerTable::makePeer(const PeerAddress& address,
                                                      std::optional<std::string>& unreachable) {
  auto peer = std::make_unique<Entry>();
  peer->address = address;
  peer->sameHost = address.hostKey == local_.hostKey;
  peer->lastHeard = Clock::now();  // its address came through the store just now
  if (peer->sameHost) {
    peer->watch = std::make_unique<ProcessWatch>(address.pid);
    if (!peer->watch->alive()) {
      unreachable = "the process exited";
      return peer;
    }
  }
  const std::string key = address.processKey;
  const auto onError = [this, key](const std::string& why) { report(key, why); };
  try {
    // Same host: shared memory and CMA need UCX's peer-failure handling off; the watch
    // notices a dead peer instead.
    peer->endpoint = std::make_unique<UcxEndpoint>(
        worker_.handle(), address.workerAddress, !peer->sameHost, peer->describe(),
        [onError](ucs_status_t status) { onError(ucxPeerErrorText(status)); });
    channels_.forEach(Capability::kEndpoints,
                      [&](Channel& channel) { peer->route = channel.connect(*peer, onError); });
  } catch (const Error& error) {
    // UCX cannot attach to the shared memory or socket of an engine that has closed.
    if (peer->endpoint) peer->endpoint->peerGone();  // unreachable: no flush to wait for
    peer->endpoint.reset();
    if (peer->watch && !peer->watch->alive()) {
      unreachable = "the process exited";
    } else {
      unreachable = concat("cannot reach it (did it close its groups?): ", reasonOf(error));
    }
  }
  return peer;
}

long PeerTable::liveSameHostPeers() const {
  long count = 0;
  for (const auto& [key, peer] : peers_) count += peer->sameHost && !peer->failed;
  return count;
}

Peer* PeerTable::find(const std::string& processKey) {
  auto it = peers_.find(processKey);
  return it == peers_.end() ? nullptr : it->second.get();
}

void PeerTable::fail(const std::string& processKey, const std::string& why) {
  thread_.check("PeerTable::fail");
  Peer* peer = find(processKey);
  if (!peer || peer->failed) {
    return;
  }
  peer->failed = true;
  peer->failure = concat("its peer process (", peer->describe(), ") failed: ", why);
  failures_.recordPeer(processKey, peer->failure);
  onFailure_(*peer, why);
}

void PeerTable::report(const std::string& processKey, const std::string& why) {
  reported_.emplace_back(processKey, why);
}

bool PeerTable::applyReported() {
  if (reported_.empty()) return false;
  std::vector<std::pair<std::string, std::string>> reported;
  reported.swap(reported_);
  for (const auto& [key, why] : reported) fail(key, why);
  return true;
}

void PeerTable::probeIfSilent(Peer& peer, Clock::time_point now) {
  const auto interval = silence_.probeInterval;
  if (peer.sameHost || peer.failed || now - peer.lastHeard < interval ||
      now - peer.lastProbed < interval) {
    return;
  }
  peer.lastProbed = now;
  send(peer, Probe{local_.processKey, false});
}

std::optional<std::string> PeerTable::silence(const Peer& peer, Clock::time_point now) const {
  // A peer that is there answers a probe within a probe interval of its silence.
  if (peer.sameHost || !peer.heardFrom || now - peer.lastHeard < 2 * silence_.probeInterval) {
    return std::nullopt;
  }
  const auto tenths =
      std::chrono::duration_cast<std::chrono::milliseconds>(now - peer.lastHeard).count() / 100;
  std::string said = concat("nothing came from its peer process (", peer.describe(), ") for ",
                            tenths / 10, ".", tenths % 10, " s, no message and no answer to "
                            "probes every SMFREE_PEER_CHECK_MS: the link to that host is down, "
                            "or the process is stuck");
  if (!silence_.cutLinkUnnoticed.empty()) said += concat(" (", silence_.cutLinkUnnoticed, ")");
  return said;
}

void PeerTable::check() {
  thread_.check("PeerTable::check");
  for (auto& [key, peer] : peers_) {
    if (peer->watch && !peer->failed && !peer->watch->alive()) {
      fail(key, "the process exited");
    }
    // Dropped here, outside any UCX callback; UCX keeps them until the worker goes.
    if (peer->failed && peer->sameHost && peer->endpoint) {
      peer->endpoint->peerGone();
      peer->endpoint.reset();
      channels_.forEach(Capability::kEndpoints,
                        [&](Channel& channel) { channel.disconnect(*peer); });
    }
  }
}

void PeerTable::appendWatchFds(std::vector<pollfd>& events) const {
  for (const auto& [key, peer] : peers_) {
    if (peer->watch && peer->watch->fd() >= 0 && !peer->failed) {
      events.push_back({peer->watch->fd(), POLLIN, 0});
    }
  }
}

void PeerTable::send(Peer& peer, const ControlMessage& message) {
  if (peer.failed) {
    return;
  }
  const std::string key = peer.address.processKey;
  UcxEndpoint& endpoint = *static_cast<Entry&>(peer).endpoint;
  control_.send(endpoint, encode(message), [this, key](ucs_status_t status) {
    report(key, concat("a control message failed: ", ucxStatusText(status)));
  });
}

void PeerTable::flush(Clock::time_point deadline) {
  for (auto& [key, peer] : peers_) {
    if (peer->endpoint) peer->endpoint->startFlush();
  }
  for (auto& [key, peer] : peers_) {
    if (peer->endpoint) peer->endpoint->finishFlush(deadline);
  }
}

void PeerTable::clear() { peers_.clear(); }

}  // namespace smfree::engine
