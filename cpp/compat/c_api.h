// The C functions the in-tree builds export from libc10_cuda (c10_backend.cpp on 2.x,
// torch_1_13.cpp on 1.13) return JSON strings: what they share.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace gmlake {
namespace compat {

// {"error": "<what>"} with the message's quotes, backslashes and control characters escaped.
inline std::string error_json(const char* what) {
  std::string out = "{\"error\": \"";
  for (const char* c = what; c != nullptr && *c != '\0'; ++c) {
    if (*c == '"' || *c == '\\') {
      out += '\\';
      out += *c;
    } else if (static_cast<unsigned char>(*c) < 0x20) {
      out += ' ';
    } else {
      out += *c;
    }
  }
  return out + "\"}";
}

// The JSON `make()` returns, or {"error": "..."} when it throws, in a string of the calling
// thread's that stays valid until the next call from the same thread and call site.
template <class Make>
const char* json_or_error(Make make) {
  thread_local std::string out;
  try {
    out = make();
  } catch (const c10::Error& e) {
    out = error_json(e.what_without_backtrace());
  } catch (const std::exception& e) {
    out = error_json(e.what());
  } catch (...) {
    out = error_json("unknown exception");
  }
  return out.c_str();
}

} // namespace compat
} // namespace gmlake
