// bert: Hugging Face BERT, block I under no prefix or "bert." (any prefix ending in '.' is
// detected, e.g. "roberta."): four separate nn.Linear projections, transposed on load
// (docs/sources.md).
#include "server/store/arch/arch.h"
#include "server/store/arch/config_json.h"
#include "server/store/arch/tensors.h"

namespace attnserve {
namespace {

SeparateNames NamesAt(const LayerAt& at) {
  return SeparateLinearNames(at.prefix + "encoder.layer." + std::to_string(at.index) + ".attention.",
                             {"self.query", "self.key", "self.value", "output.dense"});
}

using Layout = SeparateLinearLayout<NamesAt>;

}  // namespace

extern const ArchLayout kBertLayout = {
    .name = "bert",
    .anchor = {.head = "encoder.layer.", .indexed = true, .tail = ".attention.self.query.weight"},
    .check_shapes = Layout::CheckShapes,
    .fill = Layout::Fill,
    .read_config = HeadsFromSourceOrConfigJson,
};

}  // namespace attnserve
