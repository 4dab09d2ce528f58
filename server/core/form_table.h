// Every form, defined once (docs/architecture.md, "Adding a form"): its name, its wire value, the
// load option that holds it, how many floats it holds, how its heads combine and how it is
// materialised. The store, validation, the error messages, the metrics' labels and the client
// loop over this table instead of naming forms themselves; tests/unit/form_table_test.cc ties
// the wire values and names to attnserve.v1.Form and each parameter formula to what the
// form's materialisation really holds.
// Thread-safety: an immutable table of constants and pure functions.
#pragma once

#include <cstdint>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "server/core/forms.h"
#include "server/core/layer.h"
#include "server/core/status.h"

namespace attnserve {

struct FormDef {
  Form form;
  // The label metrics, logs, routes, the CLI and the load options use ("summed"): attnserve.v1's
  // wire name without "FORM_", in lower case.
  std::string_view name;
  int wire;  // its attnserve.v1.Form value (FORM_SUMMED = 2)
  // The load option that makes a layer hold it ("summed=true", "lowrank=…"); empty: every
  // layer holds it.
  std::string_view hold_option;
  HeadCombine combine;
  // Floats the form holds for a layer of `config` (W_in, W_out and the biases); `total_rank`
  // is Σ r_i, read by the low-rank form only. The load refuses a form over --max-form-bytes by
  // this figure before materialising it.
  int64_t (*parameters)(const LayerConfig& config, int64_t total_rank);
  // Lays the form out for execution (server/core/forms.h); `ranks` are the low-rank form's r_i,
  // read by it only.
  StatusOr<FormWeights> (*materialize)(const LayerWeights& weights, const std::vector<int64_t>& ranks);
};

// `auto`: a request's form and a route's target that is no form. Nothing is held for it and it
// has no row (kAllForms, DefOf, DefOfWire and DefNamed never give it): the call path resolves it
// to the exact held form the cost model predicts cheaper for the request (server/core/form_cost.h)
// before any job is submitted, and everything after sees that form.
struct FormChoiceDef {
  std::string_view name;  // "auto"
  int wire;               // attnserve.v1.FORM_AUTO
};
inline constexpr FormChoiceDef kAutoChoice = {"auto", 4};

// One row per form, in the order of kAllForms (checked at compile time in form_table.cc).
extern const FormDef kFormTable[std::size(kAllForms)];

const FormDef& DefOf(Form form);
// The row whose wire value is `wire`; nullptr for FORM_UNSPECIFIED (0) and unknown values.
const FormDef* DefOfWire(int wire);
// The row named `name` ("summed"); nullptr for any other text.
const FormDef* DefNamed(std::string_view name);

// "FORM_FACTORED, FORM_SUMMED or FORM_LOWRANK": every form's wire name, for an error's
// "expected" (FORM_AUTO, no form, is named where it is accepted).
std::string WireFormNames();
// "factored, summed or lowrank".
std::string FormNames();
// "FORM_FACTORED, FORM_SUMMED, FORM_LOWRANK or FORM_AUTO": what a request's form or a route's
// target may be.
std::string WireChoiceNames();

// Floats `form` holds for a layer of `config` (FormDef::parameters).
int64_t FormParameters(Form form, const LayerConfig& config, int64_t total_rank = 0);

}  // namespace attnserve
