// torch.ops.carpool.work_shares_trace: WorkShares (work_shares.h) run on units that record who ran them, with one
// thread slowed, so that tests can see its guarantees: every unit run exactly once, a slow thread's units taken on
// by the others.
#include <ATen/ATen.h>
#include <omp.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "work_shares.h"

namespace {

// [2, units]: how many times each unit ran, and the thread that ran it last. Thread 0 sleeps `slow_us` a unit.
at::Tensor work_shares_trace(int64_t units, int64_t threads, int64_t slow_us) {
  TORCH_CHECK(units >= 0 && units < (int64_t{1} << 31), "units: expected 0 to 2^31 - 1, got ", units);
  TORCH_CHECK(threads >= 1 && threads <= 64, "threads: expected 1 to 64, got ", threads);
  TORCH_CHECK(slow_us >= 0, "slow_us: expected >= 0, got ", slow_us);
  std::vector<std::atomic<int64_t>> runs(units);
  std::vector<int64_t> ran_by(units, -1);
  carpool::kernels::WorkShares shares(static_cast<int>(threads));
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
#pragma omp single
    shares.reset(units, omp_get_num_threads(), 0);
    shares.run(tid, [&](int64_t first, int64_t last) {
      for (int64_t unit = first; unit < last; ++unit) {
        if (tid == 0 && slow_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(slow_us));
        runs[unit].fetch_add(1, std::memory_order_relaxed);
        ran_by[unit] = tid;
      }
    });
  }
  at::Tensor trace = at::empty({2, units}, at::kLong);
  auto out = trace.accessor<int64_t, 2>();
  for (int64_t unit = 0; unit < units; ++unit) {
    out[0][unit] = runs[unit].load();
    out[1][unit] = ran_by[unit];
  }
  return trace;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(carpool, m) {
  m.def("work_shares_trace(int units, int threads, int slow_us) -> Tensor", &work_shares_trace);
}
