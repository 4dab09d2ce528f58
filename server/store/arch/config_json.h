// config.json beside a checkpoint (Hugging Face's layout), as the checkpoint layouts read it:
// opened as the checkpoint is (beneath its model dir, regular files only, never blocking),
// at most 16 MiB, a JSON object; and the default config reader, which takes the number of
// heads from the source or from config.json.
// Thread-safety: free functions; call from any thread.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "server/core/status.h"
#include "server/store/arch/arch.h"
#include "server/store/source.h"

namespace attnserve {

// Shortest text that reads back as the same double ("0.99", "1e+06").
std::string FormatDouble(double v);

// 'DIR/config.json' for the checkpoint at `checkpoint`, quoted as messages show it.
std::string ConfigJsonPath(const std::string& checkpoint);

// config.json beside the checkpoint, parsed; nullopt when there is none. `ask` ends every
// error, saying what the source can give instead.
StatusOr<std::optional<nlohmann::json>> ReadConfigJson(const std::string& checkpoint, const std::string& beneath,
                                                       const std::string& ask);

// An integer field in [1, kMaxHeads], if there; 0 when absent. `where` begins the error.
StatusOr<int64_t> JsonPositive(const nlohmann::json& j, const char* key, const std::string& where);

// The default read_config: heads= from the source, else config.json's num_attention_heads (BERT
// and most Hugging Face models) or n_head (GPT-2); rope_theta= from the source, else none.
StatusOr<HeadSettings> HeadsFromSourceOrConfigJson(const SourceSpec& spec);

}  // namespace attnserve
