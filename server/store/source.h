// Layer sources: the SOURCE strings of the server's `--layer NAME=SOURCE` flag and of the
// LoadLayer RPC, and how each becomes validated LayerWeights (docs/sources.md):
//   random:d_model=D,heads=H[,kv_heads=K][,d_head=E][,bias=B][,seed=S][,COMMON...]
//   safetensors:PATH[,arch=NAME][,index=I][,prefix=P][,heads=H][,kv_heads=K][,COMMON...]
//   COMMON: summed=B, rope_theta=T, lowrank=energy:E|budget:R|divergence:EPS, calibration=PATH,
//           spectrum=B
// NAME is a checkpoint layout registered in server/store/arch/arch.cc.
// Parsing (ParseSource) does no I/O, so the grammar is checked before any file is touched.
// Thread-safety: free functions over values; call from any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>

#include "server/core/calibrated_rank.h"
#include "server/core/layer.h"
#include "server/core/spectrum.h"
#include "server/core/status.h"

namespace attnserve {

enum class SourceKind { kRandom, kSafetensors };

// A checkpoint layout a safetensors source may hold, by the name arch= gives it; kAuto: detect
// it from the tensor names. The layouts themselves are data in server/store/arch/ (arch.h
// lists them), so a new one needs no change here: its name comes from the registry.
class CheckpointArch {
 public:
  constexpr CheckpointArch() = default;
  // `name` must outlive the value: a layout's own static name.
  constexpr explicit CheckpointArch(std::string_view name) : name_(name) {}
  constexpr std::string_view name() const { return name_; }
  friend constexpr bool operator==(CheckpointArch a, CheckpointArch b) { return a.name_ == b.name_; }
  friend std::ostream& operator<<(std::ostream& os, CheckpointArch a) { return os << a.name_; }

  // kAuto, and the built-in layouts by name for callers that compare against one.
  static const CheckpointArch kAuto, kTorchMha, kGpt2, kBert, kLlama;

 private:
  std::string_view name_ = "auto";
};
inline constexpr CheckpointArch CheckpointArch::kAuto{};
inline constexpr CheckpointArch CheckpointArch::kTorchMha{"torch-mha"};
inline constexpr CheckpointArch CheckpointArch::kGpt2{"gpt2"};
inline constexpr CheckpointArch CheckpointArch::kBert{"bert"};
inline constexpr CheckpointArch CheckpointArch::kLlama{"llama"};

// "auto", "torch-mha", "gpt2", "bert", "llama", ...
std::string_view CheckpointArchName(CheckpointArch arch);

// Largest rope_theta accepted, from a source or a config.json: real models use 1e4 to 1e6; far
// beyond that the angles are all zero and the value is surely a typo.
inline constexpr double kMaxRopeTheta = 1e12;

// The low-rank form a source asks for: lowrank=energy:E, budget:R or divergence:EPS (the last
// with calibration=PATH or calibration=live:ROWS).
struct LowRankSpec {
  RankSelection selection;
  std::string text;  // as written, normalised: "energy:0.99", "budget:256", "divergence:0.05"
};

// A parsed SOURCE string. Fields that a kind does not use keep their defaults.
struct SourceSpec {
  SourceKind kind = SourceKind::kRandom;
  bool hold_summed = true;  // summed=false: the layer opts out of the summed form
  // spectrum=false: no per-head spectra at load (they cost O(heads·d_model·d_head²)); the
  // low-rank form needs them, so lowrank= and spectrum=false exclude each other.
  bool compute_spectrum = true;
  std::optional<LowRankSpec> lowrank;  // lowrank=: also hold the low-rank form
  // calibration=: a .npy of float32 [rows, d_model] inputs (lowrank=divergence:EPS needs it and
  // nothing else reads it). `calibration_dir` is set like `model_dir`, for loads over the API.
  std::string calibration;
  std::string calibration_dir;
  // calibration=live:ROWS instead: the first ROWS key rows of the layer's own traffic
  // (server/core/live_calibration.h); 0 when the source names a file or nothing.
  int64_t live_calibration_rows = 0;
  // rope_theta=: rotary embedding on Q and K (0: none). When absent, random sources have none
  // and arch=llama reads it from config.json.
  std::optional<double> rope_theta;

  // random: the layer's shape as given (CompleteConfig not yet applied) and the draw's seed.
  LayerConfig config;
  uint64_t seed = 1;

  // safetensors
  std::string path;
  // Set by the store for loads over the API: `path` is relative to this model dir and every
  // file of the source is opened beneath it (server/store/checkpoint_file.h). Empty: as given.
  std::string model_dir;
  CheckpointArch arch = CheckpointArch::kAuto;
  std::optional<int64_t> index;        // layouts with block numbers (gpt2, ...): which; default 0
  std::optional<std::string> prefix;   // prepended to every tensor name; default: detected
  int64_t heads = 0;                   // 0: from config.json beside the file
  int64_t kv_heads = 0;                // 0: inferred from the K/V tensor widths
};

// Parses SOURCE; INVALID_ARGUMENT naming the key (or the kind) that is unknown, repeated,
// missing its value or holding a bad one.
StatusOr<SourceSpec> ParseSource(std::string_view source);

// What a source yields: weights that passed ValidateWeights, and whether to hold the summed form.
struct LayerSource {
  LayerWeights weights;
  bool hold_summed = true;
  bool compute_spectrum = true;
  std::optional<LowRankSpec> lowrank;
  std::optional<CalibrationSet> calibration;  // read and checked against the layer's shape
  int64_t live_calibration_rows = 0;          // calibration=live:ROWS, checked against d_model
  CheckpointArch arch = CheckpointArch::kAuto;  // safetensors: the layout read (given or detected)
};

// Largest single form (weights and biases, float32) a source may produce by default: far above
// any real attention layer, far below what would take a server down.
inline constexpr int64_t kDefaultMaxFormBytes = int64_t{16} << 30;

// Draws or reads the weights of a parsed source and validates them. Checks the size of every
// form that will be materialised (the factored one; the summed one unless opted out) against
// `max_form_bytes` before allocating, RESOURCE_EXHAUSTED naming summed=false when only the
// summed form is too large. Errors from files name the file and the tensor.
StatusOr<LayerSource> LoadSource(const SourceSpec& spec, int64_t max_form_bytes = kDefaultMaxFormBytes);

// ParseSource then LoadSource.
StatusOr<LayerSource> LoadSource(std::string_view source, int64_t max_form_bytes = kDefaultMaxFormBytes);

}  // namespace attnserve
