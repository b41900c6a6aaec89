// Runs every test the other files of this folder registered, in the order the linker
// initialized them; exits non-zero on any failure.

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "check.h"

// --fuzz-inputs N: mutated inputs per parser for fuzz_tests.cpp.
int main(int argc, char** argv) {
  using namespace smfree::engine::testing;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--fuzz-inputs") == 0) {
      fuzzInputs = std::strtol(argv[i + 1], nullptr, 10);
    }
  }
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
