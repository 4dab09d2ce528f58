// The server's log: spdlog on stderr, text or one JSON object per line, with every message made
// safe for one line (a request's text could otherwise forge lines or break a JSON reader).
#pragma once

#include <string_view>

#include "server/server_options.h"

namespace attnserve {

// Installs the "attnserve" logger as spdlog's default, at --log-level, text or --log-json, and
// routes protobuf's own messages through it.
void ConfigureLogging(const ServerOptions& options);

// Length of the valid UTF-8 sequence starting at text[i], or 0 when the bytes there are not one
// (overlong forms, surrogates and code points past U+10FFFF included).
size_t Utf8SequenceLength(std::string_view text, size_t i);

}  // namespace attnserve
