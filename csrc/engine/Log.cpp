#include "engine/Log.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>


namespace smfree::engine {

namespace {

LogLevel parseLogLevel(const char* text) {
  const std::string value = text ? text : "warn";
  if (value == "error") return LogLevel::kError;
  if (value == "warn") return LogLevel::kWarn;
  if (value == "info") return LogLevel::kInfo;
  if (value == "debug") return LogLevel::kDebug;
  fail("SMFREE_LOG_LEVEL='", value, "' is not one of error, warn, info, debug");
}

}  // namespace

LogLevel logLevel() {
  // Read here, not through Config: Config's own parsing logs.
  static const LogLevel level = parseLogLevel(std::getenv("SMFREE_LOG_LEVEL"));
  return level;
}

void logLine(LogLevel level, const std::string& message) {
  static const char* names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  std::fprintf(stderr, "[smfree %s pid %d] %s\n", names[static_cast<int>(level)],
               static_cast<int>(getpid()), message.c_str());
}

void logOnce(const std::string& key, const std::string& message, LogLevel level) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!seen.insert(key).second) {
      return;
    }
  }
  log(level, message);
}

}  // namespace smfree::engine
