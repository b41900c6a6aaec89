// UCX's promises (see UcxChannel.h): which relayed ops are promised, and the admission hook
// that holds back an op whose CUDA calls on the progress thread could stall it while
// commitments are in flight.
#include "engine/Log.h"
#include "engine/channels/ucx/UcxChannel.h"
#include "engine/channels/ucx/UcxCudaOp.h"

namespace smfree::engine {

bool UcxChannel::admit(const std::shared_ptr<Op>& op) {
  thread_.check("UcxChannel::admit");
  if (!heldOps_.empty()) {
    heldOps_.push_back(op);  // ops start in posting order: they match in it
    return false;
  }
  if (!op->channelOp->traits().callsCudaOnProgressThread) return true;
  progressThreadCallsCuda(*op);
  // Its CUDA calls could stall this thread while a peer's stream waits for bytes it moves.
  if (commitments_ == 0) return true;
  heldOps_.push_back(op);
  return false;
}

void UcxChannel::startHeldOps() {
  // Promises have ended for good: commitments only go down from here, and the held ops all
  // start at once.
  if (heldOps_.empty() || commitments_ > 0) return;
  std::deque<std::shared_ptr<Op>> held;
  held.swap(heldOps_);
  for (const std::shared_ptr<Op>& op : held) start_(op);
}

void UcxChannel::onNotice(const Notice& notice) {
  const auto* closed = std::get_if<GroupClosed>(&notice);
  if (!closed) return;
  std::deque<std::shared_ptr<Op>> held;
  for (const std::shared_ptr<Op>& op : heldOps_) {
    if (op->groupId == closed->groupId) {
      onDone_(op, Status::failure(closed->code,
                                  concat(op->describe(), " failed: ", closed->reason)));
    } else {
      held.push_back(op);
    }
  }
  heldOps_.swap(held);
}

void UcxChannel::progressThreadCallsCuda(const Op& op) {
  if (!promising_) return;
  promising_ = false;
  stoppedPromising_ = op.describe();
}

ChannelAnnouncement UcxChannel::announce(const std::shared_ptr<Op>& send, Peer& destination) {
  ChannelAnnouncement announcement;
  announcement.promised = promiseSend(*send);
  prepareSend(send, destination);
  return announcement;
}

bool UcxChannel::promiseSend(Op& send) {
  UcxCudaOp* state = ucxCudaOp(send);
  if (!state || !state->relay) return false;
  // A caller-relayed send's copies out are queued already (prepare()).
  state->promised = promising_;
  if (state->promised) {
    ++commitments_;
  } else {
    logOnce("unpromised-send",
            concat("relayed CUDA sends are not promised since this process moved ",
                   stoppedPromising_, " with CUDA calls on its progress thread: their "
                   "receivers' wait() holds the CPU until the bytes land"));
  }
  return state->promised;
}

void UcxChannel::cleared(const std::shared_ptr<Op>& recv, bool sendPromised) {
  UcxCudaOp* state = ucxCudaOp(*recv);
  if (!state || !state->relay || recv->finished()) return;
  // Its copies in may wait on the GPU only for bytes that nothing here has to move: the
  // sender's are copied out and moved by threads that make no CUDA call (promised), the
  // clear-to-send has left (an eager control message on a connection of its own), and the
  // receive worker, which makes no CUDA call while this process promises, marks the pieces.
  const bool promised = sendPromised && promising_;
  if (!promised) {
    logOnce("unpromised-recv",
            concat(recv->describe(), " and later relayed CUDA recvs like it hold the CPU in "
                   "wait() until their bytes land: ",
                   sendPromised ? concat("this process moved ", stoppedPromising_,
                                         " with CUDA calls on its progress thread")
                                : std::string("the sender did not promise its send (it "
                                              "makes CUDA calls on its progress thread)")));
  }
  state->promised = promised;
  if (promised) ++commitments_;
  state->relay->matched.store(
      promised ? CallerRelay::kMatchedPromised : CallerRelay::kMatchedUnpromised,
      std::memory_order_release);
}

}  // namespace smfree::engine
