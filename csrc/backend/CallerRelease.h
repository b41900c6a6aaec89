#pragma once

#include <functional>
#include <memory>
#include <utility>

namespace smfree {

// References the engine's threads hold for the backend (an op's Works, and through them the
// caller's tensors) but must not drop themselves: torch takes the GIL to drop a tensor's last
// C++ reference while its Python object lives, so the engine's thread would wait for whichever
// Python thread holds the GIL, and every other op with it (or for good, if that thread waits on
// the engine). Dropped instead by a thread of their own as they come (the caller's memory goes
// back once its ops end, as with NCCL, whether or not the caller enters the backend again),
// and by the next caller that enters the backend (so what ended before a call is gone after it).
class CallerRelease {
 public:
  // Owns `refs`; once the last copy is gone, on whatever thread, `refs` waits for drain().
  template <typename Refs>
  static std::shared_ptr<Refs> hold(Refs refs) {
    return std::shared_ptr<Refs>(new Refs(std::move(refs)),
                                 [](Refs* held) { handBack([held] { delete held; }); });
  }
  // Hands `refs` back at once, for the next drain() to drop.
  template <typename Refs>
  static void handBackNow(Refs refs) {
    hold(std::move(refs));
  }
  // Drops what was handed back. On a caller's thread, with or without the GIL.
  static void drain();
  // At exit, before Python finalizes, without the GIL: the dropping thread ends; what is
  // handed back from then on waits for a caller's drain().
  static void stop();

 private:
  static void handBack(std::function<void()> drop);
};

}  // namespace smfree
