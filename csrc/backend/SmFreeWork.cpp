#include "backend/SmFreeWork.h"

#include <algorithm>
#include <map>
#include <string_view>

#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "backend/CallerRelease.h"
#include "backend/Errors.h"
#include "backend/FuturePoller.h"
#include "backend/InFlight.h"
#include "backend/WithoutGil.h"
#include "engine/Error.h"

namespace smfree {
namespace {

// How long past an op's group timeout a wait() waits for the engine to have failed it, as
// engine::Group waits for a copy to be queued: only an engine that stopped progressing takes it.
constexpr auto kStallMargin = std::chrono::seconds(10);

}  // namespace

std::string WorkLabel::describe() const {
  if (bytes < 0) {
    return "coalesced batch";
  }
  if (isCollective()) {
    return c10::str(collective, " on rank ", rank, " (group '", *group, "', ", bytes,
                    " B in and out)");
  }
  const bool isSend = kind == engine::OpKind::kSend;
  const std::string partner = peer == engine::kAnySource
                                  ? std::string("from any rank")
                                  : c10::str(isSend ? "to rank " : "from rank ", peer);
  const std::string line = collective ? std::string(collective) : c10::str("tag ", tag);
  return c10::str(isSend ? "send" : "recv", " on rank ", rank, " ", partner, " (group '", *group,
                  "', ", line, ", ", bytes, " B)");
}

SmFreeWork::SmFreeWork(c10d::OpType type, WorkLabel label, std::vector<at::Tensor> tensors)
    : c10d::Work(-1, type),
      label_(std::move(label)),
      tensors_(std::move(tensors)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {
  // A collective's pieces are inside its range.
  if (label_.bytes >= 0 && (!label_.collective || label_.isCollective())) {
    startProfilerRange();
  }
}

namespace {

// "smfree:all_gather_into_tensor": kept for the process's life, as a range holds only a view
// of its name.
std::string_view rangeName(const char* collective) {
  static std::mutex mutex;
  static std::map<std::string, std::string> names;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = names.try_emplace(collective, c10::str("smfree:", collective)).first;
  return it->second;
}

}  // namespace

// As ProcessGroupGloo and ProcessGroupNCCL name their Works ("gloo:send"), an async range from
// the call to the op's end, so a trace shows the transfer beside the compute it overlaps. Its
// inputs, which torch.profiler(record_shapes=True) shows, are the tensor, the peer (-1: any
// source) and the bytes.
void SmFreeWork::startProfilerRange() {
  auto range = std::make_shared<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (!range->isActive()) {
    return;
  }
  range->_setAsync();
  if (label_.isCollective()) {
    const std::vector<c10::IValue> inputs{c10::IValue(tensors_), label_.bytes};
    range->before(rangeName(label_.collective), &inputs);
  } else {
    const std::vector<c10::IValue> inputs{tensors_.front(), static_cast<int64_t>(label_.peer),
                                          label_.bytes};
    range->before(label_.kind == engine::OpKind::kSend ? "smfree:send" : "smfree:recv", &inputs);
  }
  recordFunctionEndCallback_ = at::wrapPropagateTLSState([range] { range->end(); });
}

void SmFreeWork::expectOp(bool cpuWaited) {
  std::lock_guard<std::mutex> lock(stateMutex_);
  TORCH_INTERNAL_ASSERT(!sealed_, "smfree: op added to a sealed Work");
  ++pending_;
  if (cpuWaited) ++cpuPending_;
}

void SmFreeWork::addStreamFence(std::shared_ptr<engine::Group> group, int device,
                                engine::OpFence fence) {
  std::lock_guard<std::mutex> lock(stateMutex_);
  TORCH_INTERNAL_ASSERT(!sealed_, "smfree: stream fence added to a sealed Work");
  fences_.push_back(StreamFence{std::move(group), device, fence});
}

void SmFreeWork::addInFlight(std::shared_ptr<InFlightSpan> span) {
  std::lock_guard<std::mutex> lock(stateMutex_);
  TORCH_INTERNAL_ASSERT(!sealed_, "smfree: span added to a sealed Work");
  inFlight_.push_back(std::move(span));
}

void SmFreeWork::onPosted(std::chrono::milliseconds groupTimeout) {
  const auto deadline = std::chrono::steady_clock::now() + groupTimeout + kStallMargin;
  std::lock_guard<std::mutex> lock(stateMutex_);
  if (stallDeadline_ == std::chrono::steady_clock::time_point::max() ||
      deadline > stallDeadline_) {
    stallDeadline_ = deadline;
    groupTimeout_ = groupTimeout;
  }
}

void SmFreeWork::seal() {
  std::unique_lock<std::mutex> lock(stateMutex_);
  sealed_ = true;
  completeIfDone(lock);
}

void SmFreeWork::onOpDone(const engine::Status& status, int source, bool cpuWaited,
                          const WorkLabel& op) {
  std::unique_lock<std::mutex> lock(stateMutex_);
  --pending_;
  if (cpuWaited && --cpuPending_ == 0 && pending_ > 0) done_.notify_all();
  if (source >= 0) {
    source_ = source;
  }
  if (!status.ok() && !error_) {
    error_ = makeOpError(status, label_.isCollective() ? label_.describe() : std::string());
  }
  if (!status.ok() && waitReturned_ && !fences_.empty()) {
    // Only ops with a stream fence let wait() return early, so fences_ names the group. Before
    // the Work completes, so a caller that sees it completed is refused too.
    const bool isSend = op.kind == engine::OpKind::kSend;
    fences_.front().group->recordFailureAfterWait(
        c10::str(op.describe(), " failed after its wait() returned, so ",
                 isSend ? "its receiver did not get its bytes" : "its tensor holds wrong bytes",
                 ": ", status.message));
  }
  completeIfDone(lock);
}

void SmFreeWork::onMatched(int source) {
  std::lock_guard<std::mutex> lock(stateMutex_);
  source_ = source;
}

void SmFreeWork::completeIfDone(std::unique_lock<std::mutex>& lock) {
  if (!sealed_ || pending_ > 0 || finished_) {
    return;
  }
  finished_ = true;
  const std::exception_ptr error = error_;
  lock.unlock();
  if (recordFunctionEndCallback_) {
    recordFunctionEndCallback_();
  }
  done_.notify_all();
  // Future callbacks run here, on whichever thread finished the last op.
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(tensors_));
  }
}

