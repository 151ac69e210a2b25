"""KV tiers below the pool: exact restores from host memory, disk and Redis, bad entries as misses,
a store killed mid-run, restarts, and exact pool accounting throughout.

The truth is the engine itself without tiers (same model, same prompts, greedy) and the bytes the pool
held when a block was computed: a restored block must equal them bit for bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from trtpaged.bench.redis_process import RedisProcess
from trtpaged.runtime.kv_tiers.checked import CheckedTier, EntryCodec
from trtpaged.runtime.kv_tiers.config import KVTierConfig
from trtpaged.runtime.kv_tiers.disk import ABANDONED_WRITE_S, DiskTier, namespace_of
from trtpaged.runtime.kv_tiers.entry import ROOT, EntryMismatch, chain_key, decode_entry, encode_entry, root_key
from trtpaged.runtime.kv_tiers.entry import engine_fingerprint, entry_bytes
from trtpaged.runtime.kv_tiers.host import HostMemoryTier
from trtpaged.runtime.kv_tiers.stack import BlockRecord, TierHit, TierStack
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.runners import TorchRunner
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.runtime.sequence import Sequence

from runtime_helpers import runtime_config, tiny_hf

BS = 16
NUM_KV_BLOCKS = 12  # a 70-token prompt takes 5: three other prompts evict the first one's cached blocks
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _prompt(seed: int, n: int = 70) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


A, B, C, D = (_prompt(s) for s in range(4))
TRAFFIC = [A, B, C, D, A, B, A]  # A comes back after the pool evicted it, B too, then A again


@pytest.fixture(scope="module")
def step_model():
    from trtpaged.models import dims_from_hf_config, step_model_from_hf

    hf = tiny_hf()
    return step_model_from_hf(hf.model, dims_from_hf_config(hf.config))


def _fingerprint(kv_cache_dtype: Optional[str], tag: str = "tiny") -> bytes:
    return engine_fingerprint(model=tag, kv_cache_dtype=kv_cache_dtype or "float32", block_size=BS, rank=0)


def make_engine(model, tiers: Optional[KVTierConfig] = None, kv_cache_dtype: Optional[str] = None,
                fingerprint: Optional[bytes] = None) -> LLMEngine:  # fmt: skip
    pool = model.new_kv_cache(NUM_KV_BLOCKS, BS, kv_cache_dtype)
    stack = None
    if tiers is not None:
        stack = tiers.build(fingerprint or _fingerprint(kv_cache_dtype), pool[0].numel() * pool.element_size())
    config = runtime_config(num_kv_blocks=NUM_KV_BLOCKS, block_size=BS, max_num_tokens=128, max_batch_size=4)
    return LLMEngine(TorchRunner(model, pool), config, None, [], tiers=stack)


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    rid = engine.add_request(prompt, params)
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
    assert out is not None and out.outputs[0].finish_reason == "length"
    return list(out.outputs[0].token_ids)


def cached_bytes(engine: LLMEngine, prompt: list[int]) -> list[bytes]:
    """The pool's bytes of the prompt's cached full blocks (found as a prefix hit would find them)."""
    probe = Sequence(10**6, prompt)
    hits = engine.kv.find_cached_prefix(probe)
    engine.kv.free(probe)  # drops what the lookup staged for it
    blocks = [h.block_id for h in hits if hasattr(h, "block_id")]
    assert len(blocks) == len(hits)
    return engine.runner.read_blocks(blocks)


def loaded_prefix(kv, seq: Sequence, timeout: float = 10.0) -> list:
    """The sequence's prefix hits once its tier read (started by `prefetch`, as the scheduler does) is done."""
    deadline = time.monotonic() + timeout
    while not kv.prefetch(seq):
        assert time.monotonic() < deadline, "the tier read did not finish"
        kv.wait_for_loads(0.05)
    return kv.find_cached_prefix(seq)


