// The runtime's internal error: thrown inside the library, turned into a status and
// trtpaged_last_error() at the C boundary (runtime_api.cpp); never crosses it.
#pragma once

#include <stdexcept>
#include <string>

#include "trtpaged/trtpaged.h"

namespace trtpaged::rt {

struct Error : std::runtime_error {
  trtpaged_status status;
  Error(trtpaged_status s, const std::string& message) : std::runtime_error(message), status(s) {}
};

[[noreturn]] inline void raise(trtpaged_status status, const std::string& message) { throw Error(status, message); }
[[noreturn]] inline void invalid(const std::string& message) { raise(TRTPAGED_ERR_INVALID_ARGUMENT, message); }

// A kernel call's status as an Error (its message is already this thread's last error).
inline void check_kernel(int status, const char* what) {
  if (status != TRTPAGED_OK) raise(trtpaged_status(status), std::string(what) + ": " + trtpaged_last_error());
}

}  // namespace trtpaged::rt
