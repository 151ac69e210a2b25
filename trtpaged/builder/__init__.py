"""The builder: model.yaml -> engine dir (export to ONNX, verify, compile with TensorRT, write)."""

from __future__ import annotations

from trtpaged.builder.pipeline import BuildError, BuildResult, build_engine

__all__ = ["BuildError", "BuildResult", "build_engine"]
