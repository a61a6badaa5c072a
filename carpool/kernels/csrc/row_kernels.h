// The kernels as work on one range (of weight rows, tokens, attention items) on the calling thread, with no
// at::parallel_for inside. The fused decode step (decode_layer.cpp) splits each layer's work over the threads of
// one parallel region with them: calling the ops instead forks and joins the threads once per op, ~150 times a
// SmolLM2 step. The ops split the same functions with at::parallel_for, so both paths compute every element alike.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "vec.h"

namespace carpool::kernels {

// The exact GGML path multiplies bf16 activations on the bf16 dot-product units in the AVX-512 build only;
// elsewhere it widens them to float (exact) and runs the fp32 kernel.
#ifdef CARPOOL_AVX512
inline constexpr bool kExactBf16Dot = true;
#else
inline constexpr bool kExactBf16Dot = false;
#endif
// Above this many activation rows the exact path's fp32 ggml_linear dequantizes and calls MKL's GEMM, which beats
// the fused loop there (measured). The bf16 fused loop on the bf16 dot-product units keeps up with oneDNN at every
// size.
inline constexpr int64_t kFp32FusedMaxRows = 256;
// Weight rows the exact path dequantizes together: exact_gemv_rows' scratch holds this many rows of K values.
inline constexpr int64_t kExactPanelRows = 16;

// A GGML weight's in_features, after checking it is a contiguous CPU uint8 [rows, whole blocks of qtype] tensor.
int64_t checked_in_features(const at::Tensor& qweight, int64_t qtype);

// The exact (dequantizing) GGML linear on weight rows [first, last): y[m * ldy + n] = x[m] . W[n] for the M rows
// of x [M, K]; X float, or bf16 where kExactBf16Dot; panel: scratch of kExactPanelRows * K values of X.
template <typename X, typename Y>
void exact_gemv_rows(const X* x, int64_t M, const uint8_t* weight, int64_t qtype, int64_t K, int64_t first,
                     int64_t last, Y* y, int64_t ldy, X* panel);

// RMSNorm of `rows` rows of `size` values (dst may be src).
template <typename T>
void rms_norm_rows(const T* src, const T* weight, T* dst, int64_t rows, int64_t size, float eps);

// silu(gate) * up for `rows` rows of gate|up [rows, 2 * width] -> out [rows, width].
template <typename T>
void silu_mul_rows(const T* src, T* dst, int64_t rows, int64_t width);

// Rotary embedding in place on one token's q heads and k heads (each head_dim contiguous values, heads adjacent),
// with the token's rows of the cos/sin tables.
template <typename T>
void rotate_token(T* q, int64_t q_heads, T* k, int64_t k_heads, int64_t head_dim, const T* cos, const T* sin);

// Rows of one decode attention call that read one sequence's keys: consecutive rows whose contexts grow by one key
// a row over the same blocks (a verifying sequence's last token and its drafts), up to kMaxRunRows a run. Returns
// the runs' first rows and then `batch`: run r is rows [runs[r], runs[r + 1]). context_lens checked by the caller
// (within the table).
inline constexpr int64_t kMaxRunRows = 16;
std::vector<int64_t> shared_context_runs(const int64_t* block_tables, const int64_t* context_lens, int64_t batch,
                                         int64_t max_blocks, int64_t block_size);

// One run x KV head of a decode attention call, set up for the vectorized kernel (paged_attention.cpp): the run's
// keys [0, span) are the pool rows at `offsets` (K and V alike; `stride` of them, whole fours, padded with repeats
// of the last); row j sees keys [starts[j], starts[j] + lens[j]); query vector i = row * group + head, scaled, fp32.
template <typename T>
struct RunWork {
  const float* query = nullptr;      // [queries, head_dim]
  const int64_t* offsets = nullptr;  // [stride]
  int64_t span = 0, stride = 0;
  int rows = 0, group = 0;
  int64_t starts[kMaxRunRows] = {}, lens[kMaxRunRows] = {};
  float* scores = nullptr;  // [queries, stride]
  float* acc = nullptr;     // [queries, head_dim], zeroed: the weighted values' fp32 sums
  float* totals = nullptr;  // [queries]: the softmax weights' sums
  T* out = nullptr;         // query vector i's output at out + (i / group) * out_row_stride + (i % group) * head_dim
  int64_t out_row_stride = 0;
  int queries() const { return rows * group; }
};

// Decode attention cut finer than its (run, KV head) items, for calls with fewer items than threads: one sequence of
// Gemma 3 (one KV head) on 2 threads left one thread idle through the attention. Three phases, each shared among
// the threads, each starting once the one before has finished on every thread (a barrier): scores by key blocks,
// softmax weights by query vector, weighted values and outputs by 64-byte column slices (one cache line of V rows:
// no line read by two threads). Each phase is the item kernel's own work cut another way, so every output is the
// item kernel's to the bit.
template <typename T>
class SplitDecodeAttention {
 public:
  static constexpr int kPhases = 3;

