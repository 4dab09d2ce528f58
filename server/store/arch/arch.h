// Checkpoint layouts as data: one ArchLayout per architecture a safetensors source may hold
// (docs/sources.md, "Checkpoint layouts"). Each is defined in its own file in this folder and
// listed once in arch.cc's registry; it names its tensors, checks their shapes, fills
// LayerWeights from them and reads its config. source.cc only picks a layout (arch= or by
// detection from the anchor pattern) and calls it.
// Thread-safety: immutable data and free functions; call from any thread.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "server/core/layer.h"
#include "server/core/status.h"
#include "server/store/safetensors.h"
#include "server/store/source.h"

namespace attnserve {

// Where one layer sits in a file: the prefix of every tensor name (empty or ending in '.') and
// the block number (0 in a layout whose names carry none).
struct LayerAt {
  std::string prefix;
  int64_t index = 0;
};

// How a layout's anchor tensor (the one detection looks for) is named:
//   PREFIX + head + [INDEX] + tail.
struct AnchorPattern {
  std::string_view head;
  bool indexed = false;  // the name carries a block number, which index= selects
  std::string_view tail;
};

// The widths a layer's tensors imply: d_model, the query width (heads · d_head) and the
// key/value width (kv_heads · d_head); and whether the layer has biases.
struct LayerWidths {
  int64_t d_model = 0, q = 0, kv = 0;
  bool bias = false;
  std::string q_from;  // the tensor the query width was read from, for error messages
  std::string kv_from;
};

// What a layout's config reader settles before the widths are split into heads. The heads
// cannot be read from the weights; config_* are what config.json says the shapes must give
// (0: nothing to check, e.g. when the source's options override them).
struct HeadSettings {
  int64_t heads = 0;
  double rope_theta = 0;
  std::string config_json;      // where config_* come from, quoted, for error messages
  int64_t config_head_dim = 0;  // head_dim
  int64_t config_kv_heads = 0;  // num_key_value_heads
};

struct ArchLayout {
  std::string_view name;  // as arch= spells it; also what LayerSource::arch reports
  AnchorPattern anchor;
  // Every tensor the layer needs is present and floating, the shapes agree, and the biases are
  // all there or none; returns the widths. Errors name the file, the tensor and both shapes.
  StatusOr<LayerWidths> (*check_shapes)(const SafetensorsFile& file, const LayerAt& at);
  // Reads the weights and biases into our convention, y = x W + b with W [in, out]; `widths`
  // come from check_shapes, and `out->config` is already set.
  Status (*fill)(const SafetensorsFile& file, const LayerAt& at, const LayerWidths& widths, LayerWeights* out);
  // Heads and the rotary base from the source's options and the checkpoint's config.json.
  StatusOr<HeadSettings> (*read_config)(const SourceSpec& spec);
};

// Every registered layout, in the order messages list them.
std::span<const ArchLayout* const> ArchLayouts();

// The layout arch= names; nullptr when there is none ("auto" is none).
const ArchLayout* FindArchLayout(std::string_view name);

// The layouts' names as a message lists them: "torch-mha, gpt2, bert or llama".
std::string ArchLayoutChoices();

// INVALID_ARGUMENT for an arch= that names no layout, listing the ones there are.
Status UnknownArchError(std::string_view given);

// The anchor as messages show it, N for the block number: "h.N.attn.c_attn.weight".
std::string AnchorText(const AnchorPattern& anchor);

}  // namespace attnserve
