// The exact GGML linear on AMX tiles (amx_gemm.h). tdpbf16ps multiplies a 16x32 bf16 tile A by a 32x16 tile B
// stored as 16 rows of K pairs ([K / 2][16][2]) into a 16x16 fp32 tile C. Here A is 16 weight rows (output
// columns) straight from the dequantized panel, row-major with K contiguous as dequantize_row writes it, and B is
// 16 activation rows, re-laid once per call into pairs: so C holds a column's 16 rows in one tile row, the layout
// of the int8 kernel's accumulators, and its outputs go to y through the same transposing store (tile_store.h).
// Register tiles: 2 column tiles x 2 row vectors of C (tmm0-3) from 2 A tiles (tmm4-5) and 2 B tiles (tmm6-7),
// every tile 16 rows of 64 bytes; each A and B load serves two multiplies.
#include "amx_gemm.h"

#ifdef CARPOOL_AMX
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "ggml_blocks.h"
#include "tile_store.h"

namespace carpool::ggml {
namespace {

constexpr int kRows = 16;           // rows of every tile; fp32 columns of C
constexpr int kTileK = 32;          // bf16 values of K per A row and per B tile
constexpr int kPanelColumns = 32;   // two A tiles

// Linux keeps tile data off until the process asks (arch_prctl, kernel 5.16+); the AMX probe asks in the process
// that loads this module, and asking again is harmless, so a process that skipped the probe still gets it here.
void require_tile_permission() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  TORCH_CHECK(permitted, "AMX: the kernel refused tile data (arch_prctl ARCH_REQ_XCOMP_PERM)");
}

// Tile shapes are per-thread state: each thread sets them before its first tile instruction of a call.
void configure_tiles() {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config = {};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) config.rows[t] = kRows, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// x [M, K] as B tiles: [vectors][K / 2][16 rows][2] 32-bit pairs, rows past M zero. One vector's tile for K values
// k..k+31 is 1 KiB, contiguous.
std::vector<uint32_t> pair_rows(const c10::BFloat16* x, int64_t M, int64_t K, int64_t vectors) {
  const int64_t pairs = K / 2;
  std::vector<uint32_t> out(vectors * pairs * kRows);
  const auto* rows = reinterpret_cast<const uint32_t*>(x);
  at::parallel_for(0, vectors, 1, [&](int64_t first, int64_t last) {
    for (int64_t v = first; v < last; ++v) {
      uint32_t* vector = out.data() + v * pairs * kRows;
      for (int l = 0; l < kRows; ++l) {
        const int64_t m = v * kRows + l;
        if (m >= M) {
          for (int64_t p = 0; p < pairs; ++p) vector[p * kRows + l] = 0;
          continue;
        }
        const uint32_t* row = rows + m * pairs;
        for (int64_t p = 0; p < pairs; ++p) vector[p * kRows + l] = row[p];
      }
    }
  });
  return out;
}

// out[(n * RV + r) * 16 + l] = column n (of 32 in `panel`) . row l of vector r (of RV at `xv`), over all of K.
template <int RV>
void tile_block(const c10::BFloat16* panel, const uint32_t* xv, int64_t K, float* out) {
  const int64_t a_stride = K * 2, vector = K / 2 * kRows;
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (RV == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += kTileK) {
    _tile_loadd(4, panel + k, a_stride);
    _tile_loadd(5, panel + kRows * K + k, a_stride);
    _tile_loadd(6, xv + k / 2 * kRows, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (RV == 2) {
      _tile_loadd(7, xv + vector + k / 2 * kRows, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t stride = RV * kRows * sizeof(float);
  _tile_stored(0, out, stride);
  _tile_stored(2, out + kRows * RV * kRows, stride);
  if constexpr (RV == 2) {
    _tile_stored(1, out + kRows, stride);
    _tile_stored(3, out + kRows * RV * kRows + kRows, stride);
  }
}

template <int64_t QT>
void amx_gemm(const c10::BFloat16* x, const uint8_t* weight, Layout layout, int64_t M, int64_t N, int64_t K,
              c10::BFloat16* y) {
  const int64_t vectors = (M + kRows - 1) / kRows, row_bytes = gguf_row_bytes<QT>(K);
  const std::vector<uint32_t> paired = pair_rows(x, M, K, vectors);
  const int64_t panels = (N + kPanelColumns - 1) / kPanelColumns;
  std::atomic<int64_t> next_panel{0};  // claimed as threads go: a busy core takes fewer
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    configure_tiles();
    std::vector<c10::BFloat16> panel(kPanelColumns * K);
    RowReader<QT> rows(weight, row_bytes, layout);
    alignas(64) float out[kPanelColumns * 2 * kRows];
    for (int64_t p = next_panel.fetch_add(1); p < panels; p = next_panel.fetch_add(1)) {
      const int64_t n0 = p * kPanelColumns, columns = std::min<int64_t>(kPanelColumns, N - n0);
      for (int64_t n = 0; n < columns; ++n)
        dequantize_row<QT>(rows(n0 + n), K, layout, panel.data() + n * K);
      std::fill(panel.begin() + columns * K, panel.end(), c10::BFloat16(0.0f));
      for (int64_t v = 0; v < vectors; v += 2) {
        const uint32_t* xv = paired.data() + v * (K / 2) * kRows;
        const int rv = static_cast<int>(std::min<int64_t>(2, vectors - v));
        if (rv == 2)
          tile_block<2>(panel.data(), xv, K, out);
        else
          tile_block<1>(panel.data(), xv, K, out);
        carpool::kernels::store_tile<kRows>(out, rv, static_cast<int>(columns), v, M, y + n0, N);
      }
    }
    _tile_release();
  });
}

}  // namespace

void amx_exact_linear(const c10::BFloat16* x, const uint8_t* weight, int64_t qtype, int64_t M, int64_t N,
                      int64_t K, c10::BFloat16* y) {
  require_tile_permission();
  const RowFormat format = row_format(qtype);
  dispatch_qtype(format.qtype, [&]<int64_t QT>() { amx_gemm<QT>(x, weight, format.layout, M, N, K, y); });
}

}  // namespace carpool::ggml

#else

namespace carpool::ggml {
void amx_exact_linear(const c10::BFloat16*, const uint8_t*, int64_t, int64_t, int64_t, int64_t, c10::BFloat16*) {}
}  // namespace carpool::ggml

#endif
