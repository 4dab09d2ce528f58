// What a form's projections multiply in: its math. A served variant is a (form, math) pair: the
// A/B dimension beside the form (docs/metrics.md, "Precision as an A/B dimension").
//   fp32  float32 weights and inputs (the CPU's GEMMs, cuBLAS's SGEMM)
//   tf32  TF32 tensor cores: float32 held, inputs rounded to a 10-bit mantissa (GPU only)
//   bf16  weights held in bfloat16 (8-bit mantissa), float32 accumulation and outputs; the GPU
//         and a CPU with AVX512_BF16 round the projections' inputs to bfloat16 as well
//   fp16  weights and inputs in IEEE half, float32 accumulation (GPU only)
// Attention itself (scores, softmax, mixes) runs in float32 under every math.
// Thread-safety: constants and pure functions.
#pragma once

#include <compare>
#include <optional>
#include <string_view>

#include "server/core/forms.h"

namespace attnserve {

enum class Math { kFp32 = 0, kTf32 = 1, kBf16 = 2, kFp16 = 3 };
inline constexpr Math kAllMaths[] = {Math::kFp32, Math::kTf32, Math::kBf16, Math::kFp16};
inline constexpr std::string_view kMathNames[] = {"fp32", "tf32", "bf16", "fp16"};

// "fp32", "tf32", "bf16", "fp16": the label of metrics, routes and the flags.
inline std::string_view MathName(Math m) { return kMathNames[static_cast<int>(m)]; }
inline std::optional<Math> ParseMath(std::string_view text) {
  for (Math m : kAllMaths) {
    if (text == MathName(m)) return m;
  }
  return std::nullopt;
}
// "fp32, tf32, bf16 or fp16": for messages that say what was expected.
inline constexpr std::string_view kMathChoices = "fp32, tf32, bf16 or fp16";

// The weights are held in 16 bits (bf16, fp16).
inline bool HalfWeights(Math m) { return m == Math::kBf16 || m == Math::kFp16; }

// One served variant of a layer: a form held in a math. Variant{form} is the form in fp32.
struct Variant {
  Form form = Form::kFactored;
  Math math = Math::kFp32;

  constexpr Variant() = default;
  constexpr Variant(Form f, Math m) : form(f), math(m) {}
  constexpr explicit Variant(Form f) : form(f) {}
  friend auto operator<=>(const Variant&, const Variant&) = default;
};

}  // namespace attnserve
