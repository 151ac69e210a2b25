"""The TensorRT all-reduce plugin on 2 GPUs: one TrtpagedAllReduce node per rank, NCCL loaded by the plugin.

Run by scripts/gpu_check.sh on a machine with >= 2 GPUs, TensorRT and the plugin library
(TRTPAGED_PLUGIN_LIB). Each rank (a process on its own GPU) builds a one-node engine from
the node trtpaged exports (builder/onnx_allreduce.py), runs it on x = (rank + 1) * ramp and
checks y against the sum over ranks computed here; then times the all-reduce of a decode
step's activations. Rank 0 makes the ncclUniqueId (libnccl via ctypes) and hands it to
every rank in TRTPAGED_NCCL_UNIQUE_ID, the plugin's contract. Prints one line per rank
and exits non-zero on any mismatch.

    python scripts/tp_allreduce_check.py [--world-size 2] [--hidden 576] [--tokens 1,64,512]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time


def nccl_unique_id_hex() -> str:
    """A fresh ncclUniqueId (128 bytes) as hex, from libnccl.so.2 ($TRTPAGED_NCCL_LIBRARY when set)."""
    lib = ctypes.CDLL(os.environ.get("TRTPAGED_NCCL_LIBRARY") or "libnccl.so.2")
    buf = ctypes.create_string_buffer(128)
    rc = lib.ncclGetUniqueId(buf)
    if rc != 0:
        raise RuntimeError(f"ncclGetUniqueId failed with {rc}")
    return buf.raw.hex()


def allreduce_onnx(rank: int, world_size: int, hidden: int) -> bytes:
    """A graph x [T, hidden] float16 -> TrtpagedAllReduce -> y, as the exporter writes the node."""
    from onnx import TensorProto, helper

    from trtpaged.builder.onnx_node import DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION

    node = helper.make_node("TrtpagedAllReduce", ["x"], ["y"], domain=DOMAIN, rank=rank, world_size=world_size,
                            plugin_version=PLUGIN_VERSION, plugin_namespace=PLUGIN_NAMESPACE)
    graph = helper.make_graph([node], "allreduce",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["T", hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["T", hidden])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
    return model.SerializeToString()


def run_rank(rank: int, world_size: int, hidden: int, tokens: list[int], unique_id: str, out) -> None:
    import tensorrt as trt
    import torch

    from trtpaged.tensorrt_env import load_plugin_library

    os.environ["TRTPAGED_NCCL_UNIQUE_ID"] = unique_id
    torch.cuda.set_device(rank)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    load_plugin_library(builder.get_plugin_registry(), trt.__version__)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(allreduce_onnx(rank, world_size, hidden)):
        raise RuntimeError("; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)))
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, hidden), (max(tokens), hidden), (max(tokens), hidden))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT could not build the all-reduce engine (see the log)")
    engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
    context = engine.create_execution_context()
    stream = torch.cuda.current_stream()
    lines, ok = [], True
    for t in tokens:
        ramp = torch.arange(t * hidden, device="cuda", dtype=torch.float32).remainder(97).view(t, hidden)
        x = ((rank + 1) * ramp / 97).half()
        y = torch.empty_like(x)
        context.set_input_shape("x", (t, hidden))
        context.set_tensor_address("x", x.data_ptr())
        context.set_tensor_address("y", y.data_ptr())
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("execute_async_v3 failed")
        torch.cuda.synchronize()
        want = (sum(r + 1 for r in range(world_size)) * ramp / 97).half()  # the plain sum over ranks
        err = float((y.float() - want.float()).abs().max())
        ok &= err <= 1e-2 * float(want.float().abs().max())
        start = time.perf_counter()
        for _ in range(100):
            context.execute_async_v3(stream.cuda_stream)
        torch.cuda.synchronize()
        us = (time.perf_counter() - start) / 100 * 1e6
        lines.append(f"T={t}: max err {err:.3g}, {us:.1f} us/all-reduce ({t * hidden * 2} bytes)")
    out.put((rank, ok, lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--tokens", default="1,64,512")
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < args.world_size:
        print(f"skipped: {args.world_size} ranks need {args.world_size} GPUs, found {torch.cuda.device_count()}")
        return 0
    tokens = [int(t) for t in args.tokens.split(",")]
    unique_id = nccl_unique_id_hex()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, args.world_size, args.hidden, tokens, unique_id, out))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    results = []
    for _ in procs:
        try:
            results.append(out.get(timeout=240))
        except Exception:  # noqa: BLE001  (a rank died or hung: report it)
            break
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    if len(results) != len(procs):
        print(f"FAILED: {len(results)}/{len(procs)} ranks reported (exit codes {[p.exitcode for p in procs]})")
        return 1
    ok = True
    for rank, rank_ok, lines in sorted(results):
        ok &= rank_ok
        print(f"rank {rank}: {'ok' if rank_ok else 'MISMATCH'}; " + "; ".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
