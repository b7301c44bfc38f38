#pragma once
// How long the calling thread has waited for a core: runnable, but the OS ran something else.
// The forward thread's stall in step_end is the wall time eplb kept it there less this wait
// (on a machine with more runnable threads than cores, the OS may take the core away inside
// any few microseconds of code, and hands it back only after other threads' time slices).

#include <cstdint>

namespace eplb::runtime {

// Nanoseconds the calling thread has spent waiting on a run queue since it started (Linux: the
// second field of /proc/thread-self/schedstat), or -1 where the kernel does not say. One pread
// of a file the thread keeps open (closed when the thread ends); any thread may call it.
int64_t run_queue_wait_ns();

// The calling thread yields to the forward thread from now on: under SCHED_BATCH, waking it (a
// submitted agreement, an installed layer) does not preempt the thread that woke it. The
// worker's and control thread's latency is hidden by the lag; the forward thread's is not.
// Best effort.
void make_background_thread();

}  // namespace eplb::runtime