  // Whether splitting pays: fewer items than threads. Measured on an Intel VM (family 6 model 167, 2 threads, bf16,
  // 2,000 keys, op by op): Gemma 3's one item 2.8 -> 1.75 ms for 18 layers' calls (one thread reads ~13 GB/s, two
  // ~20); SmolLM2's 3 items no faster split (2.51-2.53 ms whole, 2.50-2.58 split for 30 calls; at 900 keys 3-7%
  // slower), nor its engine steps at 1,000 tokens of context, in noise of +-10%.
  // In the fused decode step's one parallel region (`in_region`: its phases' barriers cost no fork) a few items that
  // the threads cannot share evenly split too: SmolLM2's 3 on 2 threads left one thread idle a third of the
  // attention, and its engine steps ran 1.032x as fast split at ~2,100 tokens of context, 1.017x at ~600, 1.003x at
  // ~100 (Zen 4, one process, steps alternating).
  static bool pays(int64_t items, int threads, bool in_region = false) {
    return items < threads || (in_region && items % threads != 0 && items < 4 * threads);
  }

  // Sets up a call's items (one thread; arguments as decode_attention_items', items all of runs x kv_heads); false
  // where the vectorized kernel does not apply (head size, dtype, portable build): the items then run whole.
  bool prepare(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int64_t* block_tables,
               const int64_t* context_lens, const int64_t* runs, int64_t num_runs, T* out, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
               int64_t window);
  // Thread `tid` of the enclosing OpenMP parallel region's `threads`: its share of each phase's units, with a
  // barrier of the region between two phases (so every thread of the region must call it).
  void run_phases(int tid, int threads) const;

 private:
  std::vector<RunWork<T>> work_;
  std::vector<std::pair<int64_t, int64_t>> units_[kPhases];  // (item, first key | query vector | first column)
  std::vector<float> query_, scores_, acc_, totals_;
  std::vector<int64_t> offsets_;
  const T* k_cache_ = nullptr;
  const T* v_cache_ = nullptr;
  int64_t head_dim_ = 0, group_ = 0;
};

// A call's attention items handed out a run at a time (its KV heads' items together), each run to whichever thread
// asks next: a static split by item count waited on the thread whose sequences had the longer contexts. The 1.5B's
// heads, 28 layers' pools of random blocks, 2 threads, three alternations of the two builds (Zen 4): 32 sequences
// of 50-450 keys (5,338 of 9,604 in the first half) 22.5-23.0 -> 20.5-21.9 ms, 32 of 250 keys unchanged. A run's
// heads stay on one thread: a token's K (or V) rows of all KV heads are one stretch of memory, and one core's
// prefetchers bring a head's neighbours with it (items handed out one by one, a sequence's two heads on two cores,
// ran 1.2-1.5x slower).
class ItemClaims {
 public:
  void reset(int64_t runs, int64_t items_per_run) {
    runs_ = runs;
    items_per_run_ = items_per_run;
    next_.store(0, std::memory_order_relaxed);
  }
  // Moves `item` on to the calling thread's next: the next of its run's items [item, end), else the first of the
  // next unclaimed run; false when every run has gone. Start from item = end = -1.
  bool next(int64_t& item, int64_t& end) {
    if (++item < end) return true;
    const int64_t run = next_.fetch_add(1, std::memory_order_relaxed);
    if (run >= runs_) return false;
    item = run * items_per_run_;
    end = item + items_per_run_;
    return true;
  }

 private:
  std::atomic<int64_t> next_{0};
  int64_t runs_ = 0, items_per_run_ = 0;
};

// Paged decode attention for the items of runs x kv_heads that the calling thread takes from `claims`: item
// r * num_kv_heads + h is run r's rows (runs from shared_context_runs) with KV head h and its group of query heads,
// each K/V vector read once for all of them. q: row b's heads at q + b * q_stride ([heads, head_dim]); out:
// [batch, heads, head_dim]; block_tables [batch, max_blocks]; context_lens checked by the caller (>= 1, within the
// table). Each row's output is what it would be in a run of its own, to the bit.
template <typename T>
void decode_attention_items(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                            const int64_t* block_tables, const int64_t* context_lens, const int64_t* runs, T* out,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            int64_t max_blocks, float scale, int64_t window, ItemClaims& claims);

}  // namespace carpool::kernels
