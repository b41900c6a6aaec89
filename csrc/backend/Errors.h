#pragma once

#include <exception>
#include <string>

#include "engine/Status.h"

namespace smfree {

// An op's failure as torch.distributed.DistBackendError (a RuntimeError) for Python; `within`,
// if set, names the collective the op was a piece of.
std::exception_ptr makeOpError(const engine::Status& status, const std::string& within = "");
[[noreturn]] void throwTimeout(const std::string& message);

}  // namespace smfree
