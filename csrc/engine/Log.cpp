#include "engine/Log.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>

#include "engine/Config.h"

namespace smfree::engine {

LogLevel logLevel() {
  static const LogLevel level = Config::fromEnv().logLevel;
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
