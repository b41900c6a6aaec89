#include "backend/Errors.h"

#include <c10/util/Exception.h>

namespace smfree {

std::exception_ptr makeOpError(const engine::Status& status, const std::string& within) {
  const std::string message =
      within.empty() ? "smfree: " + status.message : "smfree: " + within + ": " + status.message;
  return std::make_exception_ptr(
      c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, __LINE__}, message));
}

void throwTimeout(const std::string& message) {
  throw c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, __LINE__}, message);
}

}  // namespace smfree
