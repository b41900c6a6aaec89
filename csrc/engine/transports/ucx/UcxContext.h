#pragma once

#include <ucp/api/ucp.h>

#include <atomic>

#include "engine/Config.h"

namespace smfree::engine {

// The process's UCX context, with smfree's changes to UCX's defaults. Its workers run on
// different threads. It outlives them: a worker left alive (UcxChannel's receive worker, where
// UCX still tracks a recv it can neither end nor cancel) keeps the context to the process's end.
class UcxContext {
 public:
  explicit UcxContext(const Config& config);
  ~UcxContext();
  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;

  ucp_context_h handle() const { return context_; }
  // A worker of the context was created, or destroyed (UcxWorker).
  void workerCreated() const { workers_.fetch_add(1); }
  void workerDestroyed() const { workers_.fetch_sub(1); }

 private:
  ucp_context_h context_ = nullptr;
  mutable std::atomic<int> workers_{0};
};

}  // namespace smfree::engine
