// The one attention skeleton: a forward of every form, written once over DeviceOps
// (device_ops.h). It plans the batch (plan.h), projects Q, K and the value block with one GEMM
// each over all stacked tokens, rotates Q and K (RoPE), and combines the heads as the form says
// (HeadCombineOf, server/core/forms.h):
//   concat-then-project (factored, lowrank): O_i = A_i V_i into O's head columns, Y = O W_out + b;
//   sum of mixes (summed): per sequence in its association order (SummedMixesFirst), either
//     Y = A_cat · [M_1; …; M_h] + b_eff (project first) or Y = Σ_i (A_i C) W_M_i + b_eff (mix
//     first, in chunks of parts under the mixes' bound).
// A new form chooses its HeadCombine in forms.cc; a new way to combine heads is one more branch
// here, and the devices gain an operation only if it needs one (docs/architecture.md, "Adding a
// form").
// Thread-safety: reentrant; `ops` serves this call alone.
#pragma once

#include <span>

#include "server/backend/attention/device_ops.h"

namespace attnserve {

// Runs `form` over the batch (already validated, ValidateBatch) and writes every output.
Status RunAttention(DeviceOps& ops, const FormWeights& form, const DeviceWeights& weights,
                    std::span<const Sequence> batch);

}  // namespace attnserve
