#pragma once

#include <cuda.h>

#include <cstdint>

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

}  // namespace smfree::engine::cuda