def assert_pool_whole(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    assert pool.num_free == pool.num_kv_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not engine.kv.tables and not engine.kv._loads and engine.kv.staged_blocks() == 0


@pytest.fixture(scope="module")
def reference(step_model) -> dict[Optional[str], list[list[int]]]:
    """Greedy outputs of TRAFFIC without tiers, per KV dtype."""
    out = {}
    for kv_cache_dtype in (None, "int8"):
        engine = make_engine(step_model, kv_cache_dtype=kv_cache_dtype)
        out[kv_cache_dtype] = [run_one(engine, p) for p in TRAFFIC]
        assert_pool_whole(engine)
    return out


# ---- the entry format -------------------------------------------------------------------------
def test_entry_round_trip_and_every_bad_entry_is_a_mismatch():
    fp, other = _fingerprint(None), _fingerprint(None, "another model")
    tokens = tuple(range(BS))
    payload = os.urandom(256)
    entry = encode_entry(fp, ROOT, tokens, payload)
    assert decode_entry(entry, fp, ROOT, tokens, len(payload)) == payload
    bad = {
        "missing": None,
        "truncated": entry[:-1],
        "corrupted": entry[:-5] + bytes([entry[-5] ^ 1]) + entry[-4:],
        "foreign": encode_entry(other, ROOT, tokens, payload),
    }
    for reason, data in bad.items():
        with pytest.raises(EntryMismatch) as e:
            decode_entry(data, fp, ROOT, tokens, len(payload))
        assert e.value.reason == reason
    with pytest.raises(EntryMismatch) as e:  # bytes appended: not a truncation (the detail says what)
        decode_entry(entry + b"x", fp, ROOT, tokens, len(payload))
    assert (e.value.reason, e.value.detail) == ("corrupted", "payload 257+ of 256 bytes")
    for args in [(fp, chain_key(fp, ROOT, tokens), tokens, len(payload)),  # another parent
                 (fp, ROOT, tokens[:-1] + (999,), len(payload)),  # other tokens
                 (fp, ROOT, tokens, len(payload) + 4)]:  # another block shape
        with pytest.raises(EntryMismatch):
            decode_entry(entry, *args)
    assert chain_key(fp, ROOT, tokens) != chain_key(other, ROOT, tokens)


def test_stack_counts_bad_entries_as_misses(tmp_path: Path, caplog):
    fp = _fingerprint(None)
    disk = DiskTier(tmp_path, 1 << 20)
    stack = TierStack([CheckedTier(disk, EntryCodec(fp, 64))], fp)
    records = []
    parent = ROOT
    for j in range(4):
        tokens = tuple(range(j * BS, (j + 1) * BS))
        records.append(BlockRecord(chain_key(fp, parent, tokens), parent, tokens))
        parent = records[-1].key
    payloads = [bytes([j]) * 64 for j in range(4)]
    stack.save(list(zip(records, payloads)))
    stack.flush()
    assert [stack.lookup(r) for r in records] == [(p, "disk") for p in payloads]
    paths = [disk.path_of(r.key) for r in records]
    paths[0].write_bytes(paths[0].read_bytes()[:-3])  # truncated
    data = bytearray(paths[1].read_bytes())
    data[-1] ^= 0x80  # one bit of the payload
    paths[1].write_bytes(bytes(data))
    paths[2].write_bytes(encode_entry(_fingerprint(None, "other"), records[2].parent, records[2].tokens, payloads[2]))
    paths[3].unlink()
    before = disk.counters.hits
    assert [stack.lookup(r) for r in records] == [None] * 4
    assert disk.counters.hits == before
    assert disk.counters.invalid == 3 and disk.counters.misses == 4
    warned = [r.getMessage() for r in caplog.records if "failed its checks" in r.getMessage()]
    assert warned == ["kv tier disk: an entry failed its checks (truncated: payload 61 of 64 bytes) and is removed; "
                      "1 so far"], warned
    # a bad entry is removed, so the next write-back replaces it (was: skipped for ever, the key being present)
    assert not any(p.exists() for p in paths) and disk.num_entries == 0 and disk.used_bytes == 0
    stack.save(list(zip(records, payloads)))
    stack.flush()
    assert [stack.lookup(r) for r in records] == [(p, "disk") for p in payloads]


def test_what_another_process_puts_under_an_entry_name_is_read_no_further_than_its_checks(tmp_path: Path):
    """A FIFO (whose open would block the loader thread, and shutdown with it), a 1 GiB sparse file (read whole
    into memory), a link and a directory under entries' names: each is an invalid entry at once, and removed."""
    fp = _fingerprint(None)
    disk = DiskTier(tmp_path, 1 << 20)
    stack = TierStack([CheckedTier(disk, EntryCodec(fp, 64))], fp)
    records = [BlockRecord(chain_key(fp, ROOT, (j,) * BS), ROOT, (j,) * BS) for j in range(4)]
    paths = [disk.path_of(r.key) for r in records]
    os.mkfifo(paths[0])
    with open(paths[1], "wb") as f:
        f.truncate(1 << 30)
    paths[2].symlink_to(tmp_path / "elsewhere")
    paths[3].mkdir()
    found: list = []
    reader = threading.Thread(target=lambda: found.extend(stack.lookup(r) for r in records), daemon=True)
    reader.start()
    reader.join(10.0)  # a blocking open of the FIFO would hang here (the daemon thread is left behind)
    assert not reader.is_alive() and found == [None] * 4
    assert disk.counters.invalid == 4 and not any(p.exists() or p.is_symlink() for p in paths)
    stack.save([(records[0], b"x" * 64)])
    stack.flush()
    assert stack.lookup(records[0]) == (b"x" * 64, "disk")
    stack.close()


def test_checked_tiers_sharing_a_codec_store_each_block_as_its_own_entry(tmp_path: Path):
    """Two disk stores behind one codec (as disk and Redis are): the codec reuses the entry it just encoded only
    for the same record, so a second block with the same payload object gets its own entry, and each store
    answers exactly its records."""
    fp = _fingerprint(None)
    codec = EntryCodec(fp, 64)
    first = CheckedTier(DiskTier(tmp_path / "a", 1 << 20), codec)
    second = CheckedTier(DiskTier(tmp_path / "b", 1 << 20), codec)
    stack = TierStack([first, second], fp, background=False)
    payload = b"p" * 64
    a_tokens, b_tokens = tuple(range(BS)), tuple(range(BS, 2 * BS))
    a = BlockRecord(chain_key(fp, ROOT, a_tokens), ROOT, a_tokens)
    b = BlockRecord(chain_key(fp, a.key, b_tokens), a.key, b_tokens)
    stack.save([(a, payload), (b, payload)])
    for store in (first.store, second.store):
        assert decode_entry(store.get(a.key), fp, ROOT, a_tokens, 64) == payload
        assert decode_entry(store.get(b.key), fp, a.key, b_tokens, 64) == payload
    assert second.get_block(BlockRecord(b.key, ROOT, b_tokens)) is None  # the key, another parent: invalid
    assert second.counters.invalid == 1 and first.counters.puts == second.counters.puts == 2


def test_host_tier_is_bounded_lru():
    def record(i: int) -> BlockRecord:
        return BlockRecord(bytes([i]) * 32, ROOT, (i,) * BS)

    size = entry_bytes(BS, 100)  # a block counts as its encoded entry's size
    tier = HostMemoryTier(3 * size)
    for i in range(4):
        tier.put_block(record(i), bytes([i]) * 100)
    assert tier.used_bytes == 3 * size and tier.num_entries == 3 and tier.counters.evictions == 1
    assert not tier.contains(record(0).key) and tier.contains(record(3).key)
    assert tier.get_block(record(1)) == bytes([1]) * 100  # most recently used now: 2 goes next
    tier.put_block(record(4), b"y" * 100)
    assert tier.contains(record(1).key) and not tier.contains(record(2).key)


def test_host_tier_answers_only_the_exact_record():
    """The host tier keeps the pool's bytes with their record and answers a lookup only for an equal record
    (the pool's exact-identity rule): the same key with another parent or other tokens is an invalid miss."""
    fp = _fingerprint(None)
    tokens = tuple(range(BS))
    good = BlockRecord(chain_key(fp, ROOT, tokens), ROOT, tokens)
    stack = TierStack([HostMemoryTier(1 << 20)], fp, background=False)
    stack.save([(good, b"k" * 64)])
    assert stack.lookup(good) == (b"k" * 64, "host")
    for other in (BlockRecord(good.key, good.key, tokens), BlockRecord(good.key, ROOT, tokens[:-1] + (7,))):
        assert stack.lookup(other) is None
    host = stack.tiers[0]
    assert host.counters.hits == 1 and host.counters.misses == 2 and host.counters.invalid == 2


def test_a_queued_write_back_is_read_as_many_bytes_as_the_written_block():
    """A lookup that finds a block still queued for the writer counts a hit of the top tier and the block's entry
    bytes, as the tier counts the same block once written (round 8 counted the bare payload there)."""
    gate = threading.Event()

    class GatedHost(HostMemoryTier):
        def put_block(self, record: BlockRecord, payload: bytes) -> None:
            gate.wait(10)
            super().put_block(record, payload)

    fp = _fingerprint(None)
    tokens = tuple(range(BS))
    good = BlockRecord(chain_key(fp, ROOT, tokens), ROOT, tokens)
    stack = TierStack([GatedHost(1 << 20)], fp, background=True)
    host = stack.tiers[0]
    try:
        stack.save([(good, b"q" * 96)])
        assert stack.lookup(good) == (b"q" * 96, "host") and host.num_entries == 0  # still queued
        queued = host.counters.bytes_read
        gate.set()
        stack.flush()
        assert host.num_entries == 1 and stack.lookup(good) == (b"q" * 96, "host")
        assert queued == entry_bytes(BS, 96) and host.counters.bytes_read == 2 * queued and host.counters.hits == 2
    finally:
        gate.set()
        stack.close()


def test_engines_sharing_a_disk_dir_never_evict_each_others_entries(tmp_path: Path):
    """Each engine's entries live under its own namespace: a small tier starting on the directory of a large one
    leaves the large one's entries alone (was: it counted them as its own and evicted every one); replicas of
    one engine (the same namespace) share theirs."""
    large = DiskTier(tmp_path, 10_000, namespace="aaaa")
    for i in range(5):
        large.put(bytes([i]) * 32, b"z" * 300)
    small = DiskTier(tmp_path, 400, namespace="bbbb")
    small.put(bytes([9]) * 32, b"y" * 300)
    small.put(bytes([8]) * 32, b"y" * 300)  # evicts its own first entry, nothing of the other's
    assert small.num_entries == 1 and small.counters.evictions == 1
    replica = DiskTier(tmp_path, 10_000, namespace="aaaa")
    assert replica.num_entries == 5 and all(replica.get(bytes([i]) * 32) == b"z" * 300 for i in range(5))


def test_stale_entries_of_other_namespaces_go_when_the_directory_is_over_size(tmp_path: Path):
    """Entries no running engine counts (an older build's namespace: a rebuild is another fingerprint; the flat
    layout before namespaces) unused for a day are removed oldest first while the directory is over the starting
    tier's size; recent ones of a live neighbour stay (was: kept for ever, the directory past every size). The
    starting tier's own entries from its last run stay (a restart: was a failed scan of the wrong path, nothing
    removed)."""
    from trtpaged.runtime.kv_tiers import disk as disk_module

    old_build = DiskTier(tmp_path, 10_000, namespace="0" * 16)
    live = DiskTier(tmp_path, 10_000, namespace="1" * 16)
    for i in range(3):
        old_build.put(bytes([i]) * 32, b"o" * 300)
        live.put(bytes([i]) * 32, b"l" * 300)
    legacy = tmp_path / (bytes([7]) * 32).hex()
    legacy.with_suffix(".kv").write_bytes(b"x" * 300)
    day_ago = time.time() - disk_module.STALE_S - 60
    for path in [*(tmp_path / ("0" * 16)).iterdir(), legacy.with_suffix(".kv")]:
        os.utime(path, (day_ago, day_ago))
    DiskTier(tmp_path, 10_000, namespace="2" * 16).put(bytes([9]) * 32, b"r" * 300)  # its last run's entry
    # the restart: 4 stale + 3 live entries of 300 bytes besides its own: over, so the stale go
    restarted = DiskTier(tmp_path, 900, namespace="2" * 16)
    assert not (tmp_path / ("0" * 16)).exists() and not legacy.with_suffix(".kv").exists()
    assert all(live.get(bytes([i]) * 32) == b"l" * 300 for i in range(3))
    assert restarted.get(bytes([9]) * 32) == b"r" * 300 and restarted.counters.errors == 0


def test_a_disk_tier_that_meets_a_full_filesystem_or_a_removed_dir_recovers_and_says_so(tmp_path: Path, caplog,
                                                                                        monkeypatch):
    """ENOSPC on a write-back makes room by evicting this tier's oldest entries and writes again; a directory
    removed under it is made again; a failure that remains is dropped, counted and logged once (were: every
    later write-back dropped for the life of the process, without a line in the log)."""
    import errno as errnos

    tier = DiskTier(tmp_path, 10_000, namespace="ns")
    for i in range(4):
        tier.put(bytes([i]) * 32, b"z" * 300)
    real_write = Path.write_bytes
    full = {"left": 1}

    def write_bytes(self, data):  # the filesystem is full once, as a tmpfs smaller than the tier's size is
        if full["left"]:
            full["left"] -= 1
            raise OSError(errnos.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    tier.put(bytes([7]) * 32, b"w" * 300)
    assert tier.get(bytes([7]) * 32) == b"w" * 300 and tier.get(bytes([0]) * 32) is None  # the oldest made room
    assert tier.counters.dropped == 0 and tier.counters.evictions >= 1
    shutil.rmtree(tmp_path / "ns")
    tier.put(bytes([8]) * 32, b"v" * 300)
    assert tier.get(bytes([8]) * 32) == b"v" * 300 and tier.num_entries == 1
    full["left"] = 2  # full even after making room: dropped, counted, logged once
    with caplog.at_level(logging.WARNING, logger="trtpaged.runtime"):
        tier.put(bytes([9]) * 32, b"u" * 300)
        tier.put(bytes([10]) * 32, b"u" * 300)
    assert tier.counters.dropped == 1 and tier.counters.errors == 1
    assert [r.getMessage() for r in caplog.records if "a write-back (dropped) failed" in r.getMessage()] == [
        f"kv tier disk: a write-back (dropped) failed in {tmp_path / 'ns'} (No space left on device); 1 failures so "
        "far, 1 write-backs dropped"]


def test_disk_tier_is_bounded_and_persistent(tmp_path: Path):
    tier = DiskTier(tmp_path, 1000)
    for i in range(5):
        tier.put(bytes([i]) * 32, b"z" * 300)
        time.sleep(0.01)  # distinct mtimes: the LRU order across restarts is the files' mtime
    assert tier.used_bytes <= 1000 and tier.num_entries == 3 and tier.counters.evictions == 2
    again = DiskTier(tmp_path, 700)  # a restart with a smaller size evicts the oldest down to it
    assert again.num_entries == 2 and again.get(bytes([4]) * 32) == b"z" * 300
    assert again.get(bytes([0]) * 32) is None
    assert again.get(bytes([3]) * 32) == b"z" * 300  # a hit makes an entry the most recent ...
    again.put(bytes([5]) * 32, b"z" * 300)  # ... so the next put evicts the other one
    assert again.get(bytes([4]) * 32) is None and again.get(bytes([3]) * 32) == b"z" * 300
    with pytest.raises(ValueError, match="disk.path"):
        DiskTier(tmp_path / again.path_of(bytes([3]) * 32).name / "sub", 10)


# ---- restores through the engine --------------------------------------------------------------
def test_a_prefix_cache_reset_writes_the_pools_prefixes_back_to_the_tiers(step_model, reference):
    """reset_prefix_cache forgets the pool's cached blocks, but not into nothing: they go to the tiers first (as
    the pool's evictions would), so the next request finds A's four blocks in the host tier (was: 0, the hot
    blocks lost from both), and its tokens are the reference's."""
    engine = make_engine(step_model, KVTierConfig(host_memory=1 << 22))
    assert run_one(engine, A) == reference[None][0]
    assert engine.reset_prefix_cache() is True
    assert engine.kv.pool.num_cached == 0
    engine.kv.tiers.flush()
    before = engine.num_tokens_computed
    assert run_one(engine, A) == reference[None][0]
    assert engine.stats()["kv_tier_host_hits"] == 4 and engine.num_tokens_computed - before == len(A) - 4 * BS + 3
    assert_pool_whole(engine)
    engine.close()


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"], ids=["fp32", "int8"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_restored_blocks_are_bit_identical_and_outputs_unchanged(step_model, reference, tmp_path, tier, kv_cache_dtype):
    config = (KVTierConfig(host_memory=1 << 20) if tier == "host"
              else KVTierConfig(disk_path=str(tmp_path), disk_size=1 << 22))  # fmt: skip
    engine = make_engine(step_model, config, kv_cache_dtype)
    outputs = [run_one(engine, TRAFFIC[0])]
    computed = cached_bytes(engine, A)
    assert len(computed) == 4
    for prompt in TRAFFIC[1:4]:
        outputs.append(run_one(engine, prompt))
    engine.kv.tiers.flush()
    probe = Sequence(10**6, A)
    assert isinstance(loaded_prefix(engine.kv, probe)[0], TierHit)  # A left the pool
    engine.kv.free(probe)
    computed_before = engine.num_tokens_computed
    outputs.append(run_one(engine, A))
    assert engine.num_tokens_computed - computed_before == len(A) - 4 * BS + 3  # only the tail and the decodes
    assert cached_bytes(engine, A) == computed  # bit-identical to the computed blocks
    for prompt in TRAFFIC[5:]:
        engine.kv.tiers.flush()  # write-backs run on the writer thread: B's must be stored before B returns
        outputs.append(run_one(engine, prompt))
    assert outputs == reference[kv_cache_dtype]
    stats = engine.stats()
    assert stats[f"kv_tier_{tier}_hits"] >= 8 and stats["kv_tier_blocks_loaded"] >= 8
    assert stats["prefix_cache_tier_hits_tokens"] == stats["kv_tier_blocks_loaded"] * BS
    assert stats[f"kv_tier_{tier}_invalid"] == 0
    assert_pool_whole(engine)
    engine.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_salted_prefix_is_found_in_a_tier_only_under_its_salt(step_model, reference, tmp_path, tier):
    """cache_salt below the pool: A's blocks, computed under salt "s1" and evicted to a tier, are keyed from the
    salt's root; an unsalted or otherwise salted lookup of A finds none of them (it recomputes), a lookup under
    "s1" restores all four, and every output is the tiers-off engine's."""
    config = (KVTierConfig(host_memory=1 << 20) if tier == "host"
              else KVTierConfig(disk_path=str(tmp_path), disk_size=1 << 22))  # fmt: skip
    engine = make_engine(step_model, config)
    salted = dataclasses.replace(GREEDY, cache_salt="s1")
    assert run_one(engine, A, salted) == reference[None][0]
    for prompt in (B, C, D):  # evict A's blocks to the tier
        run_one(engine, prompt)
    engine.kv.tiers.flush()
    fp = _fingerprint(None)
    (store,) = engine.kv.tiers.tiers
    assert store.contains(chain_key(fp, root_key(fp, "s1"), A[:BS]))
    assert not store.contains(chain_key(fp, ROOT, A[:BS])) and root_key(fp, "s1") != root_key(fp, "s2") != ROOT
    for salt in (None, "s2"):
        probe = Sequence(10**6, A, cache_salt=salt)
        assert loaded_prefix(engine.kv, probe) == []
        engine.kv.free(probe)
    before = engine.num_tokens_computed
    assert run_one(engine, A, dataclasses.replace(GREEDY, cache_salt="s2")) == reference[None][0]
    assert engine.num_tokens_computed - before == len(A) + 3  # nothing restored: the whole prompt computed
    probe = Sequence(10**6, A, cache_salt="s1")
    hits = loaded_prefix(engine.kv, probe)
    assert len(hits) == 4 and all(isinstance(h, TierHit) for h in hits)
    engine.kv.free(probe)
    before = engine.num_tokens_computed
    assert run_one(engine, A, salted) == reference[None][0]
    assert engine.num_tokens_computed - before == len(A) - 4 * BS + 3  # its four blocks restored
    assert_pool_whole(engine)
    engine.close()


def test_disk_tier_survives_a_restart_and_skips_bad_entries(step_model, reference, tmp_path):
    config = KVTierConfig(disk_path=str(tmp_path), disk_size=1 << 22)
    first = make_engine(step_model, config)
    assert run_one(first, A) == reference[None][0]
    computed = cached_bytes(first, A)
    first.close()  # writes the pool's cached prefixes to disk
    restarted = make_engine(step_model, config)
    assert run_one(restarted, A) == reference[None][0]
    assert restarted.stats()["kv_tier_disk_hits"] == 4 and restarted.num_tokens_computed == len(A) - 4 * BS + 3
    assert cached_bytes(restarted, A) == computed
    restarted.close()

    # block 1's entry corrupted: block 0 restores, the rest is recomputed, the output is the same
    fp = _fingerprint(None)
    k0 = chain_key(fp, ROOT, A[:BS])
    k1 = chain_key(fp, k0, A[BS:2 * BS])
    path = DiskTier(tmp_path, 1 << 22, namespace=namespace_of(fp)).path_of(k1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    third = make_engine(step_model, config)
    assert run_one(third, A) == reference[None][0]
    stats = third.stats()
    assert stats["kv_tier_disk_hits"] == 1 and stats["kv_tier_disk_invalid"] == 1
    assert third.num_tokens_computed == len(A) - BS + 3
    assert_pool_whole(third)
    third.close()

    # another engine (int8 KV: another fingerprint) on the same directory finds nothing of it
    foreign = make_engine(step_model, config, "int8")
    assert run_one(foreign, A) == reference["int8"][0]
    assert foreign.stats()["kv_tier_disk_hits"] == 0
    foreign.close()


def _forged(entry: bytes, tokens: int) -> bytes:
    """The entry with its payload zeroed and its SHA-256 recomputed: what anyone who can write to the store can do."""
    start = 8 + 32 + 32 + 4 + 4 * tokens
    length = int.from_bytes(entry[start:start + 8], "little")
    payload = bytes(length)
    return entry[:start + 8] + hashlib.sha256(payload).digest() + payload


def test_with_a_secret_a_forged_or_foreign_signed_entry_is_a_miss(step_model, reference, tmp_path):
    """Without a secret, an entry forged with a recomputed SHA-256 passes its checks (the store must be trusted);
    with kv_tiers.secret_file, entries are HMAC-signed: a forged one, or one signed with another secret, is a
    counted miss and the answer is the reference's; a holder of the secret finds the signed entries after a restart."""
    fp = _fingerprint(None)
    k0 = chain_key(fp, ROOT, A[:BS])
    secret_file, other_file = tmp_path / "secret", tmp_path / "other"
    secret_file.write_text("s3cret-" * 4 + "\n")
    other_file.write_text("another-secret-bytes")
    for secret in (None, secret_file):
        root = tmp_path / ("signed" if secret else "plain")
        spec = {"disk": {"path": str(root), "size": 1 << 22}, **({"secret_file": str(secret)} if secret else {})}
        config = KVTierConfig.parse(spec)
        first = make_engine(step_model, config)
        assert run_one(first, A) == reference[None][0]
        first.close()
        restarted = make_engine(step_model, config)
        assert run_one(restarted, A) == reference[None][0] and restarted.stats()["kv_tier_disk_hits"] == 4
        restarted.close()
        other = make_engine(step_model, KVTierConfig.parse({**spec, "secret_file": str(other_file)}))
        assert run_one(other, A) == reference[None][0] and other.stats()["kv_tier_disk_hits"] == 0
        other.close()
        path = DiskTier(root, 1 << 22, namespace=namespace_of(fp)).path_of(k0)
        path.write_bytes(_forged(path.read_bytes(), BS))
        forged = make_engine(step_model, config)
        answer = run_one(forged, A)
        stats = forged.stats()
        if secret is None:  # the limit of unsigned entries: the forged block is loaded
            assert stats["kv_tier_disk_hits"] == 4 and stats["kv_tier_disk_invalid"] == 0
        else:
            assert answer == reference[None][0]
            assert stats["kv_tier_disk_hits"] == 0 and stats["kv_tier_disk_invalid"] == 1
            assert_pool_whole(forged)
        forged.close()


def test_sequences_sharing_a_tier_prefix_stage_it_once_and_share_its_blocks(step_model):
    """The n samples of a preempted request wait with the same prompt, whose blocks a tier holds: their reads
    stage those blocks once (was: counted per sequence, so the second read waited for room the first one held
    until the group's admission, for ever) and the group's admission loads them once, shared. A request first in
    line reads even when staging is full of other waiting requests' blocks, which may wait for it."""
    long_prompt = _prompt(7, 10 * BS + 5)  # 10 full blocks; staging holds NUM_KV_BLOCKS = 12
    engine = make_engine(step_model, KVTierConfig(host_memory=1 << 22))
    for prompt in (long_prompt, A, B, C):  # the last three evict the first one's blocks into the tier
        run_one(engine, prompt)
    other = _prompt(8, 6 * BS + 1)
    run_one(engine, other)
    for prompt in (A, B, C):
        run_one(engine, prompt)
    engine.kv.tiers.flush()
    kv = engine.kv
    loaded = engine.stats()["kv_tier_blocks_loaded"]
    first, second = (Sequence(10**6 + i, long_prompt + [5 + i, 6, 7]) for i in range(2))  # two samples' tokens
    assert kv.prefetch(first) and kv.staged_blocks() == 10
    assert kv.prefetch(second) and kv.staged_blocks() == 10  # the same 10 blocks, staged once
    hits = [kv.find_cached_prefix(s) for s in (first, second)]
    assert [sum(isinstance(h, TierHit) for h in hit) for hit in hits] == [10, 10]
    plan = kv.plan_allocation([(s, len(s.token_ids) - 10 * BS, h) for s, h in zip((first, second), hits)])
    assert plan.num_kv_blocks == 10 + 2  # the prompt's blocks once, and each sample's own last block
    kv.allocate(plan)
    assert kv.tables[first.seq_id][:10] == kv.tables[second.seq_id][:10]
    assert all(b.ref_cnt == 2 for b in kv.tables[first.seq_id][:10])
    assert engine.stats()["kv_tier_blocks_loaded"] == loaded + 10  # loaded once, for both
    for s in (first, second):
        kv.free(s)
    # 6 blocks of `other` staged for a waiting request leave no room for the 10 of one behind it
    evict = [_prompt(20 + i) for i in range(3)]
    for prompt in evict:
        run_one(engine, prompt)
    engine.kv.tiers.flush()
    waiting, later = Sequence(10**6 + 2, other + [9]), Sequence(10**6 + 3, long_prompt + [9])
    assert kv.prefetch(waiting) and kv.staged_blocks() == 6
    assert not kv.prefetch(later)  # waits for room ...
    assert kv.prefetch(later, first_in_line=True) and kv.staged_blocks() == 16  # ... unless it is first in line
    for s in (waiting, later):
        kv.free(s)
    assert_pool_whole(engine)
    engine.close()


def test_a_block_evicted_before_its_load_ran_is_saved_from_the_loaded_bytes(step_model, reference):
    """A tier hit loaded into block X and X evicted again in the same schedule: the write-back must
    carry the loaded bytes, not X's stale ones, and the load must not overwrite X's new owner."""
    engine = make_engine(step_model, KVTierConfig(host_memory=1 << 20))
    outputs = [run_one(engine, p) for p in TRAFFIC[:4]]
    kv = engine.kv
    kv.tiers.flush()
    probe = Sequence(10**6 + 1, A)
    hits = loaded_prefix(kv, probe)
    assert len(hits) == 4 and all(isinstance(h, TierHit) for h in hits)
    kv.allocate(kv.plan_allocation([(probe, len(A) - 4 * BS, hits)]))
    kv.free(probe)  # its blocks are cached, free, not yet loaded
    filler = Sequence(10**6 + 2, _prompt(9, NUM_KV_BLOCKS * BS - 1))
    kv.allocate(kv.plan_allocation([(filler, NUM_KV_BLOCKS * BS - 1, [])]))  # takes every block
    saves, loads = kv.take_tier_transfers()
    assert not loads  # every loaded block was taken by the filler: no load may overwrite it
    loaded_saves = [(record, where) for record, where in saves if isinstance(where, bytes)]
    assert sorted(where for _, where in loaded_saves) == sorted(h.payload for h in hits)
    assert sorted(r.key for r, _ in loaded_saves) == sorted(h.record.key for h in hits)
    kv.free(filler)
    assert_pool_whole(engine)
    assert outputs == reference[None][:4]


# ---- Redis ------------------------------------------------------------------------------------
def RedisServer(port: Optional[int] = None) -> RedisProcess:
    """A real redis-server process on a loopback port, owned by the test."""
    return RedisProcess(port, maxmemory="64mb")


needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None or importlib.util.find_spec("redis") is None,
                                 reason="redis-server is not installed (scripts/setup.sh installs it)")


@pytest.fixture
def redis_server():
    server = RedisServer()
    yield server
    server.kill()


@pytest.fixture
def redis_url():
    """The CI's server ($TRTPAGED_TEST_REDIS_URL, emptied first: .ci/run starts it) or one of our own."""
    url = os.environ.get("TRTPAGED_TEST_REDIS_URL")
    if url:
        import redis

        redis.Redis.from_url(url, socket_timeout=5).flushdb()
        yield url
        return
    server = RedisServer()
    yield server.url
    server.kill()


@needs_redis
def test_a_wrong_typed_redis_key_is_a_bad_entry_not_an_outage(redis_url):
    """A list under an entry's key (WRONGTYPE on GET) is an invalid entry, deleted so the next write-back replaces
    it; the tier stays up (was: counted an outage, each such lookup silencing the tier for retry_after_s)."""
    import redis

    from trtpaged.runtime.kv_tiers.remote import KEY_PREFIX, RedisTier

    fp = _fingerprint(None)
    remote = RedisTier(redis_url)
    stack = TierStack([CheckedTier(remote, EntryCodec(fp, 64))], fp)
    records = [BlockRecord(chain_key(fp, ROOT, (j,) * BS), ROOT, (j,) * BS) for j in range(2)]
    client = redis.Redis.from_url(redis_url)
    client.rpush(KEY_PREFIX + records[0].key, b"not an entry")
    stack.save([(records[1], b"y" * 64)])
    stack.flush()
    assert stack.lookup(records[0]) is None
    assert remote.is_up and remote.counters.errors == 0 and remote.counters.invalid == 1
    assert not client.exists(KEY_PREFIX + records[0].key)
    assert stack.lookup(records[1]) == (b"y" * 64, "remote")  # the tier answers the next lookup
    stack.save([(records[0], b"x" * 64)])
    stack.flush()
    assert stack.lookup(records[0]) == (b"x" * 64, "remote")
    stack.close()


@needs_redis
def test_a_read_only_disk_tier_drops_its_write_backs_and_not_the_redis_tiers_below_it(tmp_path: Path, redis_url):
    """On a read-only filesystem a disk write-back is dropped, counted and logged; the tiers after it still get the
    block (was: removing the temp file raised EROFS out of the disk tier, so the writer skipped Redis and counted an
    error on every tier)."""
    import subprocess

    import redis

    from trtpaged.runtime.kv_tiers.remote import KEY_PREFIX, RedisTier

    from runtime_helpers import small_tmpfs

    fp = _fingerprint(None)
    codec = EntryCodec(fp, 64)
    records = [BlockRecord(chain_key(fp, ROOT, (j,) * BS), ROOT, (j,) * BS) for j in range(3)]
    with small_tmpfs(tmp_path / "ro", "64k") as mount:
        host = HostMemoryTier(1 << 20)
        disk = DiskTier(mount, 1 << 20, namespace=namespace_of(fp))
        remote = RedisTier(redis_url)
        stack = TierStack([host, CheckedTier(disk, codec), CheckedTier(remote, codec)], fp)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        stack.save([(record, bytes([j]) * 64) for j, record in enumerate(records)])
        stack.flush()
        stack.close()
    client = redis.Redis.from_url(redis_url)
    assert all(client.exists(KEY_PREFIX + record.key) for record in records)  # the store's own state
    assert remote.counters.puts == 3 and remote.counters.errors == host.counters.errors == 0
    assert disk.counters.dropped == 3 and disk.num_entries == 0


@needs_redis
def test_a_huge_value_under_a_redis_entry_key_is_not_read_whole(redis_server):
    """A value far larger than an entry under a tier key is read no further than one byte past an entry's size
    (GETRANGE), then refused and removed; an empty value is a bad entry, a missing key a plain miss (was: GET read
    all 8 MiB of it into the server, for every lookup of that block)."""
    import redis

    from trtpaged.runtime.kv_tiers.remote import KEY_PREFIX, RedisTier

    fp = _fingerprint(None)
    remote = RedisTier(redis_server.url)
    stack = TierStack([CheckedTier(remote, EntryCodec(fp, 64))], fp)
    records = [BlockRecord(chain_key(fp, ROOT, (j,) * BS), ROOT, (j,) * BS) for j in range(3)]
    client = redis.Redis.from_url(redis_server.url)
    client.set(KEY_PREFIX + records[0].key, b"x" * (8 << 20))
    client.set(KEY_PREFIX + records[1].key, b"")
    sent = client.info("stats")["total_net_output_bytes"]
    assert stack.lookup(records[0]) is None and stack.lookup(records[1]) is None and stack.lookup(records[2]) is None
    assert client.info("stats")["total_net_output_bytes"] - sent < 1 << 20  # the server's own count of bytes sent
    assert remote.counters.invalid == 2 and remote.counters.misses == 3 and remote.counters.errors == 0
    assert not client.exists(KEY_PREFIX + records[0].key) and not client.exists(KEY_PREFIX + records[1].key)
    stack.save([(records[0], b"y" * 64)])
    stack.flush()
    assert stack.lookup(records[0]) == (b"y" * 64, "remote")
    stack.close()


@needs_redis
def test_a_full_redis_drops_writes_and_still_answers_lookups(caplog):
    """A Redis at maxmemory under noeviction refuses each SET (OutOfMemoryError): that write is dropped and logged
    once, naming the policy to use; the store is not taken for down (was: every lookup missed for retry_after_s).
    Once it takes writes again that is logged, and a later refusal is logged again."""
    import redis

    from trtpaged.runtime.kv_tiers.remote import RedisTier

    server = RedisProcess(maxmemory="2mb", policy="noeviction")
    try:
        tier = RedisTier(server.url, timeout_s=2.0)
        value = os.urandom(64 << 10)
        puts = 0
        while tier.counters.dropped == 0 and puts < 200:
            tier.put(b"k%d" % puts, value)
            puts += 1
        assert 0 < tier.counters.puts < puts and tier.counters.dropped == 1 and tier.counters.errors == 0
        tier.put(b"one more", value)
        assert tier.is_up and tier.counters.dropped == 2 and tier.get(b"k0") == value
        assert sum("maxmemory-policy allkeys-lru" in r.message for r in caplog.records) == 1
        server_client = redis.Redis.from_url(server.url)
        for room in ("64mb", "1"):  # room again, then full again: one line each (was: the first refusal only, ever)
            server_client.config_set("maxmemory", room)
            tier.put(b"k0", value)
            tier.put(b"k1", value)
        said = [r.message for r in caplog.records if "refuses writes" in r.message or "accepts writes" in r.message]
        assert len(said) == 3 and "accepts writes again" in said[1] and "refuses writes" in said[2]
        tier.close()
    finally:
        server.kill()


@needs_redis
@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"], ids=["fp32", "int8"])
def test_redis_restore_is_bit_identical_and_shared_by_a_second_replica(step_model, reference, redis_url,
                                                                       kv_cache_dtype):
    config = KVTierConfig(remote=redis_url)
    engine = make_engine(step_model, config, kv_cache_dtype)
    outputs = [run_one(engine, TRAFFIC[0])]
    computed = cached_bytes(engine, A)
    for prompt in TRAFFIC[1:4]:
        outputs.append(run_one(engine, prompt))
        engine.kv.tiers.flush()
    outputs.append(run_one(engine, A))
    assert cached_bytes(engine, A) == computed
    outputs.append(run_one(engine, B))
    computed_b = cached_bytes(engine, B)
    outputs.append(run_one(engine, A))
    assert outputs == reference[kv_cache_dtype]
    assert engine.stats()["kv_tier_remote_hits"] >= 8
    assert_pool_whole(engine)
    engine.close()  # flushes what the pool still caches
    replica = make_engine(step_model, config, kv_cache_dtype)  # a second replica: another pool, the same store
    assert run_one(replica, B) == reference[kv_cache_dtype][1]
    assert replica.stats()["kv_tier_remote_hits"] == 4 and cached_bytes(replica, B) == computed_b
    replica.close()


@needs_redis
def test_killed_redis_finishes_every_request_correctly_and_reconnects(step_model, reference, redis_server):
    engine = make_engine(step_model, KVTierConfig(remote=redis_server.url, remote_timeout_s=0.2))
    remote = engine.kv.tiers.tiers[0].store
    remote.retry_after_s = 0.2
    outputs = []
    for i, prompt in enumerate(TRAFFIC):
        if i == 3:
            redis_server.kill()  # the real server process, mid-run
        outputs.append(run_one(engine, prompt))
        engine.kv.tiers.flush()
    assert outputs == reference[None]
    stats = engine.stats()
    assert stats["kv_tier_remote_errors"] >= 1 and stats["kv_tier_remote_hits"] == 0
    assert_pool_whole(engine)
    restarted = RedisServer(redis_server.port)  # the same address: the tier reconnects on its own
    try:
        time.sleep(0.3)
        again = [run_one(engine, p) for p in TRAFFIC]
        engine.kv.tiers.flush()
        assert again == reference[None]
        assert engine.stats()["kv_tier_remote_hits"] >= 4
        assert_pool_whole(engine)
    finally:
        engine.close()
        restarted.kill()


# ---- loads overlap compute --------------------------------------------------------------------
class GatedProxy:
    """A TCP proxy in front of the real redis-server whose replies wait while `gate` is clear: a store that
    is slow for as long as the test says. Requests pass at once; only the answers are held."""

    def __init__(self, port: int) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self._target = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._target))
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, gated: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if gated:
                    self.gate.wait()
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.gate.set()
        for s in self._sockets:
            s.close()


