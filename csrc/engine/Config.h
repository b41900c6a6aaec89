#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "engine/cuda/LocalCopies.h"

namespace smfree::engine {

// Which data channel carries CUDA tensors (SMFREE_CHANNEL). CPU tensors always go over UCX.
enum class CudaChannel {
  kAuto,        // copy engines to ranks on this host, UCX to ranks on other hosts
  kCopyEngine,  // copy engines only: CUDA ops with ranks on other hosts are refused
  kUcx,         // UCX for every CUDA op, also on this host (the cross-host path, tested locally)
};

// Every SMFREE_* setting the engine reads, parsed once. The README documents each.
struct Config {
  // SMFREE_SPIN_US, if set: how long the engine's threads poll after their last event before
  // they sleep. Unset, Spin chooses.
  std::optional<std::chrono::microseconds> spin;
  // torchrun's LOCAL_WORLD_SIZE, if set to a count: how many ranks share this host.
  std::optional<long> localRanks;
  // UCX keepalive interval, so a dead peer fails pending ops quickly; UCX_KEEPALIVE_INTERVAL wins.
  // Also how often a silent peer on another host is probed while ops wait on it.
  std::chrono::milliseconds peerCheck;
  // How long bytes toward a peer on another host may stay unacknowledged before its connection
  // fails (TCP_USER_TIMEOUT): a cut link or a host gone fails its ops, naming it, after this
  // rather than at their group timeout. UCX_TCP_USER_TIMEOUT wins; 0 keeps the system's.
  std::chrono::milliseconds linkTimeout;
  // Longest a process exit or a group's end waits for peers to take what was sent to them
  // (ops whose wait() returned, sends UCX holds), whatever the group timeout.
  std::chrono::milliseconds exitTimeout;
  // Most CUDA IPC mappings of peers' buffers kept open at once.
  size_t ipcCacheSize;
  // Most CUDA ops a process keeps in flight before a new one waits (SMFREE_MAX_CUDA_OPS).
  size_t maxCudaOps;
  CudaChannel cudaChannel;
  // How copies within one GPU run (SMFREE_LOCAL_COPIES): copy-engine hops through a peer
  // GPU's memory (the default) or pinned host memory, or the driver's (SMs on CUDA 13.0 drivers).
  cuda::LocalCopies localCopies;
  // Largest send that may be staged in the receiver's memory (SMFREE_STAGING_BYTES): the
  // size of each slot of a staging ring; 0 turns staging off (the default unless copies within
  // one GPU are the driver's).
  uint64_t stagingBytes;
  // Largest CUDA send on the copy engines that goes eagerly, into a slot of its receiver's
  // memory at its post (SMFREE_EAGER_BYTES); 0 turns eager sends off.
  uint64_t eagerBytes;
  // Whether a collective's pieces are copied at the later rank's post (SMFREE_COLLECTIVE_LANES),
  // so that its wait() returns at once; off, they go by rendezvous.
  bool collectiveLanes;
  // GPU memory this process gives its senders' staging and eager rings, all devices together
  // (SMFREE_RING_MEMORY_BYTES); a ring beyond it is not made and its sends go by rendezvous.
  uint64_t ringMemoryBytes;
  // Size of the pieces in which CUDA tensors cross pinned host memory toward peers UCX reaches
  // over TCP only (SMFREE_RELAY_PIECE_BYTES); 0 moves each tensor in one piece.
  uint64_t relayPieceBytes;

  static Config fromEnv();
};

// The integer setting `name` holds, `fallback` where unset or empty; throws Error naming it if
// it is not a non-negative integer.
long parseNonNegative(const char* name, long fallback);

}  // namespace smfree::engine
