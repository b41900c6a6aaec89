#pragma once

#include <cuda.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "engine/CudaOps.h"
#include "engine/Op.h"
#include "engine/ProgressThread.h"
#include "engine/Status.h"
#include "engine/channels/copy_engine/EagerLanes.h"
#include "engine/channels/copy_engine/RingMemory.h"
#include "engine/channels/copy_engine/StagingRing.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/IpcCache.h"
#include "engine/cuda/IpcExport.h"
#include "engine/cuda/Stream.h"

namespace smfree::engine {

// A protocol's pass over its transfers: erases those `finish` says are done; true if any was.
template <typename Transfers, typename Finish>
bool eraseFinished(Transfers& transfers, Finish finish) {
  bool any = false;
  for (auto it = transfers.begin(); it != transfers.end();) {
    if (finish(*it)) {
      it = transfers.erase(it);
      any = true;
    } else {
      ++it;
    }
  }
  return any;
}

struct Peer;
struct PeerAddress;

// What the copy-engine protocols (direct, staged, eager, collective) share: this process's flag
// words, its exports and the peers' memory mapped here, the DMA and copy-out streams, the
// memory its rings may take, and the way back to the op control (an op's end, a notice).
class CopyEngineContext {
 public:
  // The channel no longer touches the op's buffer (Channel::Done).
  using Done = std::function<void(const std::shared_ptr<Op>&, const Status&)>;
  // Sends a ChannelNotice's data to a peer.
  using Notify = std::function<void(Peer&, std::string)>;

  CopyEngineContext(CudaOps& cudaOps, const ProgressThread& thread, size_t ipcCacheSize,
                    uint64_t ringMemoryBytes, Done onDone, Notify notify);

  CudaOps& cudaOps() { return cudaOps_; }
  const ProgressThread& thread() const { return thread_; }
  cuda::FlagSegment& flags() { return flags_; }
  const cuda::FlagSegment& flags() const { return flags_; }
  cuda::IpcExporter& exporter() { return exporter_; }
  const cuda::IpcExporter& exporter() const { return exporter_; }
  cuda::IpcCache& ipc() { return ipc_; }
  const cuda::IpcCache& ipc() const { return ipc_; }
  RingMemory& ringMemory() { return ringMemory_; }
  const RingMemory& ringMemory() const { return ringMemory_; }

  // Ends an op's transfer: the op no longer holds the buffer for it.
  void end(const std::shared_ptr<Op>& op, const Status& status) {
    --op->outstanding;
    onDone_(op, status);
  }
  // Tells the op control an op is done (Channel::Done) where no transfer of it ends with that.
  void done(const std::shared_ptr<Op>& op, const Status& status) { onDone_(op, status); }
  void notify(Peer& peer, std::string data) { notify_(peer, std::move(data)); }

  // The peer's flag segment (by its process key), mapped on first use (any thread).
  cuda::RemoteFlagSegment& flagsOf(const std::string& key, const PeerAddress& address,
                                   int ownerPidfd);
  CUstream dmaStream(int localDevice, int peerDevice);
  CUstream copyOutStream(int device);
  static LaneKey laneOf(const Op& op, const std::string& peerKey);

  // Receiver: queues a recv's copy out of a slot of one of its rings: waits for its `ready` and
  // the slot's `full` (both submitted before), copies, writes `done` and the slot's `emptied`.
  void enqueueCopyOut(const Op& recv, StagingRing& ring, const StagedSlot& slot, CUstream stream);
  // Receiver: empties a slot no recv takes, once it is full.
  void enqueueEmptying(StagingRing& ring, const StagedSlot& slot, CUstream stream);
  // A recv's `done` word once both it and `queued` are set (the sender's CPU writes `queued`,
  // and nothing may write the word once it is handed to another op): whether the copy ran
  // (true) or the sender gave up (false); nullopt until then.
  std::optional<bool> recvLanded(const Op& recv) const;
  // Ends a recv whose `done` word said how it went (recvLanded).
  void endRecv(const std::shared_ptr<Op>& recv, bool copied);

 private:
  CudaOps& cudaOps_;
  const ProgressThread& thread_;
  cuda::FlagSegment& flags_;
  cuda::IpcExporter exporter_;
  cuda::IpcCache ipc_;
  RingMemory ringMemory_;  // before the rings, which give their share back to it
  Done onDone_;
  Notify notify_;
  // By peer process key; kept after a peer fails, while copies still write its words.
  std::mutex peerFlagsMutex_;
  std::map<std::string, std::unique_ptr<cuda::RemoteFlagSegment>> peerFlags_;
  // Released, not drained, when the channel goes: a copy may be parked on the `ready` of a
  // peer that died.
  std::map<std::pair<int, int>, std::unique_ptr<cuda::Stream>> streams_;
  std::map<int, std::unique_ptr<cuda::Stream>> copyOutStreams_;
};

}  // namespace smfree::engine