E = _prompt(11, 40)
LONG = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _steps_until(engine: LLMEngine, done, timeout: float = 60.0) -> list:
    outputs, deadline = [], time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline
        outputs += engine.step()
    return outputs


def _tokens(outputs, rid: str) -> list[int]:
    final = [o for o in outputs if o.request_id == rid and o.finished]
    assert len(final) == 1
    return list(final[0].outputs[0].token_ids)


@pytest.fixture
def gated(redis_server):
    proxy = GatedProxy(redis_server.port)
    yield proxy
    proxy.close()


def _engine_with_a_in_redis(step_model, reference, proxy: GatedProxy, load_timeout_s: float,
                            hold: bool = True) -> LLMEngine:  # fmt: skip
    """A (and B, C, D) computed, A's blocks evicted from the pool and written to Redis behind the proxy, which
    then holds the store's answers (with `hold`) until the test opens its gate."""
    engine = make_engine(step_model, KVTierConfig(remote=proxy.url, remote_timeout_s=30.0,
                                                  load_timeout_s=load_timeout_s))
    assert [run_one(engine, p) for p in TRAFFIC[:4]] == reference[None][:4]
    engine.kv.tiers.flush()
    assert engine.kv.pool.lookup(engine.kv.pool.hash_fn(None, tuple(A[:BS])), tuple(A[:BS]), None) is None
    if hold:
        proxy.gate.clear()
    return engine


