#include "engine/ProgressThread.h"

#include "engine/Error.h"

namespace smfree::engine {

void ProgressThread::check(const char* method) const {
  const std::thread::id owner = owner_.load(std::memory_order_acquire);
  if (owner != std::thread::id() && owner != std::this_thread::get_id()) {
    fail("internal error: ", method, " was called off the engine's progress thread");
  }
}

}  // namespace smfree::engine
