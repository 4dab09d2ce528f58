#include "server/core/form_table.h"

#include <cctype>

#include "server/core/spectrum.h"

namespace attnserve {
namespace {

// W_in = [W_Q | W_K | W_V], W_out = W_O; biases b_Q, b_K, b_V and b_O.
int64_t FactoredParameters(const LayerConfig& c, int64_t /*total_rank*/) {
  const int64_t q = c.heads * c.d_head, kv = c.kv_heads * c.d_head;
  const int64_t biases = c.bias ? q + 2 * kv + c.d_model : 0;
  return c.d_model * (q + 2 * kv) + q * c.d_model + biases;
}

// W_in = [W_Q | W_K | W_M_1 … W_M_h], no W_out; biases b_Q, b_K and b_eff.
int64_t SummedParameters(const LayerConfig& c, int64_t /*total_rank*/) {
  const int64_t q = c.heads * c.d_head, kv = c.kv_heads * c.d_head;
  const int64_t biases = c.bias ? q + kv + c.d_model : 0;
  return c.d_model * (q + kv + c.heads * c.d_model) + biases;
}

// W_in = [W_Q | W_K | P_1 … P_h], W_out = [Q_1; …; Q_h]; biases b_Q, b_K and b_eff.
int64_t LowRankParameters(const LayerConfig& c, int64_t total_rank) {
  const int64_t q = c.heads * c.d_head, kv = c.kv_heads * c.d_head;
  const int64_t biases = c.bias ? q + kv + c.d_model : 0;
  return c.d_model * (q + kv + total_rank) + total_rank * c.d_model + biases;
}

StatusOr<FormWeights> Factored(const LayerWeights& w, const std::vector<int64_t>& /*ranks*/) {
  return MaterializeFactored(w);
}
StatusOr<FormWeights> Summed(const LayerWeights& w, const std::vector<int64_t>& /*ranks*/) {
  return MaterializeSummed(w);
}

}  // namespace

constexpr FormDef kFormTable[std::size(kAllForms)] = {
    {Form::kFactored, "factored", 1, "", HeadCombine::kConcatThenProject, FactoredParameters, Factored},
    {Form::kSummed, "summed", 2, "summed", HeadCombine::kSumOfMixes, SummedParameters, Summed},
    {Form::kLowRank, "lowrank", 3, "lowrank", HeadCombine::kConcatThenProject, LowRankParameters, MaterializeLowRank},
};

// DefOf indexes the table by the enum's value, so each row sits at its form's value, and every
// form has one: a row missing or out of place is a build error.
constexpr bool RowsInFormOrder() {
  for (size_t i = 0; i < std::size(kAllForms); ++i) {
    if (kFormTable[i].form != kAllForms[i] || static_cast<size_t>(kAllForms[i]) != i) return false;
  }
  return true;
}
static_assert(RowsInFormOrder(), "kAllForms lists every Form in the order of its values, as kFormTable's rows do");

const FormDef& DefOf(Form form) { return kFormTable[static_cast<size_t>(form)]; }

const FormDef* DefOfWire(int wire) {
  for (const FormDef& def : kFormTable) {
    if (def.wire == wire) return &def;
  }
  return nullptr;
}

const FormDef* DefNamed(std::string_view name) {
  for (const FormDef& def : kFormTable) {
    if (def.name == name) return &def;
  }
  return nullptr;
}

namespace {

std::string Listed(std::string_view prefix, bool upper) {
  std::string out;
  for (size_t i = 0; i < std::size(kFormTable); ++i) {
    if (i > 0) out += i + 1 == std::size(kFormTable) ? " or " : ", ";
    out += prefix;
    for (char c : kFormTable[i].name) out += upper ? static_cast<char>(std::toupper(static_cast<unsigned char>(c))) : c;
  }
  return out;
}

}  // namespace

std::string WireFormNames() { return Listed("FORM_", true); }
std::string FormNames() { return Listed("", false); }

std::string WireChoiceNames() {
  const std::string forms = Listed("FORM_", true);
  std::string names = forms.substr(0, forms.rfind(" or ")) + ", " + forms.substr(forms.rfind(" or ") + 4) + " or FORM_";
  for (char c : kAutoChoice.name) names += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return names;
}

int64_t FormParameters(Form form, const LayerConfig& config, int64_t total_rank) {
  return DefOf(form).parameters(config, total_rank);
}

}  // namespace attnserve
