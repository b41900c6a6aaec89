#include "engine/channels/copy_engine/RingMemory.h"

#include "engine/Error.h"
#include "engine/Log.h"

namespace smfree::engine {
namespace {

std::string mebibytes(uint64_t bytes) {
  if (bytes >= (1u << 20)) return concat(bytes >> 20, " MiB");
  if (bytes >= (1u << 10)) return concat(bytes >> 10, " KiB");
  return concat(bytes, " B");
}

}  // namespace

RingMemory::Share::Share(RingMemory& memory, int device, uint64_t bytes)
    : memory_(memory), device_(device), bytes_(bytes) {}

RingMemory::Share::~Share() { memory_.give(device_, bytes_); }

std::unique_ptr<RingMemory::Share> RingMemory::take(int device, uint64_t bytes,
                                                    const std::string& what) {
  std::string taken;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (taken_ + bytes > bound_) {
      fail(what, " needs ", mebibytes(bytes), " of GPU memory; the rings of this process hold ",
           mebibytes(taken_), " of the ", mebibytes(bound_), " SMFREE_RING_MEMORY_BYTES allows");
    }
    taken_ += bytes;
    byDevice_[device] += bytes;
  }
  auto share = std::make_unique<Share>(*this, device, bytes);
  log(LogLevel::kInfo, what, ": ", mebibytes(bytes), " of cuda:", device, " (rings now hold ",
      describe(), ")");
  return share;
}

void RingMemory::give(int device, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  taken_ -= bytes;
  byDevice_[device] -= bytes;
}

void RingMemory::refused(const std::string& message) {
  static std::once_flag first;
  bool warned = false;
  std::call_once(first, [&] {
    log(LogLevel::kWarn, message);
    warned = true;
  });
  if (!warned) log(LogLevel::kInfo, message);
}

uint64_t RingMemory::taken() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return taken_;
}

std::string RingMemory::describe() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string text;
  for (const auto& [device, bytes] : byDevice_) {
    if (bytes == 0) continue;
    text += concat(text.empty() ? "" : ", ", "cuda:", device, " ", mebibytes(bytes));
  }
  return concat(text.empty() ? "nothing" : text, " of ", mebibytes(bound_),
                " (SMFREE_RING_MEMORY_BYTES)");
}

}  // namespace smfree::engine
