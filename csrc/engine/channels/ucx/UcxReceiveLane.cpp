#include "engine/channels/ucx/UcxReceiveLane.h"

#include <poll.h>
#include <sys/prctl.h>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/cuda/Capture.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine {
namespace {

// Longest sleep: stop() wakes the thread through the worker, this only bounds a missed wake.
constexpr int kIdleSleepMs = 100;

}  // namespace

UcxReceiveLane::UcxReceiveLane(const UcxContext& context, const Spin& spin)
    : worker_(context, UcxWorker::Threads::kShared), spin_(spin), thread_([this] { run(); }) {}

UcxReceiveLane::~UcxReceiveLane() { stop(); }

void UcxReceiveLane::stop() {
  if (stopping_.exchange(true)) return;
  worker_.signal();
  thread_.join();
}

void UcxReceiveLane::cancel(const std::vector<void*>& requests) {
  std::lock_guard<std::mutex> lock(progressing_);
  for (void* request : requests) ucp_request_cancel(worker_.handle(), request);
}

bool UcxReceiveLane::progressOnce() {
  std::lock_guard<std::mutex> lock(progressing_);
  return worker_.progress() != 0;
}

void UcxReceiveLane::run() {
  prctl(PR_SET_NAME, "smfree-recv");
  prctl(PR_SET_TIMERSLACK, 1000UL);  // as the engine's thread: every landed piece passes here
  cuda::markEngineThread();
  cuda::relaxOnceCudaIsLoaded();
  cuda::CurrentContext context;
  auto lastActivity = std::chrono::steady_clock::now();
  while (!stopping_.load(std::memory_order_acquire)) {
    if (const int device = cudaDevice_.load(std::memory_order_relaxed); device >= 0) {
      try {
        context.use(device);
      } catch (const Error& error) {
        logOnce("receive-lane-context", concat("UCX receive thread: ", error.what()));
      }
    }
    bool active = false;
    try {
      while (progressOnce()) active = true;
    } catch (const std::exception& error) {
      // No exception may end the thread: the transfers it serves fail at their timeouts.
      logOnce(concat("receive lane ", error.what()), concat("UCX receive thread: ", error.what()),
              LogLevel::kError);
    }
    const auto now = std::chrono::steady_clock::now();
    if (active) {
      lastActivity = now;
      continue;
    }
    if (now - lastActivity < spin_.get() || !worker_.arm()) continue;
    cuda::relaxOnceCudaIsLoaded();  // idle: its wake-up may bring UCX's first CUDA calls
    pollfd event{worker_.eventFd(), POLLIN, 0};
    poll(&event, 1, kIdleSleepMs);
  }
}

}  // namespace smfree::engine
