#pragma once

#include <c10/util/intrusive_ptr.h>

namespace smfree {

class SmFreeWork;

// A Work's future is waited for without entering the backend, so a recv whose copies in only a
// caller's wait() or poll queues (a CUDA recv staged through host memory over UCX:
// engine::OpFence::queuedByWait) would never end for a caller that waits on its future alone.
// Once such a Work's future is asked for, a thread of its own polls it, as is_completed() does,
// until it ends.
class FuturePoller {
 public:
  static void watch(c10::intrusive_ptr<SmFreeWork> work);
};

}  // namespace smfree
