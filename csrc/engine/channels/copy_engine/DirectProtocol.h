#pragma once

#include <list>
#include <memory>
#include <string>

#include "engine/Op.h"
#include "engine/Status.h"
#include "engine/channels/copy_engine/ChannelData.h"
#include "engine/channels/copy_engine/CopyEngineContext.h"
#include "engine/channels/copy_engine/DirectStates.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/IpcExport.h"

namespace smfree::engine {

struct Peer;

// A send its receiver cleared by rendezvous: what the direct and staged protocols copy.
struct ClearedSend {
  std::shared_ptr<Op> op;
  Peer* peer = nullptr;
  cuda::RemoteFlagSegment* peerFlags = nullptr;  // the receiver's flag segment
  ClearanceHeader header;
  cuda::IpcExport destination;
};

struct DirectSend {
  ClearedSend send;
  DirectSendState state = DirectSendState::kCleared;
};

struct DirectRecv {
  std::shared_ptr<Op> op;
  Peer* peer = nullptr;
  DirectRecvState state = DirectRecvState::kArmed;
};

// The sender's copy engine writes straight into the receiver's buffer, mapped through CUDA IPC,
// on a DMA stream per (local device, peer device). The copy is queued once the receiver cleared
// the send: the DMA stream waits for the sender's `produced` event and the receiver's `ready`
// word (both submitted at the posts, so before this clearance), copies, records `copied`, then
// writes the receiver's `done` word. Progress thread only.
class DirectProtocol {
 public:
  explicit DirectProtocol(CopyEngineContext& context) : context_(context) {}

  // Receiver: exports a recv's buffer to its sender (IpcExport::appendTo's bytes).
  std::string exportDestination(const Op& recv, const Peer& source);
  // Receiver: arms a recv; returns its clear-to-send's data: the header, then `destination`,
  // `ring` and `eager` (the staging and eager rings its sender may use, as the rings append
  // them).
  std::string arm(const std::shared_ptr<Op>& recv, Peer& source, const std::string& destination,
                  const std::string& ring, const std::string& eager);
  // Sender: queues the copy; throws Error, the receiver told, where it cannot.
  void submit(ClearedSend send);
  // Tells the receiver's streams that this send will never write its buffer.
  static void giveUp(ClearedSend& send);

  bool progress();
  // Lets a queued copy run whatever the receiver does (a send cannot take its copy back).
  void cancel(const Op& op);
  // A recv's sender gave up: an armed recv ends now.
  void partnerGaveUp(const Op& recv);
  void peerFailed(const Peer& peer, const Status& gone);

  // The armed recv a staging notice names; null if there is none.
  DirectRecv* armedRecv(uint64_t recvId);
  // Hands an armed recv to the staged protocol, which ends it from now on.
  void staged(DirectRecv& recv);
  void abandon(DirectRecv& recv, const Status& status);

  // The flags a send still waits for, after the op's own (CopyEngineChannel::describeWait).
  std::string describeWait(const Op& op) const;
  bool busy() const { return !sends_.empty() || !recvs_.empty(); }

 private:
  void enqueueCopy(const ClearedSend& send, CUstream stream);
  bool finish(DirectSend& send);
  bool finish(DirectRecv& recv);
  void moveTo(DirectSend& send, DirectSendState to);
  void moveTo(DirectRecv& recv, DirectRecvState to);
  std::list<DirectRecv>::iterator find(const Op& op);

  CopyEngineContext& context_;
  std::list<DirectSend> sends_;  // queued copies
  std::list<DirectRecv> recvs_;  // armed recvs
};

}  // namespace smfree::engine
