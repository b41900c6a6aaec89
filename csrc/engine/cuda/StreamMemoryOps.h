#pragma once

#include <cuda.h>

#include <cstdint>
#include <initializer_list>

namespace smfree::engine::cuda {

// The stream memory operations that fence copies: a stream waits for a flag word or writes
// one, with no kernel and no CPU. `what` names the operation in the error a failure throws.

// Makes `stream` wait until *word >= value.
void waitAtLeast(CUstream stream, void* word, uint32_t value, const char* what);

// The same, for a word saying that a peer's copy engine finished writing into `device`: the
// wait also flushes those writes, where the device can, so that the work after it sees them.
void waitForRemoteWrites(CUstream stream, int device, void* word, uint32_t value,
                         const char* what);

// Makes `stream` write `value` into *word once the work before it is done.
void writeWord(CUstream stream, void* word, uint32_t value, const char* what);

// One operation of a batch (runInOrder): wait until *word == value, or write value into it.
struct WordOp {
  enum Kind { kWaitEquals, kWrite };
  Kind kind;
  void* word;
  uint32_t value;
};

// Queues `ops` on `stream` as one batch, which runs them in order: a wait followed by a
// write of the same word is a wait-then-reset, one node of a captured graph.
void runInOrder(CUstream stream, std::initializer_list<WordOp> ops, const char* what);

}  // namespace smfree::engine::cuda
