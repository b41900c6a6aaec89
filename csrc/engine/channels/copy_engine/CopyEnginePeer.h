#pragma once

#include <string>

namespace smfree::engine {

struct Peer;

// What the copy-engine protocols ask of a peer, defined beside the channel
// (CopyEngineChannel.cpp): the protocols then build without the transports a Peer holds, and
// tests run them in-process with a Peer of their own.
const std::string& processKeyOf(const Peer& peer);
int pidfdOf(const Peer& peer);  // a pidfd of its process; -1: none
std::string describePeer(const Peer& peer);

}  // namespace smfree::engine
