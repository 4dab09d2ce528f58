// libFuzzer target: bytes → ParseSource (server/store/source.h), the SOURCE grammar of
// --layer and LoadLayer (docs/sources.md). Parsing does no I/O. Nothing may crash, and what it
// accepts must be within the grammar's documented bounds. A random source's config is then
// completed and its forms sized, as LoadSource does before it draws the weights.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "server/core/form_table.h"
#include "server/store/source.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  StatusOr<SourceSpec> spec = ParseSource(text);
  if (!spec.ok()) return 0;
  // Bounds of docs/sources.md that every accepted source keeps.
  bool bad = false;
  if (spec->rope_theta && !(*spec->rope_theta >= 0 && *spec->rope_theta <= 1e12)) bad = true;
  if (spec->kind == SourceKind::kRandom) {
    const LayerConfig& c = spec->config;
    if (c.d_model < 1 || c.d_model > kMaxDModel || c.heads < 1 || c.heads > kMaxHeads) bad = true;
    // What LoadSource does next without drawing anything: complete the config and size its
    // forms (UBSan sees any overflow in the products).
    StatusOr<LayerConfig> complete = CompleteConfig(c);
    if (complete.ok()) {
      volatile int64_t sizes = FormParameters(Form::kFactored, *complete) + FormParameters(Form::kSummed, *complete);
      (void)sizes;
    }
  }
  if (spec->lowrank && !spec->compute_spectrum) bad = true;  // they exclude each other
  if (bad) {
    std::fprintf(stderr, "source fuzz: ParseSource accepted an out-of-bounds source: %.*s\n",
                 static_cast<int>(text.size()), text.data());
    std::abort();
  }
  return 0;
}
