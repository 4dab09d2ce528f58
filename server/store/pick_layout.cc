#include "server/store/pick_layout.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "server/store/arch/tensors.h"

namespace attnserve {
namespace {

// An anchor tensor's PREFIX and block number (-1 for a layout whose names carry none).
struct Match {
  std::string prefix;
  int64_t index = -1;
};

// Splits `name` into PREFIX and INDEX when it is an anchor of `p`.
std::optional<Match> MatchAnchor(const AnchorPattern& p, std::string_view name) {
  if (name.size() < p.tail.size() || name.substr(name.size() - p.tail.size()) != p.tail) return std::nullopt;
  name.remove_suffix(p.tail.size());
  Match m;
  if (p.indexed) {
    size_t digits = 0;
    while (digits < name.size() && digits < 10 && name[name.size() - 1 - digits] >= '0' &&
           name[name.size() - 1 - digits] <= '9') {
      ++digits;
    }
    if (digits == 0 || digits > 9) return std::nullopt;
    m.index = 0;
    for (char c : name.substr(name.size() - digits)) m.index = m.index * 10 + (c - '0');
    name.remove_suffix(digits);
  }
  if (name.size() < p.head.size() || name.substr(name.size() - p.head.size()) != p.head) return std::nullopt;
  name.remove_suffix(p.head.size());
  if (!name.empty() && name.back() != '.') return std::nullopt;
  m.prefix = std::string(name);
  return m;
}

// Every anchor of `p` in the file, under `prefix` when one is given.
std::vector<Match> FindAnchors(const SafetensorsFile& file, const AnchorPattern& p,
                               const std::optional<std::string>& prefix) {
  std::vector<Match> found;
  for (const TensorInfo& t : file.tensors()) {
    auto m = MatchAnchor(p, t.name);
    if (m && (!prefix || m->prefix == *prefix)) found.push_back(std::move(*m));
  }
  return found;
}

// No layout's anchor is in the file: say which names were looked for.
Status NoLayoutFound(const SafetensorsFile& file, const SourceSpec& spec) {
  const std::string under = spec.prefix ? " under prefix '" + *spec.prefix + "'" : "";
  if (spec.arch != CheckpointArch::kAuto) {
    const ArchLayout* layout = FindArchLayout(spec.arch.name());
    if (layout == nullptr) return UnknownArchError(spec.arch.name());
    return NotFoundError(FileAt(file) + "no tensor named like '" + AnchorText(layout->anchor) + "'" + under +
                         ", as arch=" + std::string(layout->name) + " needs");
  }
  std::string expected;
  for (const ArchLayout* layout : ArchLayouts()) {
    if (!expected.empty()) expected += ", ";
    expected += "'" + AnchorText(layout->anchor) + "' (" + std::string(layout->name) + ")";
  }
  return NotFoundError(FileAt(file) + "cannot tell the layout: no tensor named like " + expected + under +
                       "; give arch= (and prefix=) to say where the attention weights are");
}

// The one prefix `anchors` sit under; several: give prefix=, listing up to 8 of them.
StatusOr<std::string> OnePrefix(const SafetensorsFile& file, const ArchLayout& layout,
                                const std::vector<Match>& anchors) {
  std::set<std::string> prefixes;
  for (const Match& m : anchors) prefixes.insert(m.prefix);
  if (prefixes.size() == 1) return *prefixes.begin();
  std::string list;
  int shown = 0;
  for (const auto& pr : prefixes) {
    if (shown++ == 8) {
      list += ", ...";
      break;
    }
    list += (list.empty() ? "'" : ", '") + pr + "'";
  }
  return InvalidArgumentError(FileAt(file) + "holds " + std::string(layout.name) + " layers under several prefixes (" +
                              list + "); give prefix=");
}

// The block index= asks for must be among `anchors`; the error gives the range the file holds.
Status CheckIndexPresent(const SafetensorsFile& file, const ArchLayout& layout, const std::vector<Match>& anchors,
                         const LayerAt& at) {
  if (!layout.anchor.indexed) return OkStatus();
  bool present = false;
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
  for (const Match& m : anchors) {
    present = present || m.index == at.index;
    lo = std::min(lo, m.index);
    hi = std::max(hi, m.index);
  }
  if (present) return OkStatus();
  return NotFoundError(FileAt(file) + "no " + std::string(layout.name) + " layer index=" + std::to_string(at.index) +
                       (at.prefix.empty() ? "" : " under prefix '" + at.prefix + "'") + " (the file holds indices " +
                       std::to_string(lo) + ".." + std::to_string(hi) + ")");
}

}  // namespace

StatusOr<PickedLayout> PickLayout(const SafetensorsFile& file, const SourceSpec& spec) {
  std::vector<std::pair<const ArchLayout*, std::vector<Match>>> candidates;
  for (const ArchLayout* layout : ArchLayouts()) {
    if (spec.arch != CheckpointArch::kAuto && spec.arch != CheckpointArch(layout->name)) continue;
    auto anchors = FindAnchors(file, layout->anchor, spec.prefix);
    if (!anchors.empty()) candidates.emplace_back(layout, std::move(anchors));
  }
  if (candidates.empty()) return NoLayoutFound(file, spec);
  if (candidates.size() > 1) {
    std::string archs;
    for (const auto& c : candidates) archs += (archs.empty() ? "" : ", ") + std::string(c.first->name);
    return InvalidArgumentError(FileAt(file) + "holds tensors of several layouts (" + archs + "); give arch=");
  }
  const auto& [layout, anchors] = candidates[0];
  ATTNSERVE_ASSIGN_OR_RETURN(auto prefix, OnePrefix(file, *layout, anchors));
  PickedLayout picked{layout, {prefix, spec.index.value_or(0)}};
  ATTNSERVE_RETURN_IF_ERROR(CheckIndexPresent(file, *layout, anchors, picked.at));
  return picked;
}

}  // namespace attnserve
