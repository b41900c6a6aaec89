#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backend/SelfWork.h"
#include "engine/TensorDesc.h"
#include "engine/cuda/Copies.h"

namespace smfree {

// Sends and recvs whose peer is this rank itself, as the V-shaped pipeline schedules post them
// (a rank holds two stages, one feeding the other). Their bytes never leave the process, so the
// engine never sees them: they are matched here, per tag in posting order like any other
// peer's, and moved: a memmove for CPU tensors; for CUDA tensors the engine's copy
// (cuda/Copies.h, as SMFREE_LOCAL_COPIES says) on the later-posted op's current stream, after
// the earlier op's stream as it was when that op was posted. A recv from any source does not
// take them.
class SelfExchange {
 public:
  using Clock = std::chrono::steady_clock;

  // One op, checked and not yet posted.
  struct Op {
    c10::intrusive_ptr<SelfWork> work;
    c10::Storage storage;  // held until the copy is done: the caller may drop the tensor
    void* data = nullptr;
    engine::TensorDesc desc;
    std::optional<c10::Event> posted;  // a CUDA op's stream, as it was when the op was queued
    // A CUDA op: the CUDA graph capture its stream took part in at the call, if any. Two ops
    // meet only within one capture, or both outside any: a graph waits only for its own work.
    std::optional<uint64_t> capture;
    Clock::time_point queuedAt;
    Clock::time_point deadline;
  };

  explicit SelfExchange(std::string groupName);
  ~SelfExchange();  // fails the ops not matched and waits for the copies on the GPU
  SelfExchange(const SelfExchange&) = delete;
  SelfExchange& operator=(const SelfExchange&) = delete;

  // `batch`, if set, is the coalesced batch the op also reports to.
  std::shared_ptr<Op> prepare(const WorkLabel& label, const at::Tensor& tensor,
                              const c10::intrusive_ptr<SmFreeWork>& batch) const;
  // Matches the op with the oldest unmatched opposite op of its tag, or queues it until
  // `timeout`. Never throws: failures go to the op's Work.
  void post(const std::shared_ptr<Op>& op, std::chrono::milliseconds timeout);
  // Fails every op not matched with `reason`; later posts fail the same way.
  void close(const std::string& reason);
 private:
  using Queue = std::map<int, std::deque<std::shared_ptr<Op>>>;  // by tag, in posting order
  // A CUDA copy submitted to the GPU, held until it has run.
  struct InFlight {
    std::shared_ptr<c10::Event> copied;
    std::shared_ptr<Op> send;
    std::shared_ptr<Op> recv;
    std::optional<std::string> failure;  // why the GPU will not run it
  };

  // The oldest unmatched op opposite to `op` on its tag, or null after queueing `op`.
  std::shared_ptr<Op> matchOrQueue(const std::shared_ptr<Op>& op,
                                   std::chrono::milliseconds timeout);
  void exchange(const std::shared_ptr<Op>& send, const std::shared_ptr<Op>& recv,
                const std::shared_ptr<Op>& earlier);
  void copyOnGpu(const std::shared_ptr<Op>& send, const std::shared_ptr<Op>& recv,
                 const std::shared_ptr<Op>& earlier);
  // The copy of `send`'s bytes into `recv`'s on `stream`, with copy engines only.
  static void queueCopy(const Op& send, const Op& recv, CUstream stream, int device);
  std::string mismatch(const Op& send, const Op& recv) const;
  std::string captureMismatch(const Op& send, const Op& recv) const;
  void startWatcher();  // under mutex_
  // Fails the ops past their deadline and finishes the copies the GPU has run.
  void watch();
  // When the watcher next has something to do. Under mutex_.
  std::optional<Clock::time_point> nextWake(Clock::time_point now) const;
  std::vector<std::shared_ptr<Op>> takeExpired(Clock::time_point now);  // under mutex_
  std::vector<InFlight> takeCopied();                                  // under mutex_
  static void expire(const Op& op, Clock::time_point now);
  static void finishCopied(const InFlight& copy);

  const std::string groupName_;
  std::mutex mutex_;
  std::condition_variable wake_;
  Queue sends_;
  Queue recvs_;
  std::vector<InFlight> inFlight_;
  std::optional<std::string> closed_;
  bool stopping_ = false;
  std::thread watcher_;  // started by the first op that waits
};

}  // namespace smfree
