// The engine's plain C++ tests: each file registers its tests with TEST and checks with CHECK;
// main.cpp runs them all. Built and run by tests/engine/test_engine_cpp.py.
#pragma once

#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "engine/Error.h"

namespace smfree::engine::testing {

inline int failures = 0;
// Mutated inputs per parser in fuzz_tests.cpp (main's --fuzz-inputs).
inline long fuzzInputs = 20000;

struct Test {
  const char* name;
  std::function<void()> run;
};

inline std::vector<Test>& registry() {
  static std::vector<Test> tests;
  return tests;
}

struct Register {
  Register(const char* name, std::function<void()> run) {
    registry().push_back({name, std::move(run)});
  }
};

// Whether `call` throws an engine Error whose message contains `expected`; prints what it got
// otherwise.
template <typename Call>
bool throwsError(Call&& call, const std::string& expected) {
  try {
    call();
  } catch (const Error& error) {
    if (std::string(error.what()).find(expected) != std::string::npos) return true;
    std::printf("  threw \"%s\", expected \"%s\"\n", error.what(), expected.c_str());
    return false;
  }
  std::printf("  did not throw, expected \"%s\"\n", expected.c_str());
  return false;
}

}  // namespace smfree::engine::testing

#define CHECK(condition)                                                   \
  do {                                                                     \
    if (!(condition)) {                                                    \
      ++::smfree::engine::testing::failures;                               \
      std::printf("  FAILED %s:%d: %s\n", __FILE__, __LINE__, #condition); \
    }                                                                      \
  } while (0)

#define SMFREE_TEST_CONCAT2(a, b) a##b
#define SMFREE_TEST_CONCAT(a, b) SMFREE_TEST_CONCAT2(a, b)
// TEST(function, "what it checks") { ... }
#define TEST(function, description)                                              \
  void function();                                                               \
  static const ::smfree::engine::testing::Register SMFREE_TEST_CONCAT(           \
      registered_, function)(description, function);                             \
  void function()
