// Where in a safetensors checkpoint a layer's attention weights are: the layout (arch=) whose
// anchor tensors the file holds, under which prefix (prefix=) and at which block (index=).
// Part of loading a source (source.cc); errors name the file and what was looked for.
// Thread-safety: pure functions.
#pragma once

#include "server/core/status.h"
#include "server/store/arch/arch.h"
#include "server/store/safetensors.h"
#include "server/store/source.h"

namespace attnserve {

struct PickedLayout {
  const ArchLayout* layout;
  LayerAt at;
};

// The layout arch= gives or the only one whose anchors the file holds, the prefix given or the
// only one found, the index given or 0.
StatusOr<PickedLayout> PickLayout(const SafetensorsFile& file, const SourceSpec& spec);

}  // namespace attnserve
