// Runs every test the other files of this folder registered, in the order the linker
// initialized them; exits non-zero on any failure.

#include <cstdio>

#include "check.h"

int main() {
  using namespace smfree::engine::testing;
  int passed = 0;
  for (const Test& test : registry()) {
    const int before = failures;
    try {
      test.run();
    } catch (const std::exception& error) {
      ++failures;
      std::printf("  FAILED: threw %s\n", error.what());
    }
    std::printf("%s %s\n", failures == before ? "ok  " : "FAIL", test.name);
    passed += failures == before;
  }
  const int total = static_cast<int>(registry().size());
  std::printf("%d passed, %d failed\n", passed, total - passed);
  return passed == total && total > 0 ? 0 : 1;
}
