#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/Channel.h"
#include "engine/CudaOps.h"
#include "engine/Failures.h"
#include "engine/ProgressThread.h"
#include "engine/channels/captured/CapturedOp.h"
#include "engine/channels/captured/ChainStreams.h"
#include "engine/cuda/FlagSegment.h"

namespace smfree::engine {

// Same-host CUDA ops posted while their stream captures a CUDA graph (torch.cuda.graph): the
// graph holds their whole data path, copy-engine copies and stream memory operations, and its
// replays move the bytes with no CPU and no kernel.
//
// At capture both ranks run the capturing code, so the CPU rendezvous happens then, once: a
// captured send meets the captured recv of its (peer, tag) line (captured ops have lines of
// their own, GroupState), sizes and dtypes are checked, and the receiver learns where its
// bytes will be. What the two graphs hold for one message:
//  - the sender's slot, device memory of the message's size on the sender's GPU, and two words
//    of the sender's flag segment: `full`, 0 at capture, and `empty`, 1;
//  - the sender's nodes, at its post: {wait empty == 1; empty = 0}, the copy of the tensor
//    into the slot (on its own GPU), full = 1;
//  - the receiver's, at its wait(): {wait full == 1; full = 0}, the copy of the slot into the
//    tensor (the receiver's copy engine reading over NVLink), empty = 1.
// Each word is set by one side and reset by the other right after its wait, so its values stay
// 0 and 1 and the graphs replay any number of times with the values frozen at capture. A send
// waits only for its receiver's previous replay to have emptied its slot, never for the
// current one: it completes in any posting order, as an eager send does.
//
// Ordering: an op's nodes go on its capture's chain (ChainStreams), forked from the caller's
// stream at the post (the chain waits for `posted`, recorded there) and joined by the caller's
// stream at the op's wait() (which waits for `done`). A send's nodes are queued at its post, a
// recv's at its wait(): program order, as for the eager lanes.
//
// Deadlock: a replay's waits are for the peer's graph: a send's for the peer's previous
// replay, which needs nothing of this replay; a recv's for a send its peer queued earlier in
// its program. The chain holds every smfree node of the process in program order, so every
// node of this process that a recv's wait depends on, through the peer, is an ancestor of that
// wait in the graph and runs before it, however the graph's nodes share hardware queues
// (CUDA_DEVICE_MAX_CONNECTIONS=1 too). A cycle of waits is then a cycle in the two programs
// (each rank waiting for a recv before posting the send the other needs), which hangs on NCCL
// too.
//
// Faults: each wait is bracketed by writes of a watched word (GraphWait). A wait that lasts the
// group timeout (a peer that stopped replaying), or any wait of an op whose peer died, is
// released by the progress thread raising the awaited word; the group then refuses its next
// call, naming the op, and its graphs' waits are released at every replay from then on.
class CapturedChannel final : public Channel {
 public:
  CapturedChannel(CudaOps& cudaOps, const ProgressThread& thread, Failures& failures,
                  Done onDone);
  ~CapturedChannel() override;

  // Caller's thread (CapturedCaller.cpp).
  CudaFence prepare(Op& op, const PostOptions& options) override;
  bool fenceQueued(const CudaFence& fence) override;
  void waitOnStream(void* stream, int device, const CudaFence& fence) override;

  // Progress thread.
  bool reaches(const Peer& peer) const override;
  bool callsCudaOnProgressThread(const Op& op) const override { return true; }
  std::string announce(const Op& send) override;
  std::string armRecv(const std::shared_ptr<Op>& recv, Peer& source,
                      const std::string& announced) override;
  void cleared(const std::shared_ptr<Op>& recv, bool sendPromised) override;
  void startSend(const std::shared_ptr<Op>& send, Peer& destination,
                 const std::string& channelData) override;
  void cancel(Op& op) override {}  // nothing moves at capture: the op ends as it fails
  void ended(Op& op, const Status& status) override;
  void peerFailed(Peer& peer) override;
  // The watchdog: releases the replays' waits that lasted the group timeout or can no longer
  // end, and lets go of what destroyed graphs held.
  void sweep() override;
  // Process exit: releases every wait a replay may still make.
  void stop() override;
  std::string describeWait(const Op& op) const override;
  void addStats(std::map<std::string, int64_t>& stats) const override;

 private:
  // Where destroyed graphs leave their ops (from a thread of the CUDA driver, which allows no
  // CUDA call there); the progress thread lets go of them. Once the channel is gone, ops are
  // left to the process's end.
  struct Graveyard {
    std::mutex mutex;
    bool open = true;
    std::vector<std::shared_ptr<CapturedOp>> buried;

    void bury(std::shared_ptr<CapturedOp> op);
  };

  // Caller's thread: the send's nodes, at its post.
  void queueSend(CapturedOp& send);
  // Caller's thread: the recv's nodes, at its first wait().
  void queueRecv(CapturedOp& recv);
  // Progress thread: the watchdog's part.
  void adoptCaptured();
  void buryDestroyed();
  void breakGroup(uint64_t groupId, const std::string& why);
  // Raises the word the op's replays wait on, so a replay waiting there goes on.
  void release(const CapturedOp& op);
  static std::string stuck(const CapturedOp& op);

  const ProgressThread& thread_;
  Failures& failures_;
  cuda::FlagSegment& flags_;
  Done onDone_;
  ChainStreams chains_;
  std::shared_ptr<Graveyard> graveyard_ = std::make_shared<Graveyard>();
  mutable std::mutex capturedMutex_;
  std::vector<std::shared_ptr<CapturedOp>> captured_;  // posted, not yet watched
  // Progress thread only.
  std::vector<std::shared_ptr<CapturedOp>> watched_;
  std::map<std::string, std::shared_ptr<cuda::RemoteFlagSegment>> senderWords_;
};

}  // namespace smfree::engine
