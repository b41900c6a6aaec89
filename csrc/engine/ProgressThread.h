#pragma once

#include <atomic>
#include <thread>

namespace smfree::engine {

// Which thread may touch the engine's progress-thread state: the progress thread while it
// runs; before it starts and once it has been joined, the thread that owns the engine (its
// constructor and destructor).
class ProgressThread {
 public:
  // Throws Error naming `method` on any other thread.
  void check(const char* method) const;
  // The progress thread started (its id) or was joined (no id).
  void setOwner(std::thread::id owner) { owner_.store(owner, std::memory_order_release); }

 private:
  std::atomic<std::thread::id> owner_{};
};

}  // namespace smfree::engine