@needs_redis
def test_a_request_waits_for_its_prefix_load_while_others_compute(step_model, reference, gated):
    """The ordering truth: while the store holds its answer, the loading request stays queued and another
    request decodes step after step (so the step loop never waited on the read); once the answer comes, it is
    admitted with its 4 blocks restored and both outputs equal the tiers-off engine's."""
    plain = make_engine(step_model)
    plain.add_request(E, LONG, "e")
    long_ref = _tokens(_steps_until(plain, lambda: not plain.has_unfinished()), "e")
    engine = _engine_with_a_in_redis(step_model, reference, gated, load_timeout_s=30.0, hold=False)
    engine.add_request(E, LONG, "e")
    outputs = _steps_until(engine, lambda: bool(engine.scheduler.running))  # E's own read (a miss) is done
    gated.gate.clear()
    engine.add_request(A, GREEDY, "a")
    decoded = []
    for _ in range(5):
        outputs += engine.step()
        decoded.append(engine.groups["e"].seqs[0].num_output_tokens)
        assert [g.request_id for g in engine.scheduler.waiting] == ["a"] and engine.kv.loads_pending()
        assert engine.kv.staged_blocks() == 4  # A's 4 full blocks are being read
    assert decoded == sorted(set(decoded)) and len(decoded) == 5  # E decoded a token in each of those steps
    hits_before = engine.stats()["prefix_cache_tier_hits_tokens"]
    computed_before = engine.num_tokens_computed
    gated.gate.set()
    outputs += _steps_until(engine, lambda: not engine.has_unfinished())
    assert _tokens(outputs, "e") == long_ref and _tokens(outputs, "a") == reference[None][0]
    stats = engine.stats()
    assert stats["prefix_cache_tier_hits_tokens"] - hits_before == 4 * BS
    assert stats["kv_tier_load_timeouts"] == 0
    assert engine.num_tokens_computed - computed_before >= len(A) - 4 * BS  # A's tail (and E's last decodes)
    assert engine.groups == {} and engine.kv.staged_blocks() == 0
    assert_pool_whole(engine)
    engine.close()


