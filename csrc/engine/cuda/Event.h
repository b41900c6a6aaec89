#pragma once

#include <cuda.h>

#include <atomic>
#include <memory>

namespace smfree::engine::cuda {

// A CUDA event of one device, without timing: how a send's streams signal each other inside
// this process (far cheaper on a copy-engine queue than a memory write; see CopyEngineOp.h).
class Event {
 public:
  explicit Event(int device);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Both take the device's context: callers may hold another.
  void record(CUstream stream);
  // Makes `stream` wait for the last record, which must already be submitted.
  void waitOn(CUstream stream) const;
  // True once the last record has run on the GPU (or if it was never recorded).
  bool reached() const;
  // Whether the last record is known to have run, without asking the driver: reached() said
  // so, or a holder called markReached().
  bool knownReached() const { return knownReached_.load(std::memory_order_acquire); }
  // For a holder that saw later work, which waited for the last record, finish.
  void markReached() { knownReached_.store(true, std::memory_order_release); }
  int device() const { return device_; }

 private:
  int device_;
  CUevent event_ = nullptr;
  mutable std::atomic<bool> knownReached_{true};
};

// An event of `device` from the process's pool; it goes back there when its last holder
// drops it, and is handed out again once its last record has run. Creating and destroying two
// events per send cost more CPU time than the rest of posting it. A reused event is safe:
// waits already queued keep the record they were given. Events known to have run are handed
// out first: asking the driver cost about 2 µs per event on the path that posts a send.
std::shared_ptr<Event> takeEvent(int device);

}  // namespace smfree::engine::cuda
