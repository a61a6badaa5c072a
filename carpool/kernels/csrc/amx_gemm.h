// The exact GGML linear on AMX tiles (the `amx` build: -mamx-tile -mamx-bf16 on top of the avx512 flags): bf16
// activation rows against weights dequantized to bf16 as the avx512 exact path dequantizes them, multiplied by
// tdpbf16ps, fp32 sums. Same products, same fp32 accumulation as that path; only the order of the additions
// differs. The module that has it loads only where the AMX probe ran a tile multiply (carpool/kernels/cpu.py).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "vec.h"

namespace carpool::ggml {

// Activation rows from which the exact path runs on the tiles; 0 where this build has no AMX kernels. Their cost is
// about flat from 6 to 16 rows, the avx512 exact kernel's grows with them: at 6 rows the tiles are 1.2-1.4x it, at
// 16 rows 2.0-2.4x (Q4_K, Q6_K, Q4_1, Q8_0 at 8960x1536, 2 threads, Intel family 6 model 167). Fewer rows stay on
// the exact GEMV, which in the default int8-dot mode never runs them anyway (the int8 GEMV does).
#ifdef CARPOOL_AMX
inline constexpr int64_t kAmxMinRows = 6;
#else
inline constexpr int64_t kAmxMinRows = 0;
#endif

inline constexpr bool amx_exact_applies(int64_t M) { return kAmxMinRows > 0 && M >= kAmxMinRows; }

// y[M, N] = x[M, K] W^T for `qtype` blocks, every thread of at::parallel_for; a no-op where kAmxMinRows is 0.
void amx_exact_linear(const c10::BFloat16* x, const uint8_t* weight, int64_t qtype, int64_t M, int64_t N,
                      int64_t K, c10::BFloat16* y);

}  // namespace carpool::ggml