@needs_redis
def test_abort_during_a_pending_load_frees_its_staging_and_leaks_nothing(step_model, reference, gated):
    engine = _engine_with_a_in_redis(step_model, reference, gated, load_timeout_s=30.0)
    engine.add_request(A, GREEDY, "a")
    for _ in range(3):
        assert engine.step() == []  # nothing to compute: the idle step waits briefly for the read, no longer
    assert engine.kv.loads_pending() and engine.kv.staged_blocks() == 4
    assert engine.abort("a")
    assert engine.kv.staged_blocks() == 0 and not engine.kv.loads_pending()
    assert_pool_whole(engine)
    gated.gate.set()  # the cancelled read's answer arrives now and is dropped
    engine.kv.tiers.flush()
    assert run_one(engine, A) == reference[None][0]  # a new request for A loads it as usual
    assert engine.stats()["prefix_cache_tier_hits_tokens"] == 4 * BS
    assert_pool_whole(engine)
    engine.close()


@needs_redis
def test_a_store_slower_than_the_load_deadline_degrades_to_recompute(step_model, reference, gated):
    engine = _engine_with_a_in_redis(step_model, reference, gated, load_timeout_s=0.3)
    computed_before = engine.num_tokens_computed
    started = time.monotonic()
    try:
        assert run_one(engine, A) == reference[None][0]
    finally:
        gated.gate.set()
    assert time.monotonic() - started < 10.0  # the deadline, not the store's 30 s timeout
    stats = engine.stats()
    assert stats["kv_tier_load_timeouts"] == 1 and stats["prefix_cache_tier_hits_tokens"] == 0
    assert engine.num_tokens_computed - computed_before == len(A) + 3  # all of A, then its decodes
    assert_pool_whole(engine)
    engine.close()


