#pragma once

#include <cuda.h>

#include <functional>
#include <list>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/Channel.h"
#include "engine/CudaOps.h"
#include "engine/ProgressThread.h"
#include "engine/channels/copy_engine/ChannelData.h"
#include "engine/channels/copy_engine/CopyEngineChannelOp.h"
#include "engine/channels/copy_engine/CopyEngineOp.h"
#include "engine/channels/copy_engine/CollectiveLanes.h"
#include "engine/channels/copy_engine/EagerLanes.h"
#include "engine/channels/copy_engine/StagingRing.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/IpcCache.h"
#include "engine/cuda/IpcExport.h"
#include "engine/cuda/Stream.h"

namespace smfree::engine {

// Same-host CUDA buffers: the sender's copy engine writes straight into the receiver's
// buffer, mapped through CUDA IPC, on a DMA stream per (local device, peer device).
//
// The copy is submitted as soon as the receiver clears the send: the DMA stream waits for
// the sender's `produced` event and the receiver's `ready` word (both submitted when the ops
// were posted, so before this clearance), copies, records the sender's `copied`, then writes
// the receiver's `done` word to its kCopied value. Only then do both sides learn `queued`,
// and only then may a user stream wait for the copy (see CudaFence.h): every stream wait is
// for work already submitted, so no posting order and no sharing of hardware queues between
// streams can deadlock.
//
// Staging (StagingRing.h): a send of kStagingMinBytes to SMFREE_STAGING_BYTES whose
// receiver's `ready` is not yet set when it is cleared goes to a slot of the receiver's ring
// instead, as soon as one is free, or directly once `ready` is set, whichever comes first.
// The sender then tells the receiver the slot (a ChannelNotice); the receiver's copy engine
// waits for its `ready` and the slot's `full`, copies the slot out into the buffer, writes
// `done` and empties the slot. The same rule holds: both waits are for submitted work.
//
// Eager lanes (EagerLanes.h): a send of up to SMFREE_EAGER_BYTES on a lane its receiver has
// opened is copied at its post, on the caller's thread, into the lane's slot for its number;
// its `queued` is set at once, so its wait() returns at once. A recv's wait() that can tell
// from the lane that its message can be eager claims it so and queues the copy out itself, on
// its stream, without waiting for the sender. Otherwise the progress thread queues it at the
// match (wait for `ready` and the slot's `full`, copy, write `done` and `emptied`), as for a
// staged send. A send whose slot is still full at its post goes by rendezvous, or, where the
// receiver's wait() claimed it eager, is held: the progress thread copies it once the slot is
// empty, and its `queued` waits for that.
//
// Collective lanes (CollectiveLanes.h): a collective's piece is copied at the post of whichever
// of its two ranks posts second, so that neither's wait() waits for the other; the rendezvous
// then only ends both ops once the copy has written their `done` words
// (CopyEngineCollective.cpp).
class CopyEngineChannel final : public Channel {
 public:
  // Sends a ChannelNotice's data to a peer.
  using Notify = std::function<void(Peer&, std::string)>;
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
  bool busy() const override { return !moving_.empty() || !held_.empty(); }
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

  // The op's part, for its CopyEngineChannelOp.
  bool fenceQueued(const CopyEngineFence& fence);
  void waitOnStream(void* stream, int device, const CopyEngineFence& fence);
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
    ipc_.forget(owner, ids);
    collectiveLanes_.forget(owner, ids);
  }

  struct Clearance {
    ClearanceHeader header;
    cuda::IpcExport destination;
  };
  struct Transfer {
    std::shared_ptr<Op> op;
    Peer* peer = nullptr;
    cuda::RemoteFlagSegment* peerFlags = nullptr;  // sends: the receiver's flag segment
    std::optional<Clearance> clearance;        // sends
    std::shared_ptr<RemoteStagingRing> remote; // sends that may be or were staged
    std::shared_ptr<StagingRing> ring;         // recvs whose copy-out is submitted
    std::optional<StagedSlot> slot;            // staged and eager sends, and those recvs
    bool eager = false;                        // sends: copied at the post
    bool cleared = false;                      // eager sends: the receiver took the slot
    // Eager sends whose copy waits for the slot (EagerLanes::fill); recvs of such a send
    // whose copy out waits, unqueued, for the slot's `full` (copies out wait for submitted
    // copies only).
    bool held = false;
    // Recvs whose copy out their caller's wait() queues: moving until that has run.
    std::shared_ptr<EagerRecv> callerCopiesOut;
    bool collective = false;  // a collective lane's: moving until its `done` word says the copy ran
  };
  using RingKey = std::pair<std::string, int>;  // (peer's process key, ring's device)

