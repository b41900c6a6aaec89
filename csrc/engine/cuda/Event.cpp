#include "engine/cuda/Event.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <mutex>
#include <vector>

#include "engine/Error.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine::cuda {
namespace {

struct EventPool {
  std::mutex mutex;
  std::map<int, std::vector<std::unique_ptr<Event>>> idle;  // by device

  // Runs only at process exit, among static destructors, when the CUDA driver and the
  // contexts may be torn down already (destroying events then crashed a process).
  // The process's end frees them.
  ~EventPool() {
    for (auto& [device, events] : idle) {
      for (auto& event : events) static_cast<void>(event.release());
    }
  }
};

// Shared with every event out of it, so it outlives the last one even at process exit.
const std::shared_ptr<EventPool>& eventPool() {
  static const auto pool = std::make_shared<EventPool>();
  return pool;
}

}  // namespace

Event::Event(int device) : device_(device) {
  ContextGuard context(device_);
  check(driver().cuEventCreate(&event_, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
}

Event::~Event() {
  // A record or wait still queued keeps what it needs: the driver frees the event after it.
  // At process exit the driver may be gone already; then there is nothing left to free.
  try {
    ContextGuard context(device_);
    driver().cuEventDestroy(event_);
  } catch (const Error&) {
  }
}

void Event::record(CUstream stream) {
  knownReached_.store(false, std::memory_order_release);
  ContextGuard context(device_);
  check(driver().cuEventRecord(event_, stream), "cuEventRecord");
}

void Event::waitOn(CUstream stream) const {
  ContextGuard context(device_);
  check(driver().cuStreamWaitEvent(stream, event_, CU_EVENT_WAIT_DEFAULT), "cuStreamWaitEvent");
}

bool Event::reached() const {
  if (knownReached()) {
    return true;
  }
  ContextGuard context(device_);
  const CUresult result = driver().cuEventQuery(event_);
  if (result == CUDA_ERROR_NOT_READY) {
    return false;
  }
  check(result, "cuEventQuery");
  knownReached_.store(true, std::memory_order_release);
  return true;
}

std::shared_ptr<Event> takeEvent(int device) {
  std::shared_ptr<EventPool> pool = eventPool();
  std::unique_ptr<Event> event;
  {
    // Only an event whose last record has run: a wait on a record still queued (a failed
    // send's) would make the new holder's stream depend on unrelated work.
    std::lock_guard<std::mutex> lock(pool->mutex);
    auto& idle = pool->idle[device];
    auto free = std::find_if(idle.rbegin(), idle.rend(),
                             [](const std::unique_ptr<Event>& e) { return e->knownReached(); });
    if (free == idle.rend()) {
      free = std::find_if(idle.rbegin(), idle.rend(),
                          [](const std::unique_ptr<Event>& e) { return e->reached(); });
    }
    if (free != idle.rend()) {
      event = std::move(*free);
      idle.erase(std::next(free).base());
    }
  }
  if (!event) {
    event = std::make_unique<Event>(device);
  }
  // The deleter owns it from here on, even if the shared_ptr cannot be built.
  return std::shared_ptr<Event>(event.release(), [pool](Event* returned) {
    std::unique_ptr<Event> owned(returned);
    std::lock_guard<std::mutex> lock(pool->mutex);
    pool->idle[owned->device()].push_back(std::move(owned));
  });
}

}  // namespace smfree::engine::cuda