def test_ttft_breakdown_adds_up_and_counts_the_prefill_steps(step_model):
    """Two 70-token prompts under a 128-token step budget: A's prompt and 58 of B's share step 1 (A samples);
    B's last 12 tokens and A's first decode token make step 2 (B samples). The parts sum to the TTFT, counted
    from the arrival time the server gives (A: half a second before it was added)."""
    engine = make_engine(step_model)
    engine.add_request(A, GREEDY, "a", arrival_time=time.monotonic() - 0.5)
    engine.add_request(B, GREEDY, "b")
    while engine.has_unfinished():
        engine.step()
    a, b = engine.ttft_breakdown()
    assert (a["prefill_steps"], a["shared_tokens"], b["prefill_steps"], b["shared_tokens"]) == (1, 58, 2, 70 + 1)
    for r in (a, b):
        parts = r["submit_wait_s"] + r["tier_wait_s"] + r["admission_wait_s"] + r["prefill_s"]
        assert parts == pytest.approx(r["ttft_s"])
        assert r["prompt_tokens"] == 70 and r["cached_tokens"] == 0 and 0 < r["prefill_step_s"] <= r["prefill_s"]
    assert a["submit_wait_s"] == pytest.approx(0.5, abs=0.05) and b["submit_wait_s"] == 0.0


