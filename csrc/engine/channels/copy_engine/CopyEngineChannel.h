#pragma once

#include <cuda.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/Channel.h"
#include "engine/CudaOps.h"
#include "engine/ProgressThread.h"
#include "engine/channels/copy_engine/CollectiveProtocol.h"
#include "engine/channels/copy_engine/CopyEngineContext.h"
#include "engine/channels/copy_engine/DirectProtocol.h"
#include "engine/channels/copy_engine/EagerProtocol.h"
#include "engine/channels/copy_engine/StagedProtocol.h"

namespace smfree::engine {

class CopyEngineChannelOp;
struct CopyEngineFence;

// Same-host CUDA buffers, moved by the GPUs' copy engines by one of four protocols, each a class
// with its transfers and their state table: direct (DirectProtocol.h: the sender's copy engine
// writes straight into the receiver's buffer, mapped through CUDA IPC), staged
// (StagedProtocol.h), eager (EagerProtocol.h) and collective lanes (CollectiveProtocol.h). This
// class only dispatches an op to its protocol; what they share is CopyEngineContext.
//
// Every protocol keeps one rule: an op learns `queued` only once its copy is submitted, and only
// then may a user stream wait for the copy (see CudaFence.h): every stream wait is for work
// already submitted, so no posting order and no sharing of hardware queues between streams can
// deadlock.
class CopyEngineChannel final : public Channel {
 public:
  using Notify = CopyEngineContext::Notify;
  // Tells a peer (by process key) that memory it mapped from this process was freed
  // (MemoryReleased).
  using Release = std::function<void(const std::string&, std::vector<uint64_t>)>;

  CopyEngineChannel(CudaOps& cudaOps, const ProgressThread& thread, std::string processKey,
                    size_t ipcCacheSize, uint64_t stagingBytes, uint64_t eagerBytes,
                    uint64_t ringMemoryBytes, bool collectiveLanes, Done onDone, Notify notify,
                    Release release);

  // Caller's thread (CopyEngineCaller.cpp).
  std::shared_ptr<ChannelOp> prepare(Op& op, const PostOptions& options) override;

  // Progress thread.
  Progress progress() override;
  bool busy() const override;
  // Sends each peer the ids of memory exported to it that this process has since freed or
  // unmapped; the peer is to close its mappings (onMemoryReleased()).
  void sweep() override;
  void peerFailed(Peer& peer) override;
  // Nothing to wait for: a peer's copy engines read and write its memory themselves.
  void flush(Clock::time_point deadline) override {}
  // It has no thread of its own.
  void stop() override {}
  void onNotice(const Notice& notice) override;
  void report(ChannelReport& report) const override;

 private:
  friend class CopyEngineChannelOp;

  // The op's part, for its CopyEngineChannelOp. Caller's thread (CopyEngineCaller.cpp):
  bool fenceQueued(const CopyEngineFence& fence);
  void waitOnStream(void* stream, int device, const CopyEngineFence& fence);
  // Progress thread:
  std::string announce(const Op& send);
  void prepareSend(const std::shared_ptr<Op>& send, Peer& destination);
  std::string armRecv(const std::shared_ptr<Op>& recv, Peer& source,
                      const std::string& announced);
  bool outlivesWait(const Op& op) const;
  void startSend(const std::shared_ptr<Op>& send, Peer& destination,
                 const std::string& channelData);
  void cancel(Op& op);
  void partnerGaveUp(Op& op);
  void ended(Op& op, const Status& status);
  void release(Op& op);
  // Which flags an op still waits for, as "name index:word/wanted".
  std::string describeWait(const Op& op) const;

  // Notices (onNotice()). Receiver: an eager send's announcement, before it is matched, and one
  // that no recv will arm.
  void announced(Peer& source, const ReadyToSend& rts);
  void discard(Peer& source, const ReadyToSend& rts, Op* recv);
  // Receiver: a sender's notice that it copied a send into a staging slot.
  void onNotice(Peer& source, const std::string& data);
  void onMemoryReleased(const std::string& owner, const std::vector<uint64_t>& ids) {
    context_.ipc().forget(owner, ids);
    collective_.lanes().forget(owner, ids);
  }

  CopyEngineContext context_;  // first: the protocols hold it, their rings its ring memory
  DirectProtocol direct_;
  StagedProtocol staged_;
  EagerProtocol eager_;
  CollectiveProtocol collective_;
  Release release_;
};

}  // namespace smfree::engine
