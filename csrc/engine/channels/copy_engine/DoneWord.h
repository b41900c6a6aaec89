#pragma once

#include <cstdint>

namespace smfree::engine {

// What a `done` word says, above its flag's own value: the value itself, that the op failed on
// this side (its CPU released the streams); kCopied, that the copy wrote it; kSenderGaveUp, that
// the other side gave up before queuing the copy.
constexpr uint32_t kCopied = 1;
constexpr uint32_t kSenderGaveUp = 2;
constexpr uint32_t kDoneSpan = 3;

}  // namespace smfree::engine