def test_a_write_killed_half_way_is_removed_when_the_tier_opens(tmp_path: Path):
    """A process killed between an entry's write and its rename leaves `.NAME.kv.PID.TID.tmp`, which no scan counted:
    the next tier to open the directory removes it once it is old and its process is gone, or the pid now names a
    process that started after the write (a restarted server gets its old pid back); a write a live process may
    still be making, or a recent one, stays; a pid no process can have does not stop the tier."""
    import subprocess
    import sys

    from trtpaged.runtime.kv_tiers.disk import _process_start

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = time.time() - 2 * ABANDONED_WRITE_S
    before_me = _process_start(os.getpid()) - 10  # written before this process started: not by it
    files = {  # name -> mtime (None: just now)
        f".a.kv.{dead.pid}.7.tmp": old, ".b.kv.1.7.tmp": old,  # pid 1 started at boot, before the write: kept
        f".c.kv.{dead.pid}.8.tmp": None, f".d.kv.{os.getpid()}.7.tmp": min(old, before_me),
        ".e.kv.99999999999999999999.1.tmp": old,
    }  # fmt: skip
    for name, mtime in files.items():
        (tmp_path / name).write_bytes(b"x" * 4096)
        if mtime is not None:
            os.utime(tmp_path / name, (mtime, mtime))
    DiskTier(tmp_path, 1 << 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".b.kv.1.7.tmp", f".c.kv.{dead.pid}.8.tmp"])


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("[enforce fail at alloc_cpu.cpp:117] . "
                                                              "DefaultCPUAllocator: can't allocate memory")])