bool SmFreeWork::isCompleted() {
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    if (finished_ || !sealed_) return finished_;
  }
  // A caller-staged recv ends only once its copies in are queued, which a poll does too.
  try {
    queueStagedCopiesInIfMatched();
  } catch (const engine::Error& error) {
    C10_THROW_ERROR(DistBackendError, c10::str("smfree: is_completed() on ", label_.describe(),
                                               ": ", error.what()));
  }
  std::lock_guard<std::mutex> lock(stateMutex_);
  return finished_;
}

bool SmFreeWork::queueStagedCopiesInIfMatched() {
  bool all = true;
  for (const StreamFence& fence : fences_) {
    if (fence.fence.queuedByWait) all = fence.group->queueCopiesInOnceMatched(fence.fence) && all;
  }
  return all;
}

bool SmFreeWork::pollCopiesIn() {
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    if (finished_) return true;
    if (!sealed_) return false;
  }
  try {
    return queueStagedCopiesInIfMatched();
  } catch (const engine::Error& error) {
    std::lock_guard<std::mutex> lock(stateMutex_);
    if (!error_) {
      error_ = std::make_exception_ptr(c10::DistBackendError(
          c10::SourceLocation{__func__, __FILE__, __LINE__},
          c10::str("smfree: ", label_.describe(), ": its copies in could not be queued for its "
                   "future: ", error.what())));
    }
    return true;
  }
}

bool SmFreeWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(stateMutex_);
  return finished_ && !error_;
}

std::exception_ptr SmFreeWork::exception() const {
  std::lock_guard<std::mutex> lock(stateMutex_);
  return error_;
}

int SmFreeWork::sourceRank() const {
  std::lock_guard<std::mutex> lock(stateMutex_);
  TORCH_CHECK(source_ >= 0, "smfree: sourceRank() is known only once a recv has matched its "
              "sender, as it has when wait() returns (", label_.describe(), ")");
  return source_;
}

std::vector<at::Tensor> SmFreeWork::result() { return tensors_; }

void SmFreeWork::checkPosted() const {
  TORCH_CHECK(sealed_, "smfree: wait on ", label_.describe(),
              " inside its coalescing block; the block's ops are posted when it ends");
}

bool SmFreeWork::wait(std::chrono::milliseconds timeout) {
  CallerRelease::drain();
  // Whatever may still take the GIL meanwhile (a Work's last reference dropped by a thread that
  // CallerRelease does not cover, a future's Python callback) must not wait for this wait.
  WithoutGil released;
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    checkPosted();
  }
  // Before anything waits: a graph being captured cannot wait for an op posted outside it,
  // nor a captured op be waited for outside its graph.
  for (const StreamFence& fence : fences_) {
    try {
      fence.group->checkWaitable(currentStream(fence.device), fence.fence);
    } catch (const engine::Error& error) {
      TORCH_CHECK(false, "smfree: wait() on ", label_.describe(), ": ", engine::reasonOf(error));
    }
  }
  // A CUDA op makes the current stream wait for its copy, as with NCCL, and the CPU waits only
  // until that copy is submitted: on the copy engines once the partner has posted, through
  // pinned host memory (UCX over TCP) once a send is cleared or a recv's copies in may be
  // queued. Other CUDA ops over UCX set `queued` only when they end, and CPU tensors are
  // waited for on the CPU: UCX is not stream-aware. A timeout makes the CPU wait for the end.
  try {
    if (timeout != kNoTimeout) {
      const auto until = std::chrono::steady_clock::now() + timeout;
      queueStagedCopiesInBy(until, timeout);
      waitFinishedBy(until, timeout);
    } else {
      waitCpuWaitedOps();
      for (const StreamFence& fence : fences_) fence.group->awaitQueued(fence.fence);
    }
  } catch (const engine::Error& error) {
    C10_THROW_ERROR(DistBackendError,
                    c10::str("smfree: wait() on ", label_.describe(), ": ", error.what()));
  }
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    if (error_) {
      std::rethrow_exception(error_);
    }
  }
  for (const StreamFence& fence : fences_) {
    try {
      fence.group->waitOnStream(currentStream(fence.device), fence.device, fence.fence);
    } catch (const engine::Error& error) {
      C10_THROW_ERROR(DistBackendError, error.what());
    }
  }
  // Under the lock that onOpDone takes: a failure is either raised here or recorded for the
  // next call, never both and never neither.
  std::lock_guard<std::mutex> lock(stateMutex_);
  if (error_) {
    std::rethrow_exception(error_);
  }
  waitReturned_ = !finished_;
  for (const auto& span : inFlight_) span->end();
  return true;
}

