// Work shared by a parallel region's threads in units: each thread starts on its own contiguous share (what a
// static split gives it, so its weights stream in one run) and takes it a chunk at a time from the front; a
// thread whose share is done takes the back half of what another has not yet started, and goes on from there.
// A static split waits at every barrier for whichever core ran slower that moment, and on a shared machine that
// changes from step to step: SmolLM2's one-stream decode step (Zen 4, 2 threads, per-thread timers) spent 0.1-1.0
// ms of its 3.7 ms waiting at the projections' barriers, the slower thread alternating between steps. Against the
// static split, one-stream steps alternating in one process: 0.99-1.01x on a quiet machine (both models), and with
// a busy process on one of the two cores the 1.5B 1.05-1.10x, SmolLM2 0.99-1.17x (docs/benchmarks.md).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace carpool::kernels {

class WorkShares {
 public:
  explicit WorkShares(int max_threads) : ranges_(max_threads) {}

  // Units [0, units) of `unit_bytes` of weights each (0: no minimum chunk) shared out over `threads` (at most
  // max_threads) as a static split would; call while no thread takes any (between barriers).
  void reset(int64_t units, int threads, int64_t unit_bytes) {
    threads_ = threads;
    for (int64_t t = 0; t < threads; ++t)
      ranges_[t].bounds.store(pack(units * t / threads, units * (t + 1) / threads), std::memory_order_relaxed);
    const int64_t min_chunk = unit_bytes > 0 ? (kMinChunkBytes + unit_bytes - 1) / unit_bytes : 1;
    chunk_ = std::max(min_chunk, units / threads / kChunksPerShare);
  }

  // run(first, last) over unit ranges until every thread's share is taken.
  template <typename Run>
  void run(int tid, Run run) {
    int64_t first, last;
    do {
      while (take_front(tid, first, last)) run(first, last);
    } while (take_back_half(tid));
  }

 private:
  // Chunks a share is taken in: the most a thread can wait at the next barrier is about one chunk's work, and each
  // chunk is a kernel call.
  static constexpr int64_t kChunksPerShare = 8;
  // ... and at least this many bytes of weights: cut into sixteenths of a share, SmolLM2's projections (207 KB-1.1
  // MB) ran its one-stream step 0.98x as fast as a static split.
  static constexpr int64_t kMinChunkBytes = 64 << 10;

  struct alignas(64) Range {
    std::atomic<uint64_t> bounds{0};  // front | back << 32: units [front, back) not yet taken
  };

  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  }
  static int64_t front_of(uint64_t bounds) { return static_cast<int64_t>(bounds & 0xFFFFFFFFu); }
  static int64_t back_of(uint64_t bounds) { return static_cast<int64_t>(bounds >> 32); }

  bool take_front(int tid, int64_t& first, int64_t& last) {
    std::atomic<uint64_t>& bounds = ranges_[tid].bounds;
    uint64_t seen = bounds.load(std::memory_order_relaxed);
    do {
      first = front_of(seen);
      last = std::min(back_of(seen), first + chunk_);
      if (first >= last) return false;
    } while (!bounds.compare_exchange_weak(seen, pack(last, back_of(seen)), std::memory_order_relaxed));
    return true;
  }

  // The back half of the largest untaken rest of another thread's share becomes this thread's share.
  bool take_back_half(int tid) {
    for (;;) {  // a failed exchange means another thread took units: look again
      int victim = -1;
      int64_t most = 1;  // a single unit is left to its owner
      for (int t = 0; t < threads_; ++t) {
        const uint64_t seen = ranges_[t].bounds.load(std::memory_order_relaxed);
        if (t != tid && back_of(seen) - front_of(seen) > most) {
          victim = t;
          most = back_of(seen) - front_of(seen);
        }
      }
      if (victim < 0) return false;
      uint64_t seen = ranges_[victim].bounds.load(std::memory_order_relaxed);
      const int64_t front = front_of(seen), back = back_of(seen), half = (back - front) / 2;
      if (half >= 1 &&
          ranges_[victim].bounds.compare_exchange_strong(seen, pack(front, back - half), std::memory_order_relaxed)) {
        ranges_[tid].bounds.store(pack(back - half, back), std::memory_order_relaxed);
        return true;
      }
    }
  }

  std::vector<Range> ranges_;
  int threads_ = 0;
  int64_t chunk_ = 1;
};

}  // namespace carpool::kernels
