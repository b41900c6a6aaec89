#include "engine/channels/ucx/UcxReceiveWorker.h"

#include <poll.h>
#include <sys/prctl.h>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine {
namespace {

// Longest sleep: stop() wakes the thread through the worker, this only bounds a missed wake.
constexpr int kIdleSleepMs = 100;

}  // namespace

UcxReceiveWorker::UcxReceiveWorker(const UcxContext& context, const Spin& spin)
    : worker_(context, UcxWorker::Threads::kShared), spin_(spin), thread_([this] { run(); }) {}

UcxReceiveWorker::~UcxReceiveWorker() { stop(); }

void UcxReceiveWorker::stop() {
  if (stopping_.exchange(true)) return;
  worker_.signal();
  thread_.join();
}

void UcxReceiveWorker::cancel(const std::vector<void*>& requests) {
  std::lock_guard<std::mutex> lock(progressing_);
  for (void* request : requests) ucp_request_cancel(worker_.handle(), request);
}

bool UcxReceiveWorker::progressOnce() {
  std::lock_guard<std::mutex> lock(progressing_);
  return worker_.progress() != 0;
}

void UcxReceiveWorker::run() {
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
        logOnce("receive-worker-context", concat("UCX receive thread: ", error.what()));
      }
    }
    bool active = false;
    try {
      while (progressOnce()) active = true;
    } catch (const std::exception& error) {
      // No exception may end the thread: the transfers it serves fail at their timeouts.
      logOnce(concat("receive worker ", error.what()), concat("UCX receive thread: ", error.what()),
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
