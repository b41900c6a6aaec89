#pragma once

#include <cuda.h>

#include <list>
#include <map>
#include <optional>
#include <utility>

#include "engine/Channel.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/IpcMemory.h"

namespace smfree::engine {

// Same-host CUDA buffers: the sender's copy engine writes straight into the receiver's
// buffer, mapped through CUDA IPC, on a DMA stream per (local device, peer device).
//
// The DMA stream never waits on anything. The progress thread enqueues a copy only once
// both sides are ready: the sender's stream has produced the source and the receiver's
// stream has released the destination (each stream wrote a flag at posting). A stream
// that waits on a peer can therefore never hold up a copy that the peer waits for,
// whatever the order in which ops were posted. After the copy the DMA stream writes the
// receiver's `done` and `moved` flags, then the sender's.
class CopyEngineChannel final : public Channel {
 public:
  CopyEngineChannel(cuda::FlagSegment& flags, size_t ipcCacheSize, Done onDone);
  ~CopyEngineChannel() override;

  const char* name() const override { return "copy engine"; }
  std::string armRecv(const std::shared_ptr<Op>& recv, Peer& source) override;
  void startSend(const std::shared_ptr<Op>& send, Peer& destination,
                 const std::string& channelData) override;
  void cancel(Op& op) override;
  bool progress() override;
  bool busy() const override { return !waiting_.empty() || !moving_.empty(); }
  void peerFailed(Peer& peer) override;

  size_t ipcMappings() const { return ipc_.size(); }
  // For the pending-op table: which flags an op still waits for, as "name word/wanted".
  std::string describeWait(const Op& op) const;

 private:
  // What the receiver's clear-to-send carries.
  struct Clearance {
    cuda::IpcExport destination;
    cuda::Flag ready;
    cuda::Flag done;
    cuda::Flag moved;
  };
  struct Transfer {
    std::shared_ptr<Op> op;
    Peer* peer;
    std::optional<Clearance> clearance;  // sends only
    bool cancelled = false;
  };

  void enqueueCopy(Transfer& send);
  // Ends a transfer that will not move its bytes: releases stream waits and the buffer.
  std::list<Transfer>::iterator abandon(std::list<Transfer>& transfers,
                                        std::list<Transfer>::iterator it, const Status& status);
  bool finishMove(Transfer& transfer);
  CUstream dmaStream(int localDevice, int peerDevice);

  cuda::FlagSegment& flags_;
  cuda::IpcCache ipc_;
  Done onDone_;
  std::map<std::pair<int, int>, CUstream> streams_;
  std::list<Transfer> waiting_;  // cleared sends, not both sides ready yet
  std::list<Transfer> moving_;   // copies enqueued (sends) or expected (recvs)
};

}  // namespace smfree::engine
