#include "server/store/arch/config_json.h"

#include <sys/stat.h>
#include <unistd.h>

#include <charconv>
#include <filesystem>
#include <utility>

#include "server/store/checkpoint_file.h"

namespace attnserve {
namespace {

constexpr uintmax_t kMaxConfigJsonBytes = uintmax_t{16} << 20;

std::string ConfigJsonFile(const std::string& checkpoint) {
  return (std::filesystem::path(checkpoint).parent_path() / "config.json").string();
}

// The number of heads from config.json beside the checkpoint.
StatusOr<int64_t> HeadsFromConfigJson(const std::string& checkpoint, const std::string& beneath) {
  const std::string where = ConfigJsonPath(checkpoint);
  const std::string ask = "; give the number of heads in the source with heads=H";
  ATTNSERVE_ASSIGN_OR_RETURN(auto j, ReadConfigJson(checkpoint, beneath, ask));
  if (!j) {
    return InvalidArgumentError("the source does not say how many heads the layer has and there is no " + where +
                                " beside '" + checkpoint + "'" + ask);
  }
  for (const char* key : {"num_attention_heads", "n_head"}) {
    ATTNSERVE_ASSIGN_OR_RETURN(auto heads, JsonPositive(*j, key, where));
    if (heads > 0) return heads;
  }
  return InvalidArgumentError(where + " has neither 'num_attention_heads' nor 'n_head'" + ask);
}

}  // namespace

std::string FormatDouble(double v) {
  char buf[32];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc() ? std::string(buf, end) : std::to_string(v);
}

std::string ConfigJsonPath(const std::string& checkpoint) { return "'" + ConfigJsonFile(checkpoint) + "'"; }

StatusOr<std::optional<nlohmann::json>> ReadConfigJson(const std::string& checkpoint, const std::string& beneath,
                                                       const std::string& ask) {
  const std::string config = ConfigJsonFile(checkpoint);
  const std::string where = "'" + config + "'";
  StatusOr<FileDescriptor> fd = OpenCheckpointFile(beneath, config);
  if (!fd.ok()) {
    if (fd.status().code() == StatusCode::kNotFound) return std::optional<nlohmann::json>();
    return InvalidArgumentError(where + ": " + fd.status().message() + ask);
  }
  struct stat st {};
  if (::fstat(fd->get(), &st) != 0 || st.st_size > static_cast<off_t>(kMaxConfigJsonBytes)) {
    return InvalidArgumentError(where + ": cannot read it or larger than " + std::to_string(kMaxConfigJsonBytes) +
                                " bytes" + ask);
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t got = ::pread(fd->get(), text.data() + done, text.size() - done, static_cast<off_t>(done));
    if (got <= 0) return InvalidArgumentError(where + ": cannot read it" + ask);
    done += static_cast<size_t>(got);
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    return InvalidArgumentError(where + ": not valid JSON (at byte " + std::to_string(e.byte) + ")" + ask);
  } catch (const nlohmann::json::exception&) {
    return InvalidArgumentError(where + ": not valid JSON" + ask);
  }
  if (!j.is_object()) return InvalidArgumentError(where + ": expected a JSON object" + ask);
  return std::optional<nlohmann::json>(std::move(j));
}

StatusOr<int64_t> JsonPositive(const nlohmann::json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end()) return int64_t{0};
  if (!it->is_number_unsigned() || it->get<uint64_t>() < 1 || it->get<uint64_t>() > static_cast<uint64_t>(kMaxHeads)) {
    return InvalidArgumentError(where + ": '" + key + "' must be an integer in [1, " + std::to_string(kMaxHeads) +
                                "], got " + it->dump());
  }
  return static_cast<int64_t>(it->get<uint64_t>());
}

StatusOr<HeadSettings> HeadsFromSourceOrConfigJson(const SourceSpec& spec) {
  HeadSettings s;
  s.heads = spec.heads;
  s.rope_theta = spec.rope_theta.value_or(0.0);
  if (s.heads == 0) {
    ATTNSERVE_ASSIGN_OR_RETURN(s.heads, HeadsFromConfigJson(spec.path, spec.model_dir));
  }
  return s;
}

}  // namespace attnserve