  // The clear-to-send's data (readClearance), its rings kept for later sends.
  Clearance takeClearance(const Op& send, Peer& destination, const std::string& channelData);
  bool stageable(uint64_t bytes) const;
  // The peer's flag segment, mapped on first use (any thread).
  cuda::RemoteFlagSegment& flagsOf(const Peer& peer);
  cuda::RemoteFlagSegment& flagsOf(const std::string& key, const PeerAddress& address,
                                   int ownerPidfd);
  std::shared_ptr<StagingRing> ringFor(const Peer& source, int device);
  static LaneKey laneOf(const Op& op, const std::string& peerKey);

  // Receiver: the slot an eager send filled; queues its copy out unless the recv's caller
  // does.
  std::string armEager(const std::shared_ptr<Op>& recv, Peer& source,
                       const std::string& announced);
  void clearedEager(const std::shared_ptr<Op>& send);
  // A recv whose caller claimed its copy out failed: lets that copy run (into a failed recv)
  // or, where it was not queued, empties the slot.
  void releaseEagerRecv(EagerRecv& recv);
  // A held eager send: queues its copy once the slot is empty; false until then.
  bool fillHeld(Transfer& send);
  // A recv of a held eager send: queues its copy out once the slot is full; false until then.
  bool copyOutOnceFull(Transfer& recv);
  // Empties the slots of held eager sends no recv took, once their copies have landed.
  bool emptyHeldSlots();

  // Collective lanes (CopyEngineCollective.cpp). An op of one reached the match or its
  // clearance: it moves until its `done` word is written. One that failed keeps its buffer while
  // a copy may still come.
  void moveCollective(const std::shared_ptr<Op>& op, Peer* peer);
  void endCollective(Op& op);
  bool finishCollective(Transfer& transfer);
  void peerFailedCollective(const Peer& peer);

  void submitDirect(Transfer send);
  void submitStaged(Transfer send, const StagedSlot& slot);
  void enqueueCopy(const Transfer& send, CUstream stream);
  void enqueueStagedCopy(Transfer& send, const StagedSlot& slot, CUstream stream);
  void enqueueCopyOut(const Op& recv, StagingRing& ring, const StagedSlot& slot, CUstream stream);
  void enqueueEmptying(StagingRing& ring, const StagedSlot& slot, CUstream stream);
  // Tells the receiver's streams that this send will never write its buffer.
  static void giveUp(Transfer& send);
  // Held sends: staged once a slot is free, direct once the receiver is ready.
  bool advanceHeld();
  // Lets a submitted copy run whatever the receiver's stream does: used when an op fails.
  // (The sender's own stream always reaches `produced`: its waits are released on failure.)
  void releaseReadiness(Transfer& send);
  // Ends a recv whose bytes will not come: fails it (which releases its stream waits) and
  // drops the buffer.
  std::list<Transfer>::iterator abandon(std::list<Transfer>::iterator it, const Status& status);
  bool finishMove(Transfer& transfer);
  bool finishCallersCopyOut(Transfer& transfer);
  CUstream dmaStream(int localDevice, int peerDevice);
  CUstream copyOutStream(int device);

  CudaOps& cudaOps_;
  const ProgressThread& thread_;
  cuda::FlagSegment& flags_;
  cuda::IpcExporter exporter_;
  cuda::IpcCache ipc_;
  uint64_t stagingBytes_;
  RingMemory ringMemory_;  // before the rings, which give their share back to it
  Done onDone_;
  Notify notify_;
  Release release_;
  // By peer process key; kept after a peer fails, while copies still write its words.
  std::mutex peerFlagsMutex_;
  std::map<std::string, std::unique_ptr<cuda::RemoteFlagSegment>> peerFlags_;
  std::map<RingKey, std::shared_ptr<StagingRing>> rings_;  // null: none can be had
  std::map<RingKey, std::shared_ptr<RemoteStagingRing>> remoteRings_;
  EagerLanes lanes_;
  CollectiveLanes collectiveLanes_;
  const bool lanesForCollectives_;  // SMFREE_COLLECTIVE_LANES
  std::atomic<uint64_t> eagerSends_{0};
  uint64_t eagerRecvs_ = 0;
  std::list<Transfer> held_;    // cleared sends waiting for a slot or for `ready`
  struct HeldSlot {
    std::shared_ptr<StagingRing> ring;
    StagedSlot slot;
  };
  std::list<HeldSlot> heldSlots_;  // of held eager sends no recv took (discard)
  std::list<Transfer> moving_;  // copies submitted (sends) or expected (recvs)
  uint64_t stagedSends_ = 0;  // copied into a receiver's slot
  uint64_t stagedRecvs_ = 0;  // copied out of one of our slots
  // Released, not drained, when the channel goes: a copy may be parked on the `ready` of a
  // peer that died.
  std::map<std::pair<int, int>, std::unique_ptr<cuda::Stream>> streams_;
  std::map<int, std::unique_ptr<cuda::Stream>> copyOutStreams_;
};

}  // namespace smfree::engine
