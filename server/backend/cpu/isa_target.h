#pragma once

// Regions of a source file compiled for one x86 ISA, under GCC and clang alike. The CPU kernels
// (skinny_gemm.cc, softmax_rows.cc) are compiled for their ISA whatever the build's own flags
// and chosen at run time only on a CPU that runs them, so a portable build gets them too. The
// sanitized trees are built with clang (scripts/sanitized-build): the kernels must be there too,
// or the sanitizers would never see them.
//
//   ATTNSERVE_TARGET_AVX512_BEGIN  ... ATTNSERVE_TARGET_END
//   ATTNSERVE_TARGET_AVX2_FMA_BEGIN ... ATTNSERVE_TARGET_END  (and F16C's half conversions)
//   ATTNSERVE_TARGET_AVX512_BF16_BEGIN ... ATTNSERVE_TARGET_END  (bf16_dot_gemm.cc)
//
// GCC's pragma applies to every function after it until the pop; clang's attribute to every
// function declared in the region. The kernels are plain functions and function templates, so
// the two agree on them.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ATTNSERVE_X86_KERNELS 1
#if defined(__clang__)
#define ATTNSERVE_TARGET_AVX512_BEGIN \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f\"))), apply_to = function)")
#define ATTNSERVE_TARGET_AVX2_FMA_BEGIN \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)")
#define ATTNSERVE_TARGET_AVX512_BF16_BEGIN \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512bf16\"))), apply_to = function)")
#define ATTNSERVE_TARGET_END _Pragma("clang attribute pop")
#else
#define ATTNSERVE_TARGET_AVX512_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f\")")
#define ATTNSERVE_TARGET_AVX2_FMA_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define ATTNSERVE_TARGET_AVX512_BF16_BEGIN \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512bf16\")")
#define ATTNSERVE_TARGET_END _Pragma("GCC pop_options")
#endif
#endif
