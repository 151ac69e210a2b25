"""Blocks past 2**32 pool elements, on every CPU attention path and in the block copies; pools past the int32
block ids refused.

An H200 or a large host holds KV pools of more than 2**31 elements (an int8 pool of 2.2 GB, an fp16 one of 4.3 GB),
so an element or byte offset computed in 32 bits would read and write the wrong place for the blocks near the pool's
end. Here the pool's address space is reserved without memory (PROT_NONE) and only the pages of the blocks the batch
uses are made readable, so that a pool of 2**32 elements and more costs a few MiB: the sequences' blocks lie at the
top of the pool and across its 2**31st and 2**32nd elements, and the kernels' output and writes must be those of the
plain reference over the same blocks in a small pool. A read or write of any other block faults (SIGSEGV), so the
cases run in a child process, whose fault fails the test instead of ending the session.

Block ids themselves are int32 (block tables, copy and swap pairs): a pool of more blocks than 2**31 - 1 is refused
naming the setting it came from.
"""

from __future__ import annotations

import ctypes
import mmap
import subprocess
import sys
import warnings

import pytest
import torch

from kernel_cases import MIXED_SPECS, make_batch
from runtime_helpers import for_each_cpu_isa
from trtpaged import kernels
from trtpaged.attention_options import AttentionOptions
from trtpaged.kv_budget import budget_blocks, check_host_pool, kv_blocks
from trtpaged.kv_quant import STORAGE_DTYPES, pack_rows, quantize_rows
from trtpaged.manifest import KVCacheBudget, Limits, read_manifest
from trtpaged.reference import paged_attention_reference

PAST = 2**32 + 2**20  # elements of the pool before its top blocks


