#include "engine/ProgressLoop.h"

#include <sys/prctl.h>

#include "engine/Log.h"
#include "engine/OpControl.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine {
namespace {

constexpr auto kExpiryScanInterval = std::chrono::milliseconds(20);
// UCX progress calls per turn: peers that keep sending cannot hold the thread in UCX (nor grow
// the messages it holds for deliver()) past this; the rest waits for the next turn.
constexpr int kMostWorkerProgressPerTurn = 1024;
// How often exported CUDA memory is checked for having been freed: what a peer's mapping
// keeps of the memory after the allocator released it is held for about this long.
constexpr auto kExportSweepInterval = std::chrono::milliseconds(50);
// Longest sleep, so expiry is noticed promptly while idle.
constexpr timespec kIdleSleep{0, 50'000'000};
// While copies are pending the thread also watches memory, which wakes no fd: it waits for
// its fds at most this long.
constexpr timespec kMemoryWatchNap{0, 20'000};

}  // namespace

ProgressLoop::ProgressLoop(const Spin& spin, ControlTransport& control, Channels& channels,
                           PeerLinks& peers, OpControl& opControl, CudaOps& cudaOps,
                           ProgressThread& thread)
    : spin_(spin),
      control_(control),
      channels_(channels),
      peers_(peers),
      opControl_(opControl),
      cudaOps_(cudaOps),
      thread_(thread),
      progress_([this] { run(); }) {
  thread_.setOwner(progress_.get_id());
}

void ProgressLoop::stop() {
  {
    std::lock_guard<std::mutex> lock(commandsMutex_);
    if (stopping_) {
      return;
    }
    stopping_ = true;
  }
  control_.signal();
  if (progress_.joinable()) {
    progress_.join();
  }
  thread_.setOwner(std::thread::id());
}

void ProgressLoop::submit(std::function<void()> command) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(commandsMutex_);
    if (stopping_) {
      fail("the engine has shut down");
    }
    commands_.push_back(std::move(command));
    wake = sleeping_;
  }
  if (wake) {
    control_.signal();
  }
}

void ProgressLoop::run() {
  // Every hop of a rendezvous passes through this thread: a sleep that overshoots by the
  // default 50 µs timer slack showed up as +10 % pipeline step time.
  prctl(PR_SET_TIMERSLACK, 1000UL);
  prctl(PR_SET_NAME, "smfree-progress");  // what top -H and py-spy show for this thread
  cuda::markEngineThread();
  cuda::relaxOnceCudaIsLoaded();
  const auto now = Clock::now();
  Clocks clocks{now, now, now, now};
  // UCX pins host memory for CUDA copies only while a context is current (cuda_copy's
  // registration is a no-op otherwise), and it allocates its host staging fragments from
  // inside worker progress. Unpinned fragments halved host-staged bandwidth, so once a CUDA
  // buffer has gone to UCX its device's context stays current on this thread.
  cuda::CurrentContext channelContext;
  for (;;) {
    try {
      if (!turn(clocks, channelContext)) return;
    } catch (const std::exception& error) {
      survive(error);
    }
  }
}

bool ProgressLoop::turn(Clocks& clocks, cuda::CurrentContext& channelContext) {
  if (!runCommands()) return false;
  bool active = false;
  channels_.forEach(Capability::kProgress, [&](Channel& channel) {
    const Progress progress = channel.progress();
    active = progress.active || active;
    if (progress.contextDevice >= 0) channelContext.use(progress.contextDevice);
  });
  for (int calls = 0; calls < kMostWorkerProgressPerTurn && control_.progress() != 0; ++calls) {
    active = true;
  }
  // What UCX's callbacks held inside that progress, handled outside it: the control messages
  // that arrived, then the peer failures it reported (a peer's messages came before its end).
  active = control_.deliver() || active;
  active = peers_.applyReported() || active;
  const auto now = Clock::now();
  if (active) {
    clocks.activity = now;
  }
  if (now - clocks.scan >= kExpiryScanInterval) {
    clocks.scan = now;
    cuda::relaxOnceCudaIsLoaded();
    peers_.check();
    cudaOps_.recycle();
    opControl_.probeSilentPeers(now);
    opControl_.expireOps(now);
  }
  if (now - clocks.sweep >= kExportSweepInterval) {
    clocks.sweep = now;
    channels_.forEach(Capability::kSweep, [](Channel& channel) { channel.sweep(); });
  }
  // Polling serves callers waiting on this thread; ops whose wait() returns at once (eager
  // sends, collective lanes' pieces) keep no thread awake for themselves.
  if (opControl_.opsAwaitingProgress() > 0) clocks.awaited = now;
  const bool polling = now - clocks.activity < spin_.get() && now - clocks.awaited < spin_.get();
  if (polling || !control_.arm()) {
    return true;
  }
  {
    // The worker is armed: from here on a submitter must fire its event fd.
    std::lock_guard<std::mutex> lock(commandsMutex_);
    if (!commands_.empty() || stopping_) {
      return true;
    }
    sleeping_ = true;
  }
  sleep();
  return true;
}

void ProgressLoop::survive(const std::exception& error) {
  logOnce(concat("progress ", error.what()),
          concat("the progress thread caught an error no op was there to take, and goes on: ",
                 error.what()),
          LogLevel::kError);
}

bool ProgressLoop::runCommands() {
  std::deque<std::function<void()>> batch;
  {
    std::lock_guard<std::mutex> lock(commandsMutex_);
    if (stopping_) {
      return false;
    }
    sleeping_ = false;
    batch.swap(commands_);
  }
  for (auto& command : batch) {
    try {
      command();
    } catch (const std::exception& error) {
      log(LogLevel::kError, "internal command failed: ", error.what());
    }
  }
  return true;
}

void ProgressLoop::sleep() {
  // Submitters signal the worker, which fires its armed event fd; a same-host peer's exit
  // fires its pidfd. Flags in memory fire nothing, so while copies are in flight the wait
  // is short.
  std::vector<pollfd>& events = sleepEvents_;  // reused: this runs every 20 µs while busy
  events.assign(1, pollfd{control_.eventFd(), POLLIN, 0});
  peers_.appendWatchFds(events);
  const timespec& timeout = channels_.busy() ? kMemoryWatchNap : kIdleSleep;
  if (ppoll(events.data(), events.size(), &timeout, nullptr) > 0 && events.size() > 1) {
    peers_.check();
  }
}

}  // namespace smfree::engine
