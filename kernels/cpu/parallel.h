// Work spread over XLA's intra-op thread pool, for the CPU ops of this folder.
#ifndef XLASERVE_KERNELS_CPU_PARALLEL_H_
#define XLASERVE_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace xlaserve {

// Runs run_task(i) for i in [0, num_tasks): tasks are taken one at a time from a shared counter by
// the calling thread and by num_threads - 1 helpers scheduled on the pool (one more oversubscribed
// the 2 cores here: 1.17x). The caller returns once every task is done; a helper that starts later
// finds none left and touches nothing but the shared state it holds. `run_task` is copied into that
// state, so it must not refer to the caller's stack beyond the call (buffers are fine: every task
// that reads them is done before the caller returns).
template <typename RunTask>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t num_tasks, RunTask run_task) {
  struct Work {
    explicit Work(RunTask f, int64_t n) : run(std::move(f)), num_tasks(n) {}
    RunTask run;
    int64_t num_tasks;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto work = std::make_shared<Work>(std::move(run_task), num_tasks);
  auto drain = [](const std::shared_ptr<Work>& w) {
    for (;;) {
      const int64_t task = w->next.fetch_add(1, std::memory_order_relaxed);
      if (task >= w->num_tasks) return;
      w->run(task);
      w->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, num_tasks - 1);
  for (int64_t n = 0; n < helpers; ++n) pool.Schedule([work, drain] { drain(work); });
  drain(work);
  while (work->done.load(std::memory_order_acquire) < num_tasks) std::this_thread::yield();
}

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_PARALLEL_H_
