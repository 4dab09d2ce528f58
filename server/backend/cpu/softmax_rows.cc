#include "server/backend/cpu/softmax_rows.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "server/backend/cpu/gemm.h"

// As the skinny GEMM: the vector kernels are compiled for their ISA whatever the build's own
// flags, and chosen only on a CPU that runs them, so a portable build gets them too.
#include "server/backend/cpu/isa_target.h"
#if defined(ATTNSERVE_X86_KERNELS)
#define ATTNSERVE_SOFTMAX_ROWS_VECTOR 1
#include <immintrin.h>
#endif

namespace attnserve {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Cephes' exp: x = n·ln2 + r with ln2 in two parts (C1 exact in float32, so n·C1 is exact for
// |n| < 2^15), then exp(r) ≈ 1 + r + r²·P(r) on |r| ≤ ln2/2.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kC1 = 0.693359375f, kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

namespace generic {

float RowMaxOrNaN(const float* p, int64_t n) {
  float top = -kInf;
  bool finite = true;
  for (int64_t j = 0; j < n; ++j) {
    finite = finite && std::isfinite(p[j]);
    top = std::max(top, p[j]);
  }
  return finite ? top : std::numeric_limits<float>::quiet_NaN();
}

float ExpShiftedAndSum(float* p, int64_t n, float top) {
  float sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - top));
  return sum;
}

}  // namespace generic

#if defined(ATTNSERVE_SOFTMAX_ROWS_VECTOR)
ATTNSERVE_TARGET_AVX512_BEGIN
namespace avx512 {

// exp(x) for x ≤ 0 in 16 lanes; _mm512_scalef_ps applies 2^n with denormals and underflow to 0,
// so the only clamp is one that keeps n an integer float32 holds.
[[gnu::always_inline]] inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // below: exp(x) < 2^-150 rounds to 0
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kC1), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kC2), r);
  __m512 y = _mm512_set1_ps(kP0);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP1));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP2));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP3));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP4));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP5));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

__mmask16 TailMask(int64_t left) { return static_cast<__mmask16>((1u << left) - 1); }

// Across the lanes through memory, once per row: GCC 12's _mm512_reduce_* read an undefined
// register in its headers (-Wuninitialized).
float LanesSum(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float sum = 0;
  for (float x : lanes) sum += x;
  return sum;
}

float LanesMax(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  return *std::max_element(lanes, lanes + 16);
}

// The max in two accumulators; `bad` sums v·0, which is 0 for a finite v and NaN for ±inf or NaN.
float RowMaxOrNaN(const float* p, int64_t n) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 top0 = _mm512_set1_ps(-kInf), top1 = top0, bad = zero;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 a = _mm512_loadu_ps(p + j), b = _mm512_loadu_ps(p + j + 16);
    top0 = _mm512_max_ps(top0, a);
    top1 = _mm512_max_ps(top1, b);
    bad = _mm512_fmadd_ps(a, zero, _mm512_fmadd_ps(b, zero, bad));
  }
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xffff) : TailMask(n - j);
    const __m512 a = _mm512_maskz_loadu_ps(m, p + j);  // 0 in the lanes past the row: harmless to `bad`
    top0 = _mm512_mask_max_ps(top0, m, top0, a);
    bad = _mm512_fmadd_ps(a, zero, bad);
  }
  if (std::isnan(LanesSum(bad))) return std::numeric_limits<float>::quiet_NaN();
  return LanesMax(_mm512_max_ps(top0, top1));
}

float ExpShiftedAndSum(float* p, int64_t n, float top) {
  const __m512 shift = _mm512_set1_ps(top);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 a = Exp(_mm512_sub_ps(_mm512_loadu_ps(p + j), shift));
    const __m512 b = Exp(_mm512_sub_ps(_mm512_loadu_ps(p + j + 16), shift));
    _mm512_storeu_ps(p + j, a);
    _mm512_storeu_ps(p + j + 16, b);
    sum0 = _mm512_add_ps(sum0, a);
    sum1 = _mm512_add_ps(sum1, b);
  }
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xffff) : TailMask(n - j);
    // Lanes past the row compute exp(0 − top), which may be inf: masked out of the sum.
    const __m512 a = _mm512_maskz_mov_ps(m, Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + j), shift)));
    _mm512_mask_storeu_ps(p + j, m, a);
    sum0 = _mm512_add_ps(sum0, a);
  }
  return LanesSum(_mm512_add_ps(sum0, sum1));
}

}  // namespace avx512
ATTNSERVE_TARGET_END

