#pragma once

#include <Python.h>

namespace smfree {

// Releases the GIL for its scope if this thread holds it. Python drops the last reference to a
// backend with the GIL held, and tearing one down waits for threads that may need the GIL:
// Gloo's work loop frees tensors owned by Python objects, and Works finishing run Python
// callbacks. Waiting for them while holding it deadlocks the process.
class WithoutGil {
 public:
  WithoutGil()
      : state_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~WithoutGil() {
    if (state_) PyEval_RestoreThread(state_);
  }
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace smfree
