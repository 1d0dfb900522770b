// How the kernels of cpu_ops.cpp and packed_linear.cpp share their work between threads.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

// f(begin, end) over [0, n) in runs of `chunk`, each handed to whichever thread comes free
// next (OpenMP's dynamic schedule), where at::parallel_for gives each thread an equal share up
// front. A server shares its cores with its own event loop and, in a benchmark, the client:
// when one of them takes a core for a few milliseconds, the thread it displaced no longer holds
// its whole share back while the other waits at the end of the op; the other takes the runs
// left. `python -m evals.bench_step --neighbour-duty 0.3` measures steps beside such a
// neighbour.
template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  if (n <= 0) {
    return;
  }
  chunk = std::max<int64_t>(chunk, 1);
  const int64_t runs = (n + chunk - 1) / chunk;
  if (runs == 1 || omp_in_parallel() || omp_get_max_threads() == 1) {
    for (int64_t run = 0; run < runs; ++run) {
      f(run * chunk, std::min(n, (run + 1) * chunk));
    }
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t run = 0; run < runs; ++run) {
    f(run * chunk, std::min(n, (run + 1) * chunk));
  }
}

// A run length giving each thread about eight runs of n: small enough to even out a stalled
// thread, large enough that a run's setup (and the next item's prefetch) pays off.
inline int64_t balanced_chunk(int64_t n) {
  return std::max<int64_t>(1, n / (8 * omp_get_max_threads()));
}