def reserved_pool(num_blocks: int, block: torch.Tensor, backed: list[int]) -> torch.Tensor:
    """A pool [num_blocks, *block.shape] of block.dtype whose memory is only the pages of the `backed` blocks;
    every other page faults when read or written."""
    block_bytes = block.numel() * block.element_size()
    buf = mmap.mmap(-1, num_blocks * block_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=0)
    with warnings.catch_warnings():  # torch warns that a PROT_NONE buffer is not writable: the pages made so are
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps buf mapped
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    for b in backed:
        first = b * block_bytes // page * page
        last = -(-(b + 1) * block_bytes // page) * page
        if libc.mprotect(raw.data_ptr() + first, last - first, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
            raise OSError(ctypes.get_errno(), "mprotect of a block's pages failed")
    return raw.view(block.dtype).view(num_blocks, *block.shape)


def top_ids(num_small: int, per_block: int, used: list[int]) -> tuple[int, torch.Tensor]:
    """The big pool's block count and the id of each small-pool block in it: the blocks holding the 2**31st and
    2**32nd elements and those just after them go to used blocks, the others to the top of the pool."""
    num_big = PAST // per_block + num_small
    straddling = [2**31 // per_block, 2**31 // per_block + 1, 2**32 // per_block, 2**32 // per_block + 1]
    order = used[1::3][: len(straddling)]
    order += [b for b in range(num_small) if b not in order]
    ids = torch.empty(num_small, dtype=torch.int64)
    ids[torch.tensor(order)] = torch.tensor(straddling + list(range(num_big - (num_small - len(straddling)), num_big)))
    return num_big, ids


def attention_case(kv_cache_dtype: str) -> None:
    # prefills, chunks, decodes, and a decode split over key ranges (partials merged), in layer 1 of 2
    batch = make_batch(MIXED_SPECS + [(1100, 1)], num_layers=2, seed=5)
    if kv_cache_dtype in STORAGE_DTYPES:
        pool = pack_rows(*quantize_rows(batch.kv_cache, kv_cache_dtype))
    else:
        pool = batch.kv_cache.to(getattr(torch, kv_cache_dtype))
    q, k, v, _, positions, query_start, context_lens, tables = batch.args()
    used = list(dict.fromkeys(tables[tables >= 0].tolist()))
    num_big, ids = top_ids(pool.shape[0], pool[0].numel(), used)
    big = reserved_pool(num_big, pool[0], ids.tolist())
    big_tables = torch.where(tables >= 0, ids[tables.clamp(min=0).long()].to(torch.int32), tables)
    options = AttentionOptions(1, batch.scale)
    ref_cache = pool.clone()
    ref = paged_attention_reference(q, k, v, ref_cache, positions, query_start, context_lens, tables, options)

    def check(isa: str) -> None:
        big[ids] = pool
        out = kernels.paged_attention(q, k, v, big, positions, query_start, context_lens, big_tables, options)
        assert torch.equal(big[ids].view(torch.uint8), ref_cache.view(torch.uint8)), f"{isa}: K/V rows written"
        err = (out.double() - ref.double()).abs().max().item()
        assert err <= 2e-5, f"{isa}: max abs error {err} against the reference"

    for_each_cpu_isa(check)


def copies_case(dtype: torch.dtype) -> None:
    block = torch.empty(2, 2, 3, 16, 64 if dtype == torch.float32 else 66, dtype=dtype)
    num_big, ids = top_ids(8, block.numel(), list(range(8)))
    big = reserved_pool(num_big, block, ids.tolist())
    blocks = (torch.randn(8, *block.shape) * 20).to(dtype)
    big[ids] = blocks
    pairs = [(int(ids[i]), int(ids[(i + 1) % 8])) for i in range(0, 8, 2)]  # 4 pairs: one thread; 8 swaps: in parallel
    kernels.copy_blocks(big, pairs)
    for i in range(0, 8, 2):
        assert torch.equal(big[ids[(i + 1) % 8]], blocks[i]), f"copy of block {int(ids[i])}"
    out = torch.zeros_like(blocks)
    kernels.swap_blocks(big, out, [(int(b), i) for i, b in enumerate(ids)])
    assert torch.equal(out, big[ids])
    kernels.swap_blocks(blocks, big, [(i, int(b)) for i, b in enumerate(ids)])
    assert torch.equal(big[ids], blocks)


CASES = {**{f"attention, {name} cache": (attention_case, name)
            for name in ("float32", "float16", "bfloat16", "int8", "fp8_e4m3")},
         **{f"copies, {dtype} pool": (copies_case, dtype) for dtype in (torch.float32, torch.int8)}}


@pytest.mark.skipif(not kernels.available(), reason="kernel library not built")
def test_blocks_past_2_32_pool_elements_are_read_and_written_in_place() -> None:
    done = subprocess.run([sys.executable, "-X", "faulthandler", __file__], capture_output=True, text=True, timeout=300)
    ran = [line[4:] for line in done.stdout.splitlines() if line.startswith("ok: ")]
    assert done.returncode == 0 and ran == list(CASES), (
        f"exit status {done.returncode} (-11: a read or write outside the batch's blocks) after {ran}:\n"
        f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")



def test_a_pool_past_the_int32_block_ids_is_refused_naming_its_setting(tiny_engine_dir) -> None:
    # A num_kv_blocks override, a swap pool or a fraction budget of more blocks than int32 ids reach was taken (only
    # the manifest's num_kv_blocks and memory_bytes were bounded): a host with the memory went on to block ids that
    # wrap in the block tables and the kernels' int32 num_kv_blocks.
    from trtpaged import LLM

    manifest = read_manifest(tiny_engine_dir)
    assert kv_blocks(manifest, override=2**31 - 1) == 2**31 - 1
    past = r"got 2147483648 blocks, past 2147483647 \(int32 block ids\)"
    with pytest.raises(ValueError, match="num_kv_blocks: " + past):
        kv_blocks(manifest, override=2**31)
    with pytest.raises(ValueError, match="num_kv_blocks: " + past):  # before the pool's memory is weighed
        LLM(tiny_engine_dir, num_kv_blocks=2**31, warmup=False)
    with pytest.raises(ValueError, match="num_host_blocks: " + past):
        check_host_pool(2**31, 36, "cuda", 16)
    limits = Limits(max_batch_size=1 << 16, max_num_tokens=1 << 16, max_seq_len=1 << 24, block_size=1)
    with pytest.raises(ValueError, match=r"kv_cache.fraction: 0.9 of 100000000000 free bytes holds 2500000000 blocks "
                                         r"of 36 bytes, past 2147483647 \(int32 block ids\)"):
        budget_blocks(limits, KVCacheBudget(fraction=0.9), 36, free_memory=10**11)


@pytest.mark.skipif(not kernels.available(), reason="kernel library not built")
def test_the_kernels_refuse_a_pool_past_the_int32_block_ids() -> None:
    # ctypes wrapped the pool's block count into the C ABI's int32: a pool of 2**32 + 4 blocks was one of 4 (block 5
    # "out of range [0, 4)", blocks 0 to 3 ran), one of 2**31 + 4 one of -2147483644 (every block out of range)
    block = torch.empty(1, 2, 1, 1, 18, dtype=torch.int8)  # 36 bytes: 2**32 + 4 blocks reserve 144 GiB of addresses
    try:
        big = reserved_pool(2**32 + 4, block, list(range(4)))
    except OSError as exc:  # a ulimit -v
        pytest.skip(f"cannot reserve the pool's addresses: {exc}")
    i32 = torch.int32
    q = torch.randn(1, 1, 16)
    index = (torch.tensor([0], dtype=i32), torch.tensor([0, 1], dtype=i32), torch.tensor([1], dtype=i32),
             torch.tensor([[1]], dtype=i32))  # one token at position 0 of block 1
    past = r"4294967300 blocks, past 2147483647 \(int32 block ids\)"
    with pytest.raises(ValueError, match="kv_cache: " + past):
        kernels.paged_attention(q, q, q, big, *index, AttentionOptions(0, 0.25))
    with pytest.raises(ValueError, match="kv_cache: " + past):
        kernels.AttentionStep(big, *index, num_heads=1)
    with pytest.raises(ValueError, match="kv_cache: " + past):
        kernels.copy_blocks(big, [(1, 2)])
    with pytest.raises(ValueError, match="dst_pool: " + past):
        kernels.swap_blocks(torch.zeros_like(big[:1]), big, [(0, 2)])


if __name__ == "__main__":
    torch.set_num_threads(2)  # the tasks as on a 2-core machine, split decodes included, whatever this one has
    for label, (case, arg) in CASES.items():
        print("running:", label, flush=True)
        case(arg)
        print("ok:", label, flush=True)
