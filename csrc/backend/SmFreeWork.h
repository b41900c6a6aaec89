#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/Group.h"
#include "engine/Status.h"

namespace smfree {

class InFlightSpan;

// What a Work is for, kept as parts: formatted only when an error message needs it, so the
// post path builds no string.
struct WorkLabel {
  engine::OpKind kind = engine::OpKind::kSend;
  int rank = 0;
  int peer = engine::kAnySource;
  int tag = 0;
  int64_t bytes = -1;  // -1: a coalesced batch
  std::shared_ptr<const std::string> group;
  // The collective this Work is (peer kAnySource), or is a piece of; null for P2P.
  const char* collective = nullptr;

  // "recv on rank 0 from rank 2 (group 'pp', tag 0, 64 B)", "send on rank 0 to rank 1 (group
  // 'dp', all_gather_into_tensor, 64 B)", "all_gather_into_tensor on rank 0 (group 'dp',
  // 256 B in and out)" or "coalesced batch".
  std::string describe() const;
  bool isCollective() const { return collective && peer == engine::kAnySource; }
};

// The Work of one op, or of a coalesced batch. Ops report into it from the engine's
// progress thread; it completes once it is sealed and every op it expects has reported.
class SmFreeWork final : public c10d::Work {
 public:
  SmFreeWork(c10d::OpType type, WorkLabel label, std::vector<at::Tensor> tensors);

  // One more op will report; `cpuWaited`: wait() waits for it on the CPU, not through a stream
  // fence.
  void expectOp(bool cpuWaited);
  // An op with a fence: wait() makes the current stream wait for it rather than the CPU (see
  // wait()).
  void addStreamFence(std::shared_ptr<engine::Group> group, int device, engine::OpFence fence);
  // An op with a stream fence holds `span` (InFlight.h) until it ends or wait() returns: from
  // then on the current stream orders what follows after the op's copy.
  void addInFlight(std::shared_ptr<InFlightSpan> span);
  // One of its ops was posted now, with the group timeout `groupTimeout`, at which the engine
  // fails it: a wait() without a timeout raises if the Work has not finished a margin later.
  void onPosted(std::chrono::milliseconds groupTimeout);
  void seal();      // no more ops will be added (an op's own Work: it is posted)
  // `op`: the label of the op's own Work, which names it in errors.
  void onOpDone(const engine::Status& status, int source, bool cpuWaited, const WorkLabel& op);
  const WorkLabel& label() const { return label_; }
  // A recv from any source has matched `source`'s send, before wait() can return.
  void onMatched(int source);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // For FuturePoller: queues the copies in of its caller-staged recvs that their match allows;
  // true once nothing is left for a poll to do (all queued, the Work ended, or queueing failed,
  // which then fails the Work).
  bool pollCopiesIn();

 private:
  void completeIfDone(std::unique_lock<std::mutex>& lock);
  // Throws for an op of a coalescing block that has not ended. Under stateMutex_.
  void checkPosted() const;
  // The caller's current stream on `device` (a CUstream).
  static void* currentStream(int device);
  // `call` ("wait()", "synchronize()") names the waiting call in errors.
  void waitFinished(const char* call);
  // Throws the expiry of wait(timeout) if the Work has not finished by `until`.
  void waitFinishedBy(std::chrono::steady_clock::time_point until,
                      std::chrono::milliseconds timeout);
  [[noreturn]] void throwExpired(std::chrono::milliseconds timeout) const;
  void waitCpuWaitedOps();
  // Waits under `lock` until `ready`; raises past stallDeadline_, which only an engine that
  // stopped progressing lets come.
  template <typename Ready>
  void waitUnlessStalled(std::unique_lock<std::mutex>& lock, Ready ready, const char* call);

  struct StreamFence {
    std::shared_ptr<engine::Group> group;
    int device;
    engine::OpFence fence;
  };
  // Queues the copies in of the caller-staged recvs among fences_ (OpFence::queuedByWait),
  // waiting up to the group timeout for their match; the second, only until `until`.
  void queueStagedCopiesIn();
  // Queues those whose match allows it, without waiting; true once all are queued. Throws
  // engine::Error.
  bool queueStagedCopiesInIfMatched();
  void queueStagedCopiesInBy(std::chrono::steady_clock::time_point until,
                             std::chrono::milliseconds timeout);

  const WorkLabel label_;
  // Opens this op's range in a running torch.profiler, closed in completeIfDone.
  void startProfilerRange();

  const std::vector<at::Tensor> tensors_;
  const c10::intrusive_ptr<c10::ivalue::Future> future_;

  mutable std::mutex stateMutex_;
  std::condition_variable done_;
  int pending_ = 0;
  int cpuPending_ = 0;  // of pending_, those without a stream fence
  bool sealed_ = false;
  bool finished_ = false;
  // wait() returned true before every op ended (a CUDA op's stream fence): a later failure
  // refuses the group's next call instead.
  bool waitReturned_ = false;
  std::exception_ptr error_;
  std::atomic<bool> polledForFuture_{false};  // handed to FuturePoller
  int source_ = -1;
  // Added while posting, under stateMutex_; read without it once sealed_, when it no longer
  // changes.
  std::vector<StreamFence> fences_;
  std::vector<std::shared_ptr<InFlightSpan>> inFlight_;          // as fences_
  // Under stateMutex_: the latest post plus its group timeout and a margin; max: none posted.
  std::chrono::steady_clock::time_point stallDeadline_ =
      std::chrono::steady_clock::time_point::max();
  std::chrono::milliseconds groupTimeout_{0};
};

}  // namespace smfree
