#include "server/logging.h"

#include <google/protobuf/stubs/logging.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

namespace attnserve {

size_t Utf8SequenceLength(std::string_view text, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c = b(i);
  size_t n = 0;
  uint32_t cp = 0;
  if (c < 0x80) return 1;
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2, cp = c & 0x1f;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3, cp = c & 0x0f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4, cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (b(i + k) & 0x3f);
  }
  if ((n == 3 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff))) {
    return 0;
  }
  return n;
}

namespace {

// %v made safe for one log line: control characters and invalid UTF-8 never reach the log
// as they are (a request's text could otherwise forge lines or break a JSON reader). Text logs
// show such bytes as \xNN; JSON logs also escape '"' and '\\' and write U+FFFD for bad bytes.
template <bool kJson>
class SafeMessageFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    const std::string_view text(msg.payload.data(), msg.payload.size());
    for (size_t i = 0; i < text.size();) {
      const size_t n = Utf8SequenceLength(text, i);
      const auto c = static_cast<unsigned char>(text[i]);
      char buf[8];
      if (n == 0) {
        if (kJson) {
          dest.append(std::string_view("\\ufffd"));
        } else {
          std::snprintf(buf, sizeof buf, "\\x%02x", c);
          dest.append(std::string_view(buf));
        }
        ++i;
        continue;
      }
      if (n > 1) {
        dest.append(text.substr(i, n));
      } else if (kJson && (c == '"' || c == '\\')) {
        dest.push_back('\\');
        dest.push_back(static_cast<char>(c));
      } else if (c < 0x20 || c == 0x7f) {
        std::snprintf(buf, sizeof buf, kJson ? "\\u%04x" : "\\x%02x", c);
        dest.append(std::string_view(buf));
      } else {
        dest.push_back(static_cast<char>(c));
      }
      i += n;
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<SafeMessageFlag>(); }
};

}  // namespace

void ConfigureLogging(const ServerOptions& options) {
  // Logs go to stderr; stdout carries only the 'listening on' line that scripts read.
  auto logger = std::make_shared<spdlog::logger>("attnserve", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  if (options.log_json) {
    auto formatter = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc);
    formatter->add_flag<SafeMessageFlag<true>>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l","thread":%t,"msg":"%*"})");
    logger->set_formatter(std::move(formatter));
  } else {
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<SafeMessageFlag<false>>('*').set_pattern("%Y-%m-%d %H:%M:%S.%e %^%-5l%$ %*");
    logger->set_formatter(std::move(formatter));
  }
  logger->set_level(spdlog::level::from_str(options.log_level));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(std::move(logger));
  // protobuf writes to stderr on its own, past --log-level and --log-json: one line for each
  // request whose strings are not UTF-8, which any client could send to fill the log. Its lines
  // go through our logger at debug level instead (gRPC answers such a call UNIMPLEMENTED before
  // any handler runs; docs/service.md).
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel level, const char* /*file*/, int /*line*/, const std::string& message) {
        spdlog::log(level >= google::protobuf::LOGLEVEL_FATAL ? spdlog::level::critical : spdlog::level::debug,
                    "protobuf: {}", message);
      });
}

}  // namespace attnserve
