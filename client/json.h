// A JSON string literal for any text (quotes, backslashes and control characters escaped):
// the client's service config and the bench's JSON records both embed user input.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

namespace attnserve {

inline std::string JsonString(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace attnserve
