#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <vector>

#include "engine/transports/ucx/UcxContext.h"
#include "engine/transports/ucx/UcxStatus.h"

namespace smfree::engine {

// A UCX worker with its event fd. A single-threaded one is driven by one thread only
// (ucp_worker_signal, the one exception, is safe from any thread); a shared one takes posts
// from other threads than the one that progresses it (cancels: see UcxReceiveWorker).
class UcxWorker {
 public:
  enum class Threads { kSingle, kShared };

  UcxWorker(const UcxContext& context, Threads threads);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  ucp_worker_h handle() const { return worker_; }
  const std::vector<uint8_t>& address() const { return address_; }
  unsigned progress() { return ucp_worker_progress(worker_); }
  // True when the event fd will fire on the next event; false if events are already pending.
  bool arm();
  int eventFd() const { return eventFd_; }
  void signal() { ucp_worker_signal(worker_); }

 private:
  const UcxContext& context_;
  ucp_worker_h worker_ = nullptr;
  int eventFd_ = -1;
  std::vector<uint8_t> address_;
};

}  // namespace smfree::engine
