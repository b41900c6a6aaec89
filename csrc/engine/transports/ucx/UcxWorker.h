#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine/Config.h"

namespace smfree::engine {

std::string ucxStatusText(ucs_status_t status);

// The process's UCX context and its one worker, driven only by the progress thread
// (ucp_worker_signal, the one exception, is safe from any thread).
class UcxWorker {
 public:
  explicit UcxWorker(const Config& config);
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
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int eventFd_ = -1;
  std::vector<uint8_t> address_;
};

}  // namespace smfree::engine
