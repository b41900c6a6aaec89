#include "backend/CallerRelease.h"

#include <mutex>
#include <vector>

namespace smfree {
namespace {

struct HandedBack {
  std::mutex mutex;
  std::vector<std::function<void()>> drops;
};

// Never destroyed: what is left at exit stays, rather than reach Python as it finalizes.
HandedBack& handedBack() {
  static auto* handed = new HandedBack();
  return *handed;
}

}  // namespace

void CallerRelease::handBack(std::function<void()> drop) {
  HandedBack& handed = handedBack();
  std::lock_guard<std::mutex> lock(handed.mutex);
  handed.drops.push_back(std::move(drop));
}

void CallerRelease::drain() {
  std::vector<std::function<void()>> drops;
  {
    HandedBack& handed = handedBack();
    std::lock_guard<std::mutex> lock(handed.mutex);
    drops.swap(handed.drops);
  }
  for (auto& drop : drops) drop();  // outside the lock: a drop may hand back more
}

}  // namespace smfree
