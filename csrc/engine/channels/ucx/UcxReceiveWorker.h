#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/Spin.h"
#include "engine/transports/ucx/UcxContext.h"
#include "engine/transports/ucx/UcxWorker.h"

namespace smfree::engine {

// The UCX worker that recvs are posted on, progressed by a thread of its own, so that the
// bytes of recvs move beside those of sends, which the engine's progress thread drives. Over
// TCP each byte costs a socket copy on both sides; with one thread for both directions, a rank
// that exchanged with two peers spent that thread fully (70 % of it in the kernel) and took
// about twice as long as with one peer.
//
// Recvs are posted and cancelled from the engine's progress thread (the worker is shared);
// their callbacks run here or inside those calls.
//
// Cancelling goes through cancel(), between two of this thread's progress calls: UCX (1.13
// to 1.22) checks whether a request has completed before it takes the worker's lock, so a
// request that completed here in between made ucp_request_cancel fail its assertion that the
// request is not complete, and abort the process.
class UcxReceiveWorker {
 public:
  UcxReceiveWorker(const UcxContext& context, const Spin& spin);
  ~UcxReceiveWorker();
  UcxReceiveWorker(const UcxReceiveWorker&) = delete;
  UcxReceiveWorker& operator=(const UcxReceiveWorker&) = delete;

  UcxWorker& worker() { return worker_; }
  // Cancels recvs posted on the worker whose completions the caller has not applied yet (so
  // none is freed); a request that completed meanwhile is left as it is.
  void cancel(const std::vector<void*>& requests);
  // UCX's CUDA transports copy in the current context: from now on, this device's.
  void useCudaDevice(int device) { cudaDevice_.store(device, std::memory_order_relaxed); }
  // Joins the thread; recvs still posted stay in the worker.
  void stop();

 private:
  void run();
  // One call of the worker's progress; whether it did anything.
  bool progressOnce();

  UcxWorker worker_;
  const Spin& spin_;
  std::atomic<int> cudaDevice_{-1};
  std::atomic<bool> stopping_{false};
  std::mutex progressing_;  // held by this thread's progress calls, and by cancel()
  std::thread thread_;
};

}  // namespace smfree::engine
