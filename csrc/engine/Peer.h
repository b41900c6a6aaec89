#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "engine/ProcessWatch.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/transports/ucx/UcxEndpoint.h"

namespace smfree::engine {

// What a process publishes about itself in each group's store. The encoding starts with a magic
// and a version and ends with a checksum; decode() bounds every field and refuses anything
// else, so a stale, corrupt or foreign value fails group connection by name before UCX sees
// a worker address.
struct PeerAddress {
  std::string processKey;  // unique per engine instance
  std::string hostKey;     // equal for processes that share a kernel and PID namespace
  std::string hostname;
  int pid = 0;
  cuda::FlagSegmentRef flagSegment;  // how same-host peers take this process's CUDA flags
  std::vector<uint8_t> workerAddress;         // the engine's: control messages, sends
  std::vector<uint8_t> receiveWorkerAddress;  // its receive lane's: where data is sent

  std::string describe() const;  // "pid 123 on host node7"
  std::vector<uint8_t> encode() const;
  static PeerAddress decode(const std::vector<uint8_t>& bytes);
  static PeerAddress local(std::vector<uint8_t> workerAddress,
                           std::vector<uint8_t> receiveWorkerAddress,
                           cuda::FlagSegmentRef flagSegment);
};

// Where a group's rank publishes its PeerAddress in the group's store.
std::string addressKey(int rank);

// A remote process, shared by every group that reaches it.
struct Peer {
  PeerAddress address;
  bool sameHost = false;
  std::unique_ptr<ProcessWatch> watch;  // same-host peers: UCX cannot notice their death
  // To its engine's worker, for control messages (what the channels keep per peer is
  // theirs); null once a failed same-host peer was closed.
  std::unique_ptr<UcxEndpoint> endpoint;
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
