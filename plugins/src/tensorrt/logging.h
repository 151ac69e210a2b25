// Reporting for the plugin library: messages go to the logger TensorRT hands
// over through setLoggerFinder(), or to stderr before it has. The calls go through
// ILoggerFinder's and ILogger's vtables, whose layout changed in TensorRT 11 (both
// derive from IVersionedInterface there): hence one library per TensorRT major.
#pragma once

#include <NvInferRuntime.h>

#include <exception>
#include <string>

namespace trtpaged {
namespace trt {

void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept;

void report(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept;

// Runs body() for a noexcept override: an exception is reported as an error
// ("<where>: <what>") and on_error is returned instead.
template <typename R, typename F>
R guarded(char const* where, R on_error, F&& body) noexcept {
  try {
    return body();
  } catch (std::exception const& e) {
    report(nvinfer1::ILogger::Severity::kERROR, std::string(where) + ": " + e.what());
  } catch (...) {
    report(nvinfer1::ILogger::Severity::kERROR, std::string(where) + ": unknown exception");
  }
  return on_error;
}

}  // namespace trt
}  // namespace trtpaged