ATTNSERVE_TARGET_AVX2_FMA_BEGIN
namespace avx2 {

constexpr float kLowest = -87.33654f;  // exp(kLowest) = 2^-126, float32's smallest normal

// exp(x) for x ≤ 0 in 8 lanes: avx512::Exp's reduction and polynomial step for step (each ISA's
// intrinsics are their own types and target, so the two cannot share one body). 2^n is built in
// the exponent field, so below kLowest the lane is 0 (exp there is a denormal or 0 in float32: at
// most 2^-126 absolute, against a row sum ≥ 1).
[[gnu::always_inline]] inline __m256 Exp(__m256 x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(kLowest), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(kLowest));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kC1), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kC2), r);
  __m256 y = _mm256_set1_ps(kP0);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP1));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP2));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP3));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP4));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP5));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(exponent)));
}

float HorizontalSum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

float HorizontalMax(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

float RowMaxOrNaN(const float* p, int64_t n) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 top0 = _mm256_set1_ps(-kInf), top1 = top0, bad = zero;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256 a = _mm256_loadu_ps(p + j), b = _mm256_loadu_ps(p + j + 8);
    top0 = _mm256_max_ps(top0, a);
    top1 = _mm256_max_ps(top1, b);
    bad = _mm256_fmadd_ps(a, zero, _mm256_fmadd_ps(b, zero, bad));
  }
  for (; j + 8 <= n; j += 8) {
    const __m256 a = _mm256_loadu_ps(p + j);
    top0 = _mm256_max_ps(top0, a);
    bad = _mm256_fmadd_ps(a, zero, bad);
  }
  if (std::isnan(HorizontalSum(bad))) return std::numeric_limits<float>::quiet_NaN();
  const float head = HorizontalMax(_mm256_max_ps(top0, top1));
  const float tail = generic::RowMaxOrNaN(p + j, n - j);  // fewer than 8
  return std::isnan(tail) ? tail : std::max(head, tail);
}

float ExpShiftedAndSum(float* p, int64_t n, float top) {
  const __m256 shift = _mm256_set1_ps(top);
  __m256 sum0 = _mm256_setzero_ps(), sum1 = sum0;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256 a = Exp(_mm256_sub_ps(_mm256_loadu_ps(p + j), shift));
    const __m256 b = Exp(_mm256_sub_ps(_mm256_loadu_ps(p + j + 8), shift));
    _mm256_storeu_ps(p + j, a);
    _mm256_storeu_ps(p + j + 8, b);
    sum0 = _mm256_add_ps(sum0, a);
    sum1 = _mm256_add_ps(sum1, b);
  }
  for (; j + 8 <= n; j += 8) {
    const __m256 a = Exp(_mm256_sub_ps(_mm256_loadu_ps(p + j), shift));
    _mm256_storeu_ps(p + j, a);
    sum0 = _mm256_add_ps(sum0, a);
  }
  return HorizontalSum(_mm256_add_ps(sum0, sum1)) + generic::ExpShiftedAndSum(p + j, n - j, top);
}

}  // namespace avx2
ATTNSERVE_TARGET_END
#endif  // ATTNSERVE_SOFTMAX_ROWS_VECTOR

struct Kernels {
  float (*row_max)(const float*, int64_t);
  float (*exp_sum)(float*, int64_t, float);
  std::string_view isa;
};

const Kernels& Chosen() {
  static const Kernels kernels = [] {
#if defined(ATTNSERVE_SOFTMAX_ROWS_VECTOR)
    // CpuIsaAllowsAvx512: the CPU has AVX-512 and ATTNSERVE_CPU_ISA does not cap it (gemm.h).
    if (CpuIsaAllowsAvx512()) return Kernels{avx512::RowMaxOrNaN, avx512::ExpShiftedAndSum, "avx512"};
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      return Kernels{avx2::RowMaxOrNaN, avx2::ExpShiftedAndSum, "avx2"};
    }
#endif
    return Kernels{generic::RowMaxOrNaN, generic::ExpShiftedAndSum, "generic"};
  }();
  return kernels;
}

}  // namespace

float RowMaxOrNaN(const float* p, int64_t n) { return Chosen().row_max(p, n); }

float ExpShiftedAndSum(float* p, int64_t n, float top) { return Chosen().exp_sum(p, n, top); }

std::string_view SoftmaxRowsIsa() { return Chosen().isa; }

}  // namespace attnserve
