#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/cuda/FlagSegment.h"

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
  std::vector<uint8_t> receiveWorkerAddress;  // its receive worker's: where data is sent

  std::string describe() const;  // "pid 123 on host node7"
  std::vector<uint8_t> encode() const;
  static PeerAddress decode(const std::vector<uint8_t>& bytes);
  static PeerAddress local(std::vector<uint8_t> workerAddress,
                           std::vector<uint8_t> receiveWorkerAddress,
                           cuda::FlagSegmentRef flagSegment);
};

// Where a group's rank publishes its PeerAddress in the group's store.
std::string addressKey(int rank);

}  // namespace smfree::engine
