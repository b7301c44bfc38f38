#pragma once
// What every fuzz target may assume and must check: a parser either returns a value that holds
// its invariants or throws InvalidArgument. Anything else (another exception, a crash, a
// sanitizer report, a broken invariant) is a bug; EPLB_FUZZ_ASSERT turns a broken invariant into
// a crash libFuzzer reports with the input.

#include <cstdio>
#include <cstdlib>

#define EPLB_FUZZ_ASSERT(cond)                                                     \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      std::fprintf(stderr, "fuzz invariant failed: %s at %s:%d\n", #cond, __FILE__, \
                   __LINE__);                                                      \
      std::abort();                                                                \
    }                                                                              \
  } while (0)
