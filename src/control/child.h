#pragma once
// What fork_ranks and fork_elastic share: the life of a forked rank process.

#include <sys/types.h>

#include <cstddef>
#include <functional>

namespace eplb::control::child {

// Each child's error message, in memory shared with the launcher (mapped before the forks).
inline constexpr std::size_t kErrorBytes = 2048;

void keep_error(char* slot, const char* message);

// The child's side of a fork: dies with the launcher (`parent`), runs body, keeps the message of
// an exception in `error_slot` (exit code 1), and ends with _exit, never returning.
[[noreturn]] void run_child(int rank, pid_t parent, const std::function<int()>& body,
                            char* error_slot);

}  // namespace eplb::control::child
