#include "backend/FuturePoller.h"

#include <sys/prctl.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "backend/CallerRelease.h"
#include "backend/SmFreeWork.h"

namespace smfree {
namespace {

// As often as a caller's wait() polls for the match before it naps.
constexpr auto kPollPeriod = std::chrono::microseconds(50);

using Works = std::vector<c10::intrusive_ptr<SmFreeWork>>;

struct Watched {
  std::mutex mutex;
  std::condition_variable added;
  Works works;
  bool pollerStarted = false;
};

// Never destroyed: the poller may still run at exit.
Watched& watched() {
  static auto* all = new Watched();
  return *all;
}

// One pass: the Works still to poll. Those done go to CallerRelease, since dropping a Work's
// last reference may take the GIL.
Works pollOnce(Works works) {
  Works pending;
  for (auto& work : works) {
    if (work->pollCopiesIn()) {
      CallerRelease::handBackNow(std::move(work));
    } else {
      pending.push_back(std::move(work));
    }
  }
  return pending;
}

void pollWatched() {
  prctl(PR_SET_NAME, "smfree-futures");
  Watched& all = watched();
  std::unique_lock<std::mutex> lock(all.mutex);
  for (;;) {
    all.added.wait(lock, [&] { return !all.works.empty(); });
    Works works;
    works.swap(all.works);
    lock.unlock();
    Works pending = pollOnce(std::move(works));
    if (!pending.empty()) std::this_thread::sleep_for(kPollPeriod);
    lock.lock();
    for (auto& work : pending) all.works.push_back(std::move(work));
  }
}

}  // namespace

void FuturePoller::watch(c10::intrusive_ptr<SmFreeWork> work) {
  Watched& all = watched();
  std::lock_guard<std::mutex> lock(all.mutex);
  all.works.push_back(std::move(work));
  // Started at the first such future, so a process that asks for none has no extra thread.
  if (!all.pollerStarted) {
    all.pollerStarted = true;
    std::thread(pollWatched).detach();
  }
  all.added.notify_one();
}

}  // namespace smfree
