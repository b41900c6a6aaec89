#pragma once

#include <cuda.h>

#include <list>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/Channel.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/IpcCache.h"
#include "engine/cuda/IpcExport.h"

namespace smfree::engine {

// Same-host CUDA buffers: the sender's copy engine writes straight into the receiver's
// buffer, mapped through CUDA IPC, on a DMA stream per (local device, peer device).
//
// The copy is submitted as soon as the receiver clears the send: the DMA stream waits for
// the sender's `produced` event and the receiver's `ready` word (both submitted when the ops
// were posted, so before this clearance), copies, records the sender's `copied`, then writes
// the receiver's `done` word to its kCopied value. Only then do both sides learn `queued`,
// and only then may a user stream wait for the copy (see CudaOp.h): every stream wait is
// for work already submitted, so no posting order and no sharing of hardware queues between
// streams can deadlock.
class CopyEngineChannel final : public Channel {
 public:
  CopyEngineChannel(cuda::FlagSegment& flags, size_t ipcCacheSize, Done onDone);
  ~CopyEngineChannel() override;

  std::string armRecv(const std::shared_ptr<Op>& recv, Peer& source) override;
  void startSend(const std::shared_ptr<Op>& send, Peer& destination,
                 const std::string& channelData) override;
  void cancel(Op& op) override;
  void partnerGaveUp(Op& op) override;
  bool progress() override;
  bool busy() const override { return !moving_.empty(); }
  void peerFailed(Peer& peer) override;

  size_t ipcMappings() const { return ipc_.size(); }
  size_t ipcExports() const { return exporter_.size(); }
  // Per peer, the ids of memory exported to it that its owner (this process) has since freed
  // or unmapped; the peer is to close its mappings (memoryReleased()).
  std::map<std::string, std::vector<uint64_t>> sweepExports() { return exporter_.sweep(); }
  void memoryReleased(const std::string& owner, const std::vector<uint64_t>& ids) {
    ipc_.forget(owner, ids);
  }
  // For the pending-op table: which flags an op still waits for, as "name index:word/wanted".
  std::string describeWait(const Op& op) const;

 private:
  // What the receiver's clear-to-send carries: its flags, then where to write.
  struct ClearanceFlags {
    cuda::Flag ready;
    cuda::Flag queued;
    cuda::Flag done;
  };
  struct Clearance {
    ClearanceFlags flags;
    cuda::IpcExport destination;
  };
  struct Transfer {
    std::shared_ptr<Op> op;
    Peer* peer;
    std::optional<Clearance> clearance;  // sends only
  };

  static Clearance readClearance(const Op& send, const std::string& channelData);

  void enqueueCopy(const Op& send, Peer& peer, const Clearance& clearance, CUstream stream);
  // Lets a submitted copy run whatever the receiver's stream does: used when an op fails.
  // (The sender's own stream always reaches `produced`: its waits are released on failure.)
  void releaseReadiness(Transfer& send);
  // Ends a recv whose bytes will not come: fails it (which releases its stream waits) and
  // drops the buffer.
  std::list<Transfer>::iterator abandon(std::list<Transfer>::iterator it, const Status& status);
  bool finishMove(Transfer& transfer);
  CUstream dmaStream(int localDevice, int peerDevice);

  cuda::FlagSegment& flags_;
  cuda::IpcExporter exporter_;
  cuda::IpcCache ipc_;
  Done onDone_;
  std::map<std::pair<int, int>, CUstream> streams_;
  std::list<Transfer> moving_;  // copies submitted (sends) or expected (recvs)
};

}  // namespace smfree::engine
