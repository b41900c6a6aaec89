#pragma once

#include <ucp/api/ucp.h>

#include "engine/Config.h"

namespace smfree::engine {

// The process's UCX context, with smfree's changes to UCX's defaults. Its workers run on
// different threads.
class UcxContext {
 public:
  explicit UcxContext(const Config& config);
  ~UcxContext();
  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;

  ucp_context_h handle() const { return context_; }

 private:
  ucp_context_h context_ = nullptr;
};

}  // namespace smfree::engine
