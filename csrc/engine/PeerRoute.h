#pragma once

namespace smfree::engine {

// How the caller's thread prepares CUDA ops with one peer: decided by the channels on the
// progress thread when the peer connects (Channel::connect), kept by the group per rank.
struct PeerRoute {
  bool relaysThroughHost = false;  // UCX: CUDA buffers cross pinned host memory
};

}  // namespace smfree::engine
