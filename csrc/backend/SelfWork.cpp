#include "backend/SelfWork.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "backend/Errors.h"
#include "backend/WithoutGil.h"

namespace smfree {

SelfWork::SelfWork(WorkLabel label, at::Tensor tensor, int device,
                   c10::intrusive_ptr<SmFreeWork> batch)
    : c10d::Work(-1, label.kind == engine::OpKind::kSend ? c10d::OpType::SEND
                                                         : c10d::OpType::RECV),
      label_(std::move(label)),
      tensors_{std::move(tensor)},
      device_(device),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))),
      batch_(std::move(batch)) {}

void SelfWork::onQueued(std::shared_ptr<c10::Event> copied) {
  std::lock_guard<std::mutex> lock(stateMutex_);
  copied_ = std::move(copied);
  queued_ = true;
  changed_.notify_all();
}

void SelfWork::finish(const engine::Status& status) {
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    if (finished_) return;
    finished_ = true;
    queued_ = true;
    if (!status.ok()) error_ = makeOpError(status);
    error = error_;
  }
  changed_.notify_all();
  const bool isSend = label_.kind == engine::OpKind::kSend;
  if (auto batch = batch_.lock()) {
    batch->onOpDone(status, isSend ? -1 : label_.rank, !onCuda(), label_);
  }
  // Future callbacks run here, on whichever thread finished the op.
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(tensors_));
  }
}

bool SelfWork::isCompleted() {
  std::lock_guard<std::mutex> lock(stateMutex_);
  return finished_;
}

bool SelfWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(stateMutex_);
  return finished_ && !error_;
}

std::exception_ptr SelfWork::exception() const {
  std::lock_guard<std::mutex> lock(stateMutex_);
  return error_;
}

int SelfWork::sourceRank() const {
  std::lock_guard<std::mutex> lock(stateMutex_);
  TORCH_CHECK(label_.kind == engine::OpKind::kRecv && queued_ && !error_,
              "smfree: sourceRank() is known only once a recv has matched its sender, as it has "
              "when wait() returns (", label_.describe(), ")");
  return label_.rank;
}

std::vector<at::Tensor> SelfWork::result() { return tensors_; }

void SelfWork::throwIfFailed() const {
  if (error_) std::rethrow_exception(error_);
}

bool SelfWork::wait(std::chrono::milliseconds timeout) {
  WithoutGil released;
  {
    std::unique_lock<std::mutex> lock(stateMutex_);
    if (timeout == kNoTimeout) {
      // As for other CUDA ops, the CPU waits only until the copy is submitted. An unmatched op
      // fails at the group timeout (SelfExchange), so this wait ends.
      changed_.wait(lock, [this] { return queued_; });
    } else if (!changed_.wait_for(lock, timeout, [this] { return finished_; })) {
      throwTimeout(c10::str("smfree: wait(timeout=", timeout.count(), " ms) expired; ",
                            label_.describe(), " is still pending"));
    }
    throwIfFailed();
  }
  fenceCurrentStream();
  return true;
}

void SelfWork::fenceCurrentStream() const {
  std::shared_ptr<c10::Event> copied;
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    copied = copied_;
  }
  if (!copied) return;  // a CPU op, or a CUDA one with nothing to copy
  const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_));
  copied->block(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device));
}

void SelfWork::synchronize() {
  WithoutGil released;  // as SmFreeWork::wait(): the copy's end may need another thread's GIL
  std::unique_lock<std::mutex> lock(stateMutex_);
  changed_.wait(lock, [this] { return finished_; });
  throwIfFailed();
}

c10::intrusive_ptr<c10::ivalue::Future> SelfWork::getFuture() { return future_; }

}  // namespace smfree