def test_a_write_back_out_of_memory_is_dropped_not_the_requests(step_model, reference, caplog, error):
    """Reading evicted blocks for the tiers ran out of memory (a host tier beyond the process's limit; torch's CPU
    allocator says so with a RuntimeError): the requests of that step failed with it. Now the write-backs are
    dropped and counted, one warning says so, and every answer is the tierless one."""
    engine = make_engine(step_model, KVTierConfig(host_memory=1 << 22))
    real_read = engine.runner.read_blocks

    def out_of_memory(ids):
        if ids:
            raise error
        return real_read(ids)

    engine.runner.read_blocks = out_of_memory
    with caplog.at_level(logging.WARNING, logger="trtpaged.runtime"):
        got = [run_one(engine, p) for p in TRAFFIC]
    assert got == reference[None]
    (host,) = engine.kv.tiers.tiers
    assert host.counters.dropped > 0 and host.counters.puts == 0
    assert sum("out of memory reading" in r.message for r in caplog.records) == 1
    assert_pool_whole(engine)


def test_host_memory_available_is_bounded_by_the_address_space_limit(tmp_path):
    """A host tier or pool sized by MemAvailable alone failed in steps under a tighter `ulimit -v`: the room
    under RLIMIT_AS (less what the process maps already) bounds what the checks call available."""
    import subprocess
    import sys

    script = (
        "import resource\n"
        "from trtpaged.kv_budget import KVBudgetError, _proc_value, available_memory_bytes, check_host_tier\n"
        "mapped = _proc_value('/proc/self/status', 'VmSize:')\n"
        "resource.setrlimit(resource.RLIMIT_AS, (mapped + (512 << 20), resource.RLIM_INFINITY))\n"
        "room = available_memory_bytes('cpu')\n"
        "assert 0 < room <= 512 << 20, room\n"
        "try:\n"
        "    check_host_tier(10 << 30, 1 << 16, 'cpu', 4, 0)\n"
        "except KVBudgetError as e:\n"
        "    print('refused', e.field)\n"
    )  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "refused kv_tiers.host_memory"


@pytest.mark.parametrize("layout, want", [
    # v2, a limit two levels above the process's own group (systemd-run -p MemoryMax=): 1000 - (700 - 200)
    ({"proc": "0::/a/b/c\n", "a/memory.max": "max", "a/b/memory.max": "1000", "a/b/memory.current": "700",
      "a/b/memory.stat": "anon 500\ninactive_file 200\n", "a/b/c/memory.max": "max", "a/b/c/memory.current": "650"},
     500),
    # v2 in a container's namespace: the mount's root is its group
    ({"proc": "0::/\n", "memory.max": "4096", "memory.current": "1024"}, 3072),
    # v1, the memory controller's group by its path; other controllers' lines are not memory's
    ({"proc": "9:name=systemd:/x\n4:cpu,cpuacct:/x\n3:memory:/x\n", "memory/x/memory.limit_in_bytes": "2000",
      "memory/x/memory.usage_in_bytes": "1500", "memory/x/memory.stat": "total_inactive_file 300\n"}, 800),
    # v1 in a container (the host's path is not under this mount): the root; "no limit" is a huge number
    ({"proc": "3:memory:/docker/abc\n", "memory/memory.limit_in_bytes": "9223372036854771712",
      "memory/memory.usage_in_bytes": "1500"}, None),
    ({"proc": "0::/\n"}, None),
])  # fmt: skip
def test_the_cgroup_memory_room_is_read_where_the_limit_is(tmp_path, layout, want):
    """The room under a cgroup memory limit (a host tier or pool past it failed inside steps, or the process was
    OOM-killed): v2 at every level up from the process's group, v1 at its memory group, page cache that can be
    given back counted free. The truth: the numbers in the files written here."""
    from trtpaged.kv_budget import cgroup_memory_room

    for rel, text in layout.items():
        path = tmp_path / ("self_cgroup" if rel == "proc" else f"fs/{rel}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "fs").mkdir(exist_ok=True)
    assert cgroup_memory_room(str(tmp_path / "fs"), str(tmp_path / "self_cgroup")) == want


def test_a_tier_that_raises_on_a_write_back_costs_the_tiers_after_it_nothing(tmp_path: Path):
    """A tier whose write raises (any bug or fault its own code does not catch) counts an error and drops its own
    write-back; the disk tier after it still stores every block (was: the writer skipped the tiers after it and
    counted an error on each)."""

    class RaisingTier(HostMemoryTier):
        def put_block(self, record: BlockRecord, payload: bytes) -> None:
            raise OSError("a fault of this tier's own")

    fp = _fingerprint(None)
    codec = EntryCodec(fp, 64)
    records = [BlockRecord(chain_key(fp, ROOT, (j,) * BS), ROOT, (j,) * BS) for j in range(3)]
    raising, disk = RaisingTier(1 << 20), DiskTier(tmp_path / "disk", 1 << 20, namespace=namespace_of(fp))
    stack = TierStack([raising, CheckedTier(disk, codec)], fp)
    stack.save([(record, bytes([j]) * 64) for j, record in enumerate(records)])
    stack.flush()
    stack.close()
    assert raising.counters.errors == 3 and disk.counters.errors == 0
    assert disk.num_entries == 3 and all(disk.contains(record.key) for record in records)
