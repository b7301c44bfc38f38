// The runtime tests' main. Under ThreadSanitizer the binary needs two settings that ctest
// gives it but a person running it by hand (the soak, docs/runtime.md) would not: UCX's memory
// hooks off (libucm patches mmap and madvise, which crashes inside TSan's interceptors) and
// the suppressions for UCX's own uninstrumented libraries. Both are read when a process starts,
// so the binary starts itself again with them when they are missing.

#include <unistd.h>

#include <cstdlib>

#include <gtest/gtest.h>

int main(int argc, char** argv) {
#if defined(__SANITIZE_THREAD__)
  if (std::getenv("UCX_MEM_MMAP_HOOK_MODE") == nullptr) {
    setenv("UCX_MEM_MMAP_HOOK_MODE", "none", 1);
    setenv("UCX_MEM_MALLOC_HOOKS", "no", 1);
    if (std::getenv("TSAN_OPTIONS") == nullptr) {
      setenv("TSAN_OPTIONS",
             "suppressions=" EPLB_SOURCE_DIR "/tests/runtime/tsan.supp halt_on_error=1", 1);
    }
    execv("/proc/self/exe", argv);
    return 127;  // execv failed
  }
#endif
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
