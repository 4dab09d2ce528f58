#include "server/store/arch/arch.h"

namespace attnserve {

// The registry. Each layout is defined in its own file beside this one; registering it is its
// declaration here and its place in kLayouts, whose order is the order messages list them in.
extern const ArchLayout kTorchMhaLayout;
extern const ArchLayout kGpt2Layout;
extern const ArchLayout kBertLayout;
extern const ArchLayout kLlamaLayout;

namespace {

constexpr const ArchLayout* kLayouts[] = {&kTorchMhaLayout, &kGpt2Layout, &kBertLayout, &kLlamaLayout};

}  // namespace

std::span<const ArchLayout* const> ArchLayouts() { return kLayouts; }

const ArchLayout* FindArchLayout(std::string_view name) {
  for (const ArchLayout* layout : kLayouts) {
    if (layout->name == name) return layout;
  }
  return nullptr;
}

std::string ArchLayoutChoices() {
  std::string s;
  const size_t n = std::size(kLayouts);
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) s += i + 1 == n ? " or " : ", ";
    s += kLayouts[i]->name;
  }
  return s;
}

Status UnknownArchError(std::string_view given) {
  return InvalidArgumentError("option 'arch': expected " + ArchLayoutChoices() + ", got '" + std::string(given) + "'");
}

std::string AnchorText(const AnchorPattern& anchor) {
  return std::string(anchor.head) + (anchor.indexed ? "N" : "") + std::string(anchor.tail);
}

}  // namespace attnserve
