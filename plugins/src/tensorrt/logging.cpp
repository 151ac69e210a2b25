#include "tensorrt/logging.h"

#include <atomic>
#include <cstdio>

namespace trtpaged {
namespace trt {
namespace {
std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};
}  // namespace

void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept { gLoggerFinder.store(finder); }

void report(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept {
  try {
    std::string const line = "[trtpaged plugin] " + message;
    nvinfer1::ILoggerFinder* finder = gLoggerFinder.load();
    nvinfer1::ILogger* logger = finder != nullptr ? finder->findLogger() : nullptr;
    if (logger != nullptr) {
      logger->log(severity, line.c_str());
    } else if (severity <= nvinfer1::ILogger::Severity::kWARNING) {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  } catch (...) {
    // Nothing left to report with.
  }
}

}  // namespace trt
}  // namespace trtpaged
