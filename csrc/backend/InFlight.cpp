#include "backend/InFlight.h"

#include <algorithm>

#include <c10/util/Exception.h>

namespace smfree {

std::shared_ptr<InFlight> InFlight::ofProcess() {
  static const std::shared_ptr<InFlight> set = std::make_shared<InFlight>();
  return set;
}

std::shared_ptr<InFlightSpan> InFlight::add(int device, const void* data, uint64_t bytes,
                                            const WorkLabel& label) {
  if (bytes == 0) return nullptr;
  const auto start = reinterpret_cast<uintptr_t>(data);
  const uintptr_t end = start + bytes;
  const bool isRecv = label.kind == engine::OpKind::kRecv;
  std::lock_guard<std::mutex> lock(mutex_);
  Device& on = devices_[device];
  // A span that ends past `start` starts after start - longest.
  const uintptr_t from = start >= on.longest ? start - on.longest + 1 : 0;
  for (auto it = on.spans.lower_bound(from); it != on.spans.end() && it->first < end; ++it) {
    const Span& other = it->second;
    if (other.end <= start || (!isRecv && other.label.kind != engine::OpKind::kRecv)) continue;
    TORCH_CHECK_VALUE(false, "smfree: ", label.describe(), " overlaps the bytes of ",
                      other.label.describe(), ", in flight or in the same batch: ",
                      isRecv ? "a recv may not write bytes that another op reads or writes"
                             : "a send may not read bytes that a recv writes",
                      " before both end; use separate buffers, or wait() for the first op");
  }
  const auto span = on.spans.emplace(start, Span{end, label});
  on.longest = std::max(on.longest, bytes);
  return std::shared_ptr<InFlightSpan>(new InFlightSpan(shared_from_this(), device, span));
}

void InFlightSpan::end() {
  std::lock_guard<std::mutex> lock(set_->mutex_);
  if (!live_) return;
  live_ = false;
  InFlight::Device& on = set_->devices_[device_];
  on.spans.erase(span_);
  if (on.spans.empty()) on.longest = 0;
}

}  // namespace smfree
