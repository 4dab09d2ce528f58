// The CUDA backend's options as data across the plugin boundary (plugin_abi.h): one table of
// CudaBackendOptions' fields by key, which the server reads to encode them and the plugin to
// decode them, so a new option is a field and a row, not a new ABI parameter. This file
// includes no CUDA headers; the server builds it without the CUDA toolkit.
// Thread-safety: pure functions over an immutable table.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "server/backend/cuda/cuda_backend.h"
#include "server/backend/plugin_abi.h"
#include "server/core/status.h"

namespace attnserve {

using OptionPairs = std::vector<std::pair<std::string, std::string>>;

// Every option of the table as key → value text ("true"/"false", decimal integers), in the
// table's order.
OptionPairs EncodeCudaOptions(const CudaBackendOptions& options);

// `pairs` as the ABI passes them. The result points into `pairs` and `items`, which must outlive it.
AttnserveOptions CudaOptionsView(const OptionPairs& pairs, std::vector<AttnserveOption>* items);

// The options the plugin was given, over CudaBackendOptions' defaults. INVALID_ARGUMENT, naming
// the option, what it expects and what it got, for a struct of another size or version, an
// unknown or repeated key, or a value out of its range.
StatusOr<CudaBackendOptions> DecodeCudaOptions(const AttnserveOptions* options);

// The keys the table knows, comma-separated (for messages and docs).
std::string CudaOptionKeys();

}  // namespace attnserve
