#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "backend/SmFreeWork.h"

namespace smfree {

class InFlightSpan;

// The bytes of the process's point-to-point ops, of every group, from their call to their end,
// by device: a recv may overlap no other op's bytes, and a send no recv's (two sends may read
// the same bytes). Checked at the call, so an op refused for it posts nothing, nor does the rest
// of its batch. Spans are kept by start address; a search looks back by the longest span, so a
// call costs a lookup, not a walk over every op in flight.
class InFlight : public std::enable_shared_from_this<InFlight> {
 public:
  static std::shared_ptr<InFlight> ofProcess();

  // Adds `bytes` at `data` on `device` (-1: host memory) for the op `label` names, until the
  // span ends; throws ValueError naming both ops if they overlap an op in flight they conflict
  // with. Null for an op of no bytes.
  std::shared_ptr<InFlightSpan> add(int device, const void* data, uint64_t bytes,
                                    const WorkLabel& label);

 private:
  friend class InFlightSpan;
  struct Span {
    uintptr_t end;
    WorkLabel label;
  };
  using Spans = std::multimap<uintptr_t, Span>;
  struct Device {
    Spans spans;
    uint64_t longest = 0;  // of the spans since the device last had none
  };

  std::mutex mutex_;
  std::map<int, Device> devices_;
};

// One op's bytes in InFlight: they stay there until end() (the op ended, its wait() returned,
// or it was never posted) or the last reference goes.
class InFlightSpan {
 public:
  InFlightSpan(const InFlightSpan&) = delete;
  InFlightSpan& operator=(const InFlightSpan&) = delete;
  ~InFlightSpan() { end(); }
  void end();  // any thread, any number of times

 private:
  friend class InFlight;
  InFlightSpan(std::shared_ptr<InFlight> set, int device, InFlight::Spans::iterator span)
      : set_(std::move(set)), device_(device), span_(span) {}

  const std::shared_ptr<InFlight> set_;
  const int device_;
  const InFlight::Spans::iterator span_;
  bool live_ = true;  // under set_->mutex_
};

}  // namespace smfree
