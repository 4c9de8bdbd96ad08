// The assertion of gmlake's C++ test programs: reports the failed condition with a message
// and counts it in `failures` (each program returns non-zero when it is not 0).
#pragma once

#include <cstdio>

static int failures = 0;

#define CHECK(cond, ...)                                                  \
  do {                                                                    \
    if (!(cond)) {                                                        \
      std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                  \
      std::fprintf(stderr, "\n");                                         \
      ++failures;                                                         \
    }                                                                     \
  } while (0)
