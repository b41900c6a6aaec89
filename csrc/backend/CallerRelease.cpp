#include "backend/CallerRelease.h"

#include <sys/prctl.h>

#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace smfree {
namespace {

struct HandedBack {
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<std::function<void()>> drops;
  bool dropperStarted = false;
  bool dropperRunning = false;
  bool stopping = false;
};

// Never destroyed: what is left at exit stays, rather than reach Python as it finalizes.
HandedBack& handedBack() {
  static auto* handed = new HandedBack();
  return *handed;
}

std::vector<std::function<void()>> takeAll(HandedBack& handed) {
  std::vector<std::function<void()>> drops;
  drops.swap(handed.drops);
  return drops;
}

// Outside the lock: a drop may hand back more.
void run(std::vector<std::function<void()>>& drops) {
  for (auto& drop : drops) drop();
}

// The dropper's loop: drops what is handed back as it comes. It may wait for the GIL (torch
// takes it to drop a tensor whose Python object lives), and nothing waits for it.
void dropAsHanded() {
  prctl(PR_SET_NAME, "smfree-release");
  HandedBack& handed = handedBack();
  std::unique_lock<std::mutex> lock(handed.mutex);
  while (!handed.stopping) {
    if (handed.drops.empty()) {
      handed.changed.wait(lock);
      continue;
    }
    auto drops = takeAll(handed);
    lock.unlock();
    run(drops);
    lock.lock();
  }
  handed.dropperRunning = false;
  handed.changed.notify_all();
}

}  // namespace

void CallerRelease::handBack(std::function<void()> drop) {
  HandedBack& handed = handedBack();
  std::lock_guard<std::mutex> lock(handed.mutex);
  handed.drops.push_back(std::move(drop));
  // Started at the first hand-back, so a process that never posts has no extra thread. (A
  // child forked after it has none: its callers' drain() drops what is handed back there.)
  if (!handed.dropperStarted && !handed.stopping) {
    handed.dropperStarted = true;
    handed.dropperRunning = true;
    std::thread(dropAsHanded).detach();
  }
  // The thread waits only on an empty list: later hand-backs find it awake.
  if (handed.drops.size() == 1) handed.changed.notify_all();
}

void CallerRelease::drain() {
  std::vector<std::function<void()>> drops;
  {
    HandedBack& handed = handedBack();
    std::lock_guard<std::mutex> lock(handed.mutex);
    drops = takeAll(handed);
  }
  run(drops);
}

void CallerRelease::stop() {
  HandedBack& handed = handedBack();
  std::unique_lock<std::mutex> lock(handed.mutex);
  handed.stopping = true;
  handed.changed.notify_all();
  // It may be inside a drop that waits for the GIL: the caller must not hold it.
  handed.changed.wait(lock, [&] { return !handed.dropperRunning; });
}

}  // namespace smfree
