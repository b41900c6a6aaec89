#pragma once

#include <poll.h>

#include <chrono>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/Channels.h"
#include "engine/ControlTransport.h"
#include "engine/CudaOps.h"
#include "engine/Error.h"
#include "engine/PeerLinks.h"
#include "engine/ProgressThread.h"
#include "engine/Spin.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine {

class OpControl;

// The progress thread: runs the commands other threads submit, drives the channels and the
// control transport (the engine's UCX worker), scans for expired ops and dead peers, and
// sleeps on the transport's event fd (and same-host peers' pidfds) when idle.
class ProgressLoop {
 public:
  ProgressLoop(const Spin& spin, ControlTransport& control, Channels& channels, PeerLinks& peers,
               OpControl& opControl, CudaOps& cudaOps, ProgressThread& thread);
  ~ProgressLoop() { stop(); }
  ProgressLoop(const ProgressLoop&) = delete;
  ProgressLoop& operator=(const ProgressLoop&) = delete;

  // Any thread: runs `command` on the progress thread. Throws once the loop has stopped.
  void submit(std::function<void()> command);
  // Any thread: runs `command` there and returns its result or rethrows its error; throws if it
  // did not finish within `timeout`.
  template <typename T>
  T call(std::function<T()> command, std::chrono::milliseconds timeout, const char* what);
  // Joins the thread; commands are refused from here on.
  void stop();

 private:
  // When the loop last did something, and last ran its timed scans.
  struct Clocks {
    Clock::time_point activity;
    Clock::time_point awaited;  // last seen with an op a caller's wait() may wait for
    Clock::time_point scan;
    Clock::time_point sweep;
  };

  void run();
  // One pass: commands, channels, the worker, the timed scans, and sleep when idle; false
  // once stopping.
  bool turn(Clocks& clocks, cuda::CurrentContext& channelContext);
  // What a pass threw: logged once per message, and the loop goes on. What can fail an op is
  // caught where the op is known; this keeps the thread alive for the rest.
  void survive(const std::exception& error);
  bool runCommands();
  void sleep();

  const Spin& spin_;
  ControlTransport& control_;
  Channels& channels_;
  PeerLinks& peers_;
  OpControl& opControl_;
  CudaOps& cudaOps_;
  ProgressThread& thread_;

  std::mutex commandsMutex_;
  std::deque<std::function<void()>> commands_;
  bool stopping_ = false;
  // The progress thread is in (or about to enter) its poll and needs its event fd fired to
  // see new commands. While it spins it does not: the signal is a syscall of about 1 µs on
  // the path that posts every op.
  bool sleeping_ = false;
  std::vector<pollfd> sleepEvents_;  // progress thread only
  std::thread progress_;             // last: it starts once the rest is in place
};

template <typename T>
T ProgressLoop::call(std::function<T()> command, std::chrono::milliseconds timeout,
                     const char* what) {
  auto promise = std::make_shared<std::promise<T>>();
  auto future = promise->get_future();
  submit([promise, command = std::move(command)] {
    try {
      if constexpr (std::is_void_v<T>) {
        command();
        promise->set_value();
      } else {
        promise->set_value(command());
      }
    } catch (...) {
      promise->set_exception(std::current_exception());
    }
  });
  if (future.wait_for(timeout) != std::future_status::ready) {
    fail(what, " did not finish within ", timeout.count(), " ms");
  }
  return future.get();
}

}  // namespace smfree::engine
