// lmserve-isa: avx512 avx2 neon
// How long an empty OpenMP parallel region takes on the calling thread, which is what each of a
// step's few hundred kernel calls pays to start and join its threads (engine/thread_check.py).
// libgomp keeps a team's threads spinning between regions only while it manages no more threads
// than the CPUs it counted; past that it puts them to sleep in the kernel after a few spins, and
// each region then waits for a futex wake (lmserve/openmp.py).
#include <omp.h>
#include <stdint.h>

#include <chrono>

extern "C" {

// Mean seconds per region over `regions` back-to-back empty regions of `threads` threads.
void lm_time_parallel_regions(int threads, int regions, double* seconds) {
  omp_set_num_threads(threads);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < regions; ++i) {
#pragma omp parallel
    { asm volatile("" ::: "memory"); }
  }
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  *seconds = took.count() / regions;
}
}
