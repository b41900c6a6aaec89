// UCX's promises (see UcxChannel.h): which staged ops are promised, and the commitments that
// hold back an op whose CUDA calls on the progress thread could stall it.
#include "engine/Log.h"
#include "engine/channels/ucx/UcxChannel.h"

namespace smfree::engine {

bool UcxChannel::callsCudaOnProgressThread(const Op& op) const {
  // All CUDA ops but caller-staged ones: UCX moves their CUDA memory itself.
  const UcxCudaOp* state = ucxCudaOp(op);
  return state && !state->staging;
}

void UcxChannel::progressThreadCallsCuda(const Op& op) {
  if (!promising_) return;
  promising_ = false;
  stoppedPromising_ = op.describe();
}

bool UcxChannel::promiseSend(Op& send) {
  UcxCudaOp* state = ucxCudaOp(send);
  if (!state || !state->staging) return false;
  // A caller-staged send's copies out are queued already (prepare()).
  state->promised = promising_;
  if (state->promised) {
    ++commitments_;
  } else {
    logOnce("unpromised-send",
            concat("staged CUDA sends are not promised since this process moved ",
                   stoppedPromising_, " with CUDA calls on its progress thread: their "
                   "receivers' wait() holds the CPU until the bytes land"));
  }
  return state->promised;
}

void UcxChannel::cleared(const std::shared_ptr<Op>& recv, bool sendPromised) {
  UcxCudaOp* state = ucxCudaOp(*recv);
  if (!state || !state->staging || recv->finished()) return;
  // Its copies in may wait on the GPU only for bytes that nothing here has to move: the
  // sender's are copied out and moved by threads that make no CUDA call (promised), the
  // clear-to-send has left (an eager control message on a connection of its own), and the
  // receive lane, which makes no CUDA call while this process promises, marks the pieces.
  const bool promised = sendPromised && promising_;
  if (!promised) {
    logOnce("unpromised-recv",
            concat(recv->describe(), " and later staged CUDA recvs like it hold the CPU in "
                   "wait() until their bytes land: ",
                   sendPromised ? concat("this process moved ", stoppedPromising_,
                                         " with CUDA calls on its progress thread")
                                : std::string("the sender did not promise its send (it "
                                              "makes CUDA calls on its progress thread)")));
  }
  state->promised = promised;
  if (promised) ++commitments_;
  state->staging->matched.store(
      promised ? CallerStaging::kMatchedPromised : CallerStaging::kMatchedUnpromised,
      std::memory_order_release);
}

}  // namespace smfree::engine
