#pragma once

#include <string>

#include "engine/Error.h"

namespace smfree::engine {

enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

// Level from SMFREE_LOG_LEVEL (error, warn, info, debug); warn by default. Throws Error for
// another value.
LogLevel logLevel();
void logLine(LogLevel level, const std::string& message);
// Logs `message` at `level` the first time `key` is seen in this process.
void logOnce(const std::string& key, const std::string& message,
             LogLevel level = LogLevel::kInfo);

template <typename... Parts>
void log(LogLevel level, const Parts&... parts) {
  if (level <= logLevel()) {
    logLine(level, concat(parts...));
  }
}

}  // namespace smfree::engine
