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
  CudaFence prepare(Op& op, const PostOptions& options) override;
  bool fenceQueued(const CudaFence& fence) override;
  void waitOnStream(void* stream, int device, const CudaFence& fence) override;

  // Progress thread.
  bool reaches(const Peer& peer) const override;
  bool callsCudaOnProgressThread(const Op& op) const override { return true; }
  std::string announce(const Op& send) override;
  void prepareSend(const std::shared_ptr<Op>& send, Peer& destination) override;
  void announced(Peer& source, const ReadyToSend& rts) override;
  std::string armRecv(const std::shared_ptr<Op>& recv, Peer& source,
                      const std::string& announced) override;
  void discard(Peer& source, const ReadyToSend& rts, Op* recv) override;
  bool outlivesWait(const Op& op) const override;
  void startSend(const std::shared_ptr<Op>& send, Peer& destination,
                 const std::string& channelData) override;
  void cancel(Op& op) override;
  void partnerGaveUp(Op& op) override;
  void ended(Op& op, const Status& status) override;
  void release(Op& op) override;
  bool progress() override;
  bool busy() const override;
  // Sends each peer the ids of memory exported to it that this process has since freed or
  // unmapped; the peer is to close its mappings (onMemoryReleased()).
  void sweep() override;
  void peerFailed(Peer& peer) override;
  // Receiver: a sender's notice that it copied a send into a staging slot.
  void onNotice(Peer& source, const std::string& data) override;
  void onMemoryReleased(const std::string& owner, const std::vector<uint64_t>& ids) override {
    context_.ipc().forget(owner, ids);
    collective_.lanes().forget(owner, ids);
  }
  // Which flags an op still waits for, as "name index:word/wanted".
  std::string describeWait(const Op& op) const override;
  std::string describeMemory() const override;
  void addStats(std::map<std::string, int64_t>& stats) const override;

 private:
  CopyEngineContext context_;  // first: the protocols hold it, their rings its ring memory
  DirectProtocol direct_;
  StagedProtocol staged_;
  EagerProtocol eager_;
  CollectiveProtocol collective_;
  Release release_;
};

}  // namespace smfree::engine