void* SmFreeWork::currentStream(int device) {
  const c10::Device cuda(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(cuda).native_handle();
}

template <typename Ready>
void SmFreeWork::waitUnlessStalled(std::unique_lock<std::mutex>& lock, Ready ready,
                                   const char* call) {
  if (stallDeadline_ == std::chrono::steady_clock::time_point::max()) {
    done_.wait(lock, ready);  // nothing posted to the engine
    return;
  }
  // Ops carry the group timeout, so this wait ends unless the engine has stopped.
  if (done_.wait_until(lock, stallDeadline_, ready)) return;
  throwTimeout(c10::str(
      "smfree: ", call, " on ", label_.describe(), ": not ended ",
      std::chrono::duration_cast<std::chrono::milliseconds>(kStallMargin).count(),
      " ms past its group timeout of ", groupTimeout_.count(),
      " ms, at which the engine fails an op: the smfree engine stopped progressing (its "
      "progress thread is blocked, for instance in a callback of a Work's future, or gone)"));
}

void SmFreeWork::waitFinished(const char* call) {
  std::unique_lock<std::mutex> lock(stateMutex_);
  waitUnlessStalled(lock, [this] { return finished_; }, call);
}

void SmFreeWork::waitFinishedBy(std::chrono::steady_clock::time_point until,
                                std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(stateMutex_);
  if (!done_.wait_until(lock, until, [this] { return finished_; })) throwExpired(timeout);
}

void SmFreeWork::throwExpired(std::chrono::milliseconds timeout) const {
  throwTimeout(c10::str("smfree: wait(timeout=", timeout.count(), " ms) expired; ",
                        label_.describe(), " is still pending"));
}

void SmFreeWork::queueStagedCopiesIn() {
  // Their copies in are queued by a wait(): without one they would never end.
  for (const StreamFence& fence : fences_) {
    if (fence.fence.queuedByWait) fence.group->awaitQueued(fence.fence);
  }
}

void SmFreeWork::queueStagedCopiesInBy(std::chrono::steady_clock::time_point until,
                                       std::chrono::milliseconds timeout) {
  for (const StreamFence& fence : fences_) {
    if (fence.fence.queuedByWait && !fence.group->queueCopiesInBy(fence.fence, until)) {
      throwExpired(timeout);  // still pending: a later wait() queues them
    }
  }
}

void SmFreeWork::waitCpuWaitedOps() {
  std::unique_lock<std::mutex> lock(stateMutex_);
  waitUnlessStalled(lock, [this] { return finished_ || (sealed_ && cpuPending_ == 0); },
                    "wait()");
}

void SmFreeWork::synchronize() {
  WithoutGil released;  // as in wait(); torch binds synchronize() with the GIL held
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    checkPosted();
  }
  // A captured op ends at capture; what it still owes is its part of the graph, which only a
  // stream can wait for: as NCCL's synchronize() does, make the current stream wait.
  if (std::any_of(fences_.begin(), fences_.end(), [](const StreamFence& fence) {
        return fence.fence.channel == engine::ChannelKind::kCaptured;
      })) {
    wait();
    return;
  }
  try {
    queueStagedCopiesIn();
  } catch (const engine::Error& error) {
    C10_THROW_ERROR(DistBackendError,
                    c10::str("smfree: synchronize() on ", label_.describe(), ": ", error.what()));
  }
  waitFinished("synchronize()");
  std::lock_guard<std::mutex> lock(stateMutex_);
  if (error_) {
    std::rethrow_exception(error_);
  }
}

c10::intrusive_ptr<c10::ivalue::Future> SmFreeWork::getFuture() {
  // Inside a coalescing block its fences are not all known yet: polled until it is posted.
  bool polled = false;
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    polled = !finished_ && (!sealed_ || std::any_of(fences_.begin(), fences_.end(),
                                                     [](const StreamFence& fence) {
                                                       return fence.fence.queuedByWait;
                                                     }));
  }
  if (polled && !polledForFuture_.exchange(true)) {
    FuturePoller::watch(c10::intrusive_ptr<SmFreeWork>::reclaim_copy(this));
  }
  return future_;
}

}  // namespace smfree
