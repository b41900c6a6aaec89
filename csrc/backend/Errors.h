#pragma once

#include <exception>
#include <string>

#include "engine/Status.h"

namespace smfree {

// An op's failure as torch.distributed.DistBackendError (a RuntimeError) for Python.
std::exception_ptr makeOpError(const engine::Status& status);
[[noreturn]] void throwTimeout(const std::string& message);

}  // namespace smfree
