#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>
#include <c10/core/Event.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "backend/SmFreeWork.h"
#include "engine/Status.h"

namespace smfree {

// The Work of a send or recv whose peer is this rank itself (see SelfExchange). It moves
// through pending (not matched) -> queued (the copy is submitted) -> finished. A CPU op
// is queued and finished at once; a CUDA op finishes once its copy has run on the GPU.
class SelfWork final : public c10d::Work {
 public:
  // `device`: the CUDA device of the tensor, -1 for a CPU tensor. `batch`, if set, is the
  // coalesced batch the op also reports to.
  SelfWork(WorkLabel label, at::Tensor tensor, int device, c10::intrusive_ptr<SmFreeWork> batch);

  const WorkLabel& label() const { return label_; }
  bool onCuda() const { return device_ >= 0; }
  // The copy of a CUDA op is submitted; `copied` is recorded after it.
  void onQueued(std::shared_ptr<c10::Event> copied);
  // The op ended: copied, or failed with `status`.
  void finish(const engine::Status& status);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  void throwIfFailed() const;  // under stateMutex_
  // Makes the caller's current stream wait for the copy of a CUDA op.
  void fenceCurrentStream() const;

  const WorkLabel label_;
  const std::vector<at::Tensor> tensors_;
  const int device_;
  const c10::intrusive_ptr<c10::ivalue::Future> future_;

  mutable std::mutex stateMutex_;
  std::condition_variable changed_;
  bool queued_ = false;
  bool finished_ = false;
  std::exception_ptr error_;
  std::shared_ptr<c10::Event> copied_;
  // Weak: the batch holds this Work (SmFreeWork::addWaitedWork), and nobody waits on a batch
  // whose Work is gone.
  const c10::weak_intrusive_ptr<SmFreeWork> batch_;
};

}  // namespace smfree
