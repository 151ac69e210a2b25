"""Per-sequence block tables on top of the block pool: prefix hits, copy-on-write, forks, swap."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence as Seq, Union

from trtpaged.runtime.block_pool import BlockPool, HashFn, KVBlock, ParentRef, chain_hash, root_hash
from trtpaged.runtime.kv_tiers.entry import chain_key, root_key
from trtpaged.runtime.kv_tiers.loader import TierLoad, reads_from
from trtpaged.runtime.kv_tiers.stack import BlockRecord, TierHit, TierStack
from trtpaged.runtime.sequence import Sequence

# A prefix hit: a cached pool block, or a block found in a tier below the pool (loaded into a fresh block).
PrefixHit = Union[KVBlock, TierHit]
# One allocation request: the sequence, how many tokens it computes this step, its prefix hits.
AllocRequest = tuple[Sequence, int, Seq[PrefixHit]]
# A write-back: the evicted block's record and where its bytes are (a pool block id, or a load not yet applied).
TierSave = tuple[BlockRecord, Union[int, bytes]]
# The id a block table shows for a block returned to the pool because it lies wholly before the sequence's
# sliding window (`KVCacheManager.reclaim`): any valid id does, as the attention neither reads nor checks it.
RECLAIMED_BLOCK_ID = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class AllocationPlan:
    """What allocating a group's requests takes, decided once by `plan_allocation`."""

    requests: tuple[AllocRequest, ...]
    copy_last: tuple[bool, ...]  # per request: copy its shared last block before writing (copy-on-write)
    new_blocks: tuple[int, ...]  # per request: blocks appended to its table
    num_kv_blocks: int  # free-queue blocks consumed: copies, new blocks, cache hits now free, tier loads
    # per request: its leading hits wholly before the window of its first token to compute (`dead_hits`): holes in
    # its table at once, pool hits not taken off the free queue, tier hits not loaded (nor read), none counted
    dead_hits: tuple[int, ...]


@dataclass(frozen=True)
class _PrefixLookup:
    """Where a sequence's prefix is: the pool's chain from its first block (`run`), the records of the blocks after
    it that a tier may hold (`records`), and the pool's blocks after those, if any (`resumed`)."""

    run: list[KVBlock]
    records: list[BlockRecord]
    resumed: list[KVBlock]


class KVCacheManager:
    """Maps sequences to physical blocks. Tables are append-only, except that a
    shared last block is replaced by its private copy (copy-on-write) right
    before the sequence writes into it.

    Check-then-commit: `plan_allocation` decides every block a group's
    allocation takes (new blocks, copies, and cache hits taken off the free
    queue) and `allocate` only carries that plan out, so the count the scheduler
    checks is the count that is taken: no allocation fails halfway.

    `reclaim_window` W > 0 (a model whose every layer has a sliding window of at most W): after each step,
    `reclaim` returns the blocks wholly before position p - W + 1 of a sequence's next token p to the pool,
    their table entries becoming None (RECLAIMED_BLOCK_ID in `block_table`). A returned block keeps its
    prefix-cache entry until it is reused, like any freed block.
    """

    def __init__(
        self,
        num_kv_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        hash_fn: HashFn = chain_hash,
        tiers: Optional[TierStack] = None,
        reclaim_window: int = 0,
    ) -> None:
        if reclaim_window < 0:
            raise ValueError(f"reclaim_window: got {reclaim_window}; expected >= 0 (0: never reclaim)")
        self.reclaim_window = reclaim_window
        self.num_reclaimed = 0  # blocks returned by `reclaim` (a shared block counts once per table)
        self.block_size = block_size
        self.pool = BlockPool(num_kv_blocks, enable_caching=enable_prefix_caching, hash_fn=hash_fn)
        self.host_pool: Optional[BlockPool] = (BlockPool(num_host_blocks, enable_caching=False)
                                               if num_host_blocks else None)  # fmt: skip
        # None: a block returned by `reclaim` (only ever a leading run of the table)
        self.tables: dict[int, list[Optional[KVBlock]]] = {}
        self.host_tables: dict[int, list[Optional[KVBlock]]] = {}
        self._first_live: dict[int, int] = {}  # table index of each sequence's first block not reclaimed
        self._hashes: dict[int, list[int]] = {}  # chain hashes of each sequence's leading full blocks
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        # Tiers below the pool (kv_tiers/): each cached block's record, sequences' tier keys, transfers to run.
        self.tiers = tiers if enable_prefix_caching else None
        self.tier_hits_tokens = 0
        self._records: dict[int, BlockRecord] = {}  # block_id -> record, while the block is cached
        self._tier_keys: dict[int, list[bytes]] = {}  # seq_id -> tier keys of its leading full blocks
        # seq_id -> the tier read for a waiting sequence (its staged hits), until it is admitted or goes away
        self._loads: dict[int, TierLoad] = {}
        self._staged: Optional[Counter[bytes]] = None  # staged block key -> reads holding it (None: recount)
        self.max_staged_blocks = num_kv_blocks  # blocks that loads may hold in staging (and read ahead) together
        self.tier_loads_started = 0
        self.tier_load_timeouts = 0  # loads given up at their deadline (the rest of the prefix is recomputed)
        self.tier_load_wait_seconds = 0.0  # submission to done, summed over finished loads
        self._pending_saves: list[TierSave] = []
        self._pending_loads: dict[int, bytes] = {}  # block_id -> bytes to write before the step
        if self.tiers is not None:
            self.pool.on_evict = self._on_evict

    # ---- prefix cache -------------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence, shared: bool = False) -> list[PrefixHit]:
        """Longest run of full blocks matching the sequence's tokens: cached pool blocks, then the
        blocks its tier load (`prefetch`) found after them. Reads nothing from a tier. Only blocks
        cached by sequences of the same `cache_salt` match (the salt is the first block's parent).

        Never covers the last token: its logits are needed, so it is always computed. `shared`: the sequence's
        group is recomputed and its sequences share blocks again (`Scheduler._take_shares`): the run leaves its
        last two tokens, and every tier hit in it was read (another sequence may take blocks before its window).

        With a reclaim window, the pool's blocks may go on after tier hits that all lie before the window (holes
        in the table, `dead_hits`): those a sequence loaded after such holes and the ones cached after them
        (`_resumed_run`).
        """
        if not self.pool.enable_caching or seq.seq_id in self.tables:
            return []
        prefix = self._lookup(seq, shared)
        hits: list[PrefixHit] = list(prefix.run)
        load = self._loads.get(seq.seq_id)
        if load is not None and load.done:
            staged = {hit.index: hit for hit in load.hits}
            for record in prefix.records:
                hit = staged.get(len(hits))
                if hit is None or hit.record != record:
                    break
                hits.append(hit)
        if len(hits) == len(prefix.run) + len(prefix.records):
            hits += prefix.resumed
        return self._readable_run(hits, shared)

    def _readable_run(self, hits: list[PrefixHit], shared: bool) -> list[PrefixHit]:
        """The longest leading run of `hits` whose window holds no unread tier hit (one its load could not read
        before it was given up, or read for a longer run)."""
        while True:
            live = 0 if shared else self.dead_blocks(len(hits))
            unread = next((j for j in range(live, len(hits)) if _unread(hits[j])), None)
            if unread is None:
                return hits
            hits = hits[:unread]

    def _lookup(self, seq: Sequence, shared: bool) -> _PrefixLookup:
        run = self._pool_run(seq, shared)
        records = self._tier_records(seq, run, shared)
        resumed_at, resumed = self._resumed_run(seq, run, records, shared)
        return _PrefixLookup(run, records[: resumed_at - len(run)], resumed)

    def _full_blocks(self, seq: Sequence, shared: bool) -> int:
        """How many full blocks a prefix hit may cover: never the last token (two with `shared`)."""
        return (len(seq.token_ids) - (2 if shared else 1)) // self.block_size

    def _pool_run(self, seq: Sequence, shared: bool = False) -> list[KVBlock]:
        bs = self.block_size
        blocks = (tuple(seq.token_ids[j * bs : (j + 1) * bs]) for j in range(self._full_blocks(seq, shared)))
        return self._walk(seq.cache_salt, root_hash(seq.cache_salt), blocks)  # a first block follows its salt

    def _walk(self, parent: ParentRef, prev_hash: Optional[int], blocks: Iterable[tuple[int, ...]]) -> list[KVBlock]:
        """The cached blocks holding `blocks`' tokens in turn, chained from `parent` (whose hash is `prev_hash`),
        up to the first one the pool lacks."""
        run: list[KVBlock] = []
        for tokens in blocks:
            h = self.pool.hash_fn(prev_hash, tokens)
            block = self.pool.lookup(h, tokens, parent)
            if block is None:
                break
            run.append(block)
            parent, prev_hash = block.ref, h
        return run

    def _resumed_run(self, seq: Sequence, run: Seq[KVBlock], records: Seq[BlockRecord],
                     shared: bool) -> tuple[int, list[KVBlock]]:  # fmt: skip
        """Where the pool's blocks go on after a gap in its chain, and those blocks: the first of `records` that
        the pool holds under its tier parent key (a block loaded after holes, `_chain_parent`) and the cached
        blocks chained after it, when every block of the gap lies before the window of the first token after them
        (a tier need only hold them: `prefetch` probes them). Else (the end of `records`, [])."""
        end = len(run) + len(records)
        if not self.reclaim_window or shared or self.tiers is None:
            return end, []
        prev_hash = run[-1].block_hash if run else root_hash(seq.cache_salt)
        for k, record in enumerate(records):
            h = self.pool.hash_fn(prev_hash, record.tokens)
            if self.pool.lookup(h, record.tokens, record.parent) is not None:
                blocks = self._walk(record.parent, prev_hash, [r.tokens for r in records[k:]])
                start = len(run) + k
                return (start, blocks) if start <= self.dead_blocks(start + len(blocks)) else (end, [])
            prev_hash = h
        return end, []

    def _tier_records(self, seq: Sequence, pool_run: Seq[PrefixHit], shared: bool = False) -> list[BlockRecord]:
        """The records of the sequence's full blocks after `pool_run` (what a tier would hold for them)."""
        if self.tiers is None:
            return []
        bs, fp = self.block_size, self.tiers.fingerprint
        parent = root_key(fp, seq.cache_salt)
        if pool_run:
            last = self._records.get(pool_run[-1].block_id)  # type: ignore[union-attr]
            if last is None:  # cached before the tiers knew it: no key to continue the chain from
                return []
            parent = last.key
        records = []
        for j in range(len(pool_run), self._full_blocks(seq, shared)):
            tokens = tuple(seq.token_ids[j * bs : (j + 1) * bs])
            records.append(BlockRecord(chain_key(fp, parent, tokens), parent, tokens))
            parent = records[-1].key
        return records

    # ---- tier loads for waiting sequences -----------------------------------------------------
    def prefetch(self, seq: Sequence, first_in_line: bool = False, shared: bool = False) -> bool:
        """Whether the sequence's prefix is ready for admission: starts (once) the tier read of its full blocks
        after the pool's run and answers False while that read is pending. The read runs on the tiers' loader
        thread; a read past its deadline is given up (what it found is kept). A finished read that no longer
        starts where the pool's run ends (a pool block it followed was evicted meanwhile), or no longer reaches the
        pool's blocks after a gap (`_resumed_run`), is made once more.

        A read waits while staging has no room for its blocks, except the reads of the request first in line
        (`first_in_line`): the staging that other waiting requests hold is freed only when they are admitted, which
        may wait for this one, so the oldest request's reads always go ahead (staging may then pass
        `max_staged_blocks` by that request's own blocks).

        With a reclaim window, the blocks wholly before the window of the sequence's first token to compute are
        probed, not read (`dead_hits`: they are holes in its table); `shared` as for `find_cached_prefix`."""
        if self.tiers is None or not self.pool.enable_caching or seq.seq_id in self.tables:
            return True
        load = self._loads.get(seq.seq_id)
        if load is not None:
            if not load.done and not load.expire(time.monotonic()):
                return False
            self._note_finished(load)
            found = len(load.hits)
            resumed = self.tiers.extend(load)  # blocks the pool evicted while it ran may be in a tier now
            if resumed or len(load.hits) != found:
                self._staged = None  # it holds more now, or may
            if resumed:
                return False
            if load.is_retry:
                return True
        prefix = self._lookup(seq, shared)
        run, records = prefix.run, prefix.records
        if load is not None and load.first_index <= len(run) and len(run) + len(records) <= _end(load):
            return True
        if not records:
            return True
        whole_end = len(run) + len(records) + len(prefix.resumed)
        dead = None if shared or not self.reclaim_window else self.dead_blocks
        wanted = records[reads_from(len(run), whole_end, dead) - len(run) :]  # the rest is only probed
        if not first_in_line and self._staged_with(seq.seq_id, wanted) > self.max_staged_blocks:
            return load is not None  # no room to read ahead now: a first read waits, a retry is not made
        known = self._shared_hits(records, len(run))
        if known is None:
            return False  # another waiting sequence is reading these blocks now: take them from it when done
        new = self.tiers.start_load(len(run), records, known, dead, whole_end)
        new.is_retry = load is not None
        self._loads[seq.seq_id] = new
        self._staged = None
        self.tier_loads_started += 1
        if not new.done:
            return False
        self._note_finished(new)
        return True

    def _shared_hits(self, records: Seq[BlockRecord], first_index: int) -> Optional[list[TierHit]]:
        """The leading `records` that other sequences' finished reads hold (one read per block, e.g. for a
        system prompt that many waiting requests share), or None while a pending read covers the first one
        not held: waiting for it costs less than reading the block twice."""
        held: dict[bytes, TierHit] = {}
        reading: set[bytes] = set()
        for load in self._loads.values():
            if load.done:  # a hit read by one load is taken rather than one another load only probed
                held.update((hit.record.key, hit) for hit in load.hits if hit.payload is not None or
                            hit.record.key not in held)
            else:
                reading.update(record.key for record in load.records)
        out: list[TierHit] = []
        for k, record in enumerate(records):
            hit = held.get(record.key)
            if hit is None:
                return None if record.key in reading else out
            out.append(TierHit(first_index + k, record, hit.payload, hit.tier))
        return out

    def _note_finished(self, load: TierLoad) -> None:
        if not load.counted:
            load.counted = True
            self._staged = None  # it holds what it found now, not what it might have
            self.tier_load_timeouts += load.expired
            self.tier_load_wait_seconds += (load.finished_at or load.submitted) - load.submitted

    def loads_pending(self) -> bool:
        """Some waiting sequence's tier read is still running."""
        return any(not load.done for load in self._loads.values())

    def wait_for_loads(self, timeout: float) -> None:
        """Blocks until a pending tier read finishes or `timeout` passes: for a step with nothing to compute."""
        if self.tiers is not None and self.tiers.loader is not None and self.loads_pending():
            self.tiers.loader.wait(timeout)

    def staged_blocks(self) -> int:
        """Blocks that tier reads hold in staging (or may still read, while pending), over every waiting sequence;
        a block that several reads hold (a prompt its n samples share) is held once."""
        return len(self._staged_counts())

    def _staged_counts(self) -> Counter[bytes]:
        """Staged block key -> how many reads hold it. Kept until a read starts, ends, is seen finished or grows;
        a read that finished unseen still counts what it might have read, a superset of what it found."""
        if self._staged is None:
            self._staged = Counter()
            for load in self._loads.values():
                self._staged.update(_load_keys(load))
        return self._staged

    def _staged_with(self, seq_id: int, records: Seq[BlockRecord]) -> int:
        """Staged blocks if the sequence's read of `records` replaced the one it has (if any)."""
        counts = self._staged_counts()
        load = self._loads.get(seq_id)
        own = _load_keys(load) if load is not None else set()
        held_by_others = len(counts) - sum(1 for key in own if counts[key] == 1)
        wanted = {record.key for record in records}
        return held_by_others + sum(1 for key in wanted if counts[key] - (key in own) <= 0)

    def _drop_load(self, seq_id: int) -> None:
        """Forgets the sequence's tier read (admitted, aborted, preempted): its staged blocks go with it."""
        load = self._loads.pop(seq_id, None)
        if load is not None:
            load.cancel()
            self._staged = None

    # ---- check, then commit -------------------------------------------------------------------
    def dead_hits(self, hits: Seq[PrefixHit]) -> int:
        """Of a sequence adopting `hits`, how many leading ones lie wholly before the window of its first token to
        compute (`dead_blocks`): no query of it reads them, so they are holes in its table from the start (as
        `reclaim` would leave them after its step), pool hits not taken off the free queue, tier hits neither read
        (`prefetch` only probed them) nor loaded, and none counted by the plan. Taking them could need more blocks
        than the window bound `check_request` admitted by. When the first hit kept is a tier hit right after the
        pool hits, the last pool hit is kept too: the chain parent under which the loaded block is cached. 0
        without a reclaim window."""
        dead = self.dead_blocks(len(hits))
        pool_hits = next((j for j, h in enumerate(hits) if not isinstance(h, KVBlock)), len(hits))
        return dead - 1 if 0 < dead == pool_hits < len(hits) else dead

    def dead_blocks(self, num_hits: int) -> int:
        """Of a run of `num_hits` prefix hits, how many leading ones no query of the first token after them reads:
        those wholly before its window, but for the last hit (the next block's chain parent, as `reclaim` keeps
        it). 0 without a reclaim window."""
        if not self.reclaim_window or not num_hits:
            return 0
        return min(self._blocks_before_window(num_hits * self.block_size), num_hits - 1)

    def _blocks_before_window(self, position: int) -> int:
        """How many of a table's leading blocks lie wholly before the window of the token at `position`."""
        return max(0, position - self.reclaim_window + 1) // self.block_size

    def plan_allocation(self, requests: Seq[AllocRequest], keep: Iterable[int] = ()) -> AllocationPlan:
        """Decides, in one walk, what giving each request its slots takes; `allocate` carries it out.

        A copy-on-write gives up one reference on the shared block, so a later
        sharer in the same plan may find itself the last owner and write in place.

        `keep`: ids of sequences whose every hit is adopted, none a hole (`dead_hits`): others will take
        their blocks (a recomputed group's shares).
        """
        keep = set(keep)
        dead_hits: list[int] = []
        bs = self.block_size
        dropped: dict[int, int] = {}  # block_id -> references given up by earlier copies in this plan
        reclaimed: set[int] = set()  # cache hits that sit in the free queue now
        copies: list[bool] = []
        new_blocks: list[int] = []
        loads: set[bytes] = set()  # a block two sequences of the plan read from a tier is loaded once, then shared
        for seq, num_tokens, hits in requests:
            copy, new = False, 0
            dead_hits.append(0 if seq.seq_id in keep else self.dead_hits(hits))
            if hits:
                live = hits[dead_hits[-1]:]
                reclaimed.update(b.block_id for b in live if isinstance(b, KVBlock) and b.ref_cnt == 0)
                loads.update(b.record.key for b in live if isinstance(b, TierHit))
                start, table_len = len(hits) * bs, len(hits)
            else:
                table = self.tables.get(seq.seq_id, [])
                start, table_len = seq.num_computed_tokens, len(table)
                j = start // bs
                if num_tokens > 0 and j < table_len:
                    block = table[j]
                    copy = block.ref_cnt - dropped.get(block.block_id, 0) > 1
                    if copy:
                        dropped[block.block_id] = dropped.get(block.block_id, 0) + 1
            if num_tokens > 0:
                new = max(0, _cdiv(start + num_tokens, bs) - table_len)
            copies.append(copy)
            new_blocks.append(new)
        total = sum(copies) + sum(new_blocks) + len(reclaimed) + len(loads)
        return AllocationPlan(tuple(requests), tuple(copies), tuple(new_blocks), total, tuple(dead_hits))

    def allocate(self, plan: AllocationPlan) -> list[tuple[int, int]]:
        """Carries out a plan made on the current state: adopts cache hits, copies shared last
        blocks, appends new blocks. Returns the (src, dst) block copies to run before the step.

        A sequence given cache hits has their K/V from here on: the caller (the scheduler, which owns
        sequence state) sets its `num_computed_tokens` to `len(hits) * block_size`."""
        if plan.num_kv_blocks > self.pool.num_free:
            raise RuntimeError(f"allocate: the plan takes {plan.num_kv_blocks} blocks, {self.pool.num_free} free")
        # take every hit off the free queue before anything is evicted
        to_load = [self._adopt_hits(seq, hits, dead) if hits else []
                   for (seq, _, hits), dead in zip(plan.requests, plan.dead_hits)]  # fmt: skip
        loaded: dict[bytes, KVBlock] = {}
        for (seq, _, _), tier_hits in zip(plan.requests, to_load):
            if tier_hits:
                self._load_tier_hits(seq, tier_hits, loaded)
            self._drop_load(seq.seq_id)  # admitted: what its read staged is in the pool now, or not needed
        copies: list[tuple[int, int]] = []
        for (seq, _, _), copy, new in zip(plan.requests, plan.copy_last, plan.new_blocks):
            table = self.tables.setdefault(seq.seq_id, [])
            self._hashes.setdefault(seq.seq_id, [])
            if copy:  # never with hits: a sequence with hits has no table before them
                j = seq.num_computed_tokens // self.block_size
                (fresh,) = self.pool.allocate(1)
                copies.append((table[j].block_id, fresh.block_id))
                self.pool.free([table[j]])
                table[j] = fresh
            if new:
                table.extend(self.pool.allocate(new))
        return copies

    def _adopt_hits(self, seq: Sequence, hits: Seq[PrefixHit], dead: int = 0) -> list[TierHit]:
        """The sequence's table becomes its hits up to the first tier hit to load: the first `dead` (`dead_hits`)
        holes (pool hits not taken, tier hits not loaded; their hashes and tier keys kept for the chain), the pool
        hits after them taken. Returns the tier hits left, for `_load_tier_hits`."""
        if seq.seq_id in self.tables:
            raise RuntimeError(f"sequence {seq.seq_id}: cache hits for a sequence that already has blocks")
        table: list[Optional[KVBlock]] = []
        hashes: list = []
        keys: list[bytes] = []
        for j, hit in enumerate(hits):
            if isinstance(hit, KVBlock):
                hashes.append(hit.block_hash)
                keys.append(self._records[hit.block_id].key if self.tiers is not None else b"")
            elif j < dead:
                hashes.append(self.pool.hash_fn(hashes[-1] if hashes else root_hash(seq.cache_salt), hit.record.tokens))
                keys.append(hit.record.key)
            else:
                break
            table.append(None if j < dead else hit)  # type: ignore[arg-type]  (a tier hit here is a hole)
        self.pool.touch(_live(table))
        self.tables[seq.seq_id], self._hashes[seq.seq_id] = table, hashes
        if self.tiers is not None:
            self._tier_keys[seq.seq_id] = keys
        if dead:
            self._first_live[seq.seq_id] = dead
        self.prefix_hits_tokens += len(hits) * self.block_size
        self.tier_hits_tokens += sum(isinstance(hit, TierHit) for hit in hits) * self.block_size
        return [hit for hit in hits[len(table) :] if isinstance(hit, TierHit)]  # only tier hits follow

    def _load_tier_hits(self, seq: Sequence, hits: Seq[TierHit], loaded: dict[bytes, KVBlock]) -> None:
        """Fresh blocks for tier hits, cached at once (their bytes are written before the step runs). A block an
        earlier sequence of the same plan loaded (`loaded`: tier key -> block; e.g. the n samples of a preempted
        request, whose prompt comes back from a tier for each) is shared instead of loaded again."""
        assert self.tiers is not None
        table, hashes, keys = self.tables[seq.seq_id], self._hashes[seq.seq_id], self._tier_keys[seq.seq_id]
        fresh = iter(self.pool.allocate(sum(hit.record.key not in loaded for hit in hits)))
        for hit in hits:
            tokens = hit.record.tokens
            h = self.pool.hash_fn(hashes[-1] if hashes else root_hash(seq.cache_salt), tokens)
            block = loaded.get(hit.record.key)
            if block is not None:
                self.pool.touch([block])
            else:
                block = loaded[hit.record.key] = next(fresh)
                if self.pool.cache(block, h, tokens, self._chain_parent(seq, table, hit.record)):
                    self._records[block.block_id] = hit.record
                assert hit.payload is not None  # find_cached_prefix keeps no unread hit that the window reads
                self._pending_loads[block.block_id] = hit.payload
                self.tiers.num_loads += 1
            table.append(block)
            hashes.append(h)
            keys.append(hit.record.key)

    @staticmethod
    def _chain_parent(seq: Sequence, table: Seq[Optional[KVBlock]], record: BlockRecord) -> ParentRef:
        """The pool parent under which a block appended to `table` is cached: the block before it, the salt for a
        first block, or after a hole the tier key of the block before (which `_resumed_run` finds it by)."""
        if not table:
            return seq.cache_salt
        last = table[-1]
        return record.parent if last is None else last.ref

    def _on_evict(self, block: KVBlock) -> None:
        record = self._records.pop(block.block_id, None)
        if record is None:
            return
        pending = self._pending_loads.pop(block.block_id, None)  # loaded this step, evicted before it ran
        self._pending_saves.append((record, block.block_id if pending is None else pending))

    def take_tier_transfers(self) -> tuple[list[TierSave], list[tuple[int, bytes]]]:
        """The write-backs of blocks evicted since the last call and the tier loads to apply, in that order:
        the saves read the blocks' old bytes before anything (a load, a swap-in, the step) overwrites them."""
        saves, loads = self._pending_saves, list(self._pending_loads.items())
        self._pending_saves, self._pending_loads = [], {}
        return saves, loads

    def cached_records(self) -> list[tuple[BlockRecord, int]]:
        """Every block in the pool's prefix cache with its record (for a write-back of the whole cache)."""
        return [(record, block_id) for block_id, record in self._records.items()]

    def note_prefix_query(self, seq: Sequence) -> None:
        """Counts an admitted sequence's prompt as looked up in the prefix cache."""
        if self.pool.enable_caching:
            self.prefix_queries_tokens += len(seq.token_ids)

    def reset_prefix_cache(self) -> bool:
        """Forgets the pool's cached prefixes (vLLM's reset_prefix_cache): False, and nothing changed, while a block
        is in use or a tier read is staged. The tiers below the pool keep theirs (LLMEngine.reset_prefix_cache
        writes the pool's back to them first)."""
        if self.pool.num_used or self._loads or self._pending_loads or self._pending_saves:
            return False
        self.pool.forget_cached()
        self._records.clear()
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Registers the sequence's newly completed full blocks in the prefix cache.

        Called after the step that computed them, never at scheduling: a block
        still being written must not be found by another sequence.
        """
        if not self.pool.enable_caching or seq.seq_id not in self.tables:
            return
        bs, table, hashes = self.block_size, self.tables[seq.seq_id], self._hashes[seq.seq_id]
        keys = self._tier_keys.setdefault(seq.seq_id, []) if self.tiers is not None else None
        for j in range(len(hashes), seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[j * bs : (j + 1) * bs])
            h = self.pool.hash_fn(hashes[-1] if hashes else root_hash(seq.cache_salt), tokens)
            cached = self.pool.cache(table[j], h, tokens, table[j - 1].ref if j else seq.cache_salt)
            hashes.append(h)
            if keys is not None:
                parent = keys[-1] if keys else root_key(self.tiers.fingerprint, seq.cache_salt)
                record = BlockRecord(chain_key(self.tiers.fingerprint, parent, tokens), parent, tokens)
                keys.append(record.key)
                if cached:
                    self._records[table[j].block_id] = record

    def reclaim(self, seq: Sequence) -> int:
        """Returns to the pool the blocks of `seq` that no query of it will read again: those wholly before
        position num_computed_tokens - reclaim_window + 1 (its next token's window). With prefix caching, the
        last full block stays while the next one is not cached (it is that block's chain parent). Returns how
        many blocks it gave back."""
        table = self.tables.get(seq.seq_id)
        if not self.reclaim_window or not table:
            return 0
        dead = self._blocks_before_window(seq.num_computed_tokens)
        if self.pool.enable_caching:
            dead = min(dead, len(self._hashes.get(seq.seq_id, ())) - 1)
        first = self._first_live.get(seq.seq_id, 0)
        dead = min(dead, len(table))
        if dead <= first:
            return 0
        blocks = [b for b in table[first:dead] if b is not None]
        self.pool.free(blocks[::-1])
        table[first:dead] = [None] * (dead - first)
        self._first_live[seq.seq_id] = dead
        self.num_reclaimed += len(blocks)
        return len(blocks)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (copy-on-write on its next write)."""
        self._share(parent, child, len(self.tables[parent.seq_id]))

    def _share(self, source: Sequence, seq: Sequence, num_blocks: int) -> None:
        table = self.tables[source.seq_id][:num_blocks]
        self.pool.touch(_live(table))
        self.tables[seq.seq_id] = table
        self._hashes[seq.seq_id] = self._hashes.get(source.seq_id, [])[:num_blocks]
        if source.seq_id in self._first_live:
            self._first_live[seq.seq_id] = min(self._first_live[source.seq_id], num_blocks)
        if source.seq_id in self._tier_keys:
            self._tier_keys[seq.seq_id] = self._tier_keys[source.seq_id][:num_blocks]

    def share_blocks(self, source: Sequence, seq: Sequence, num_blocks: int) -> None:
        """`seq`, which has no blocks, takes `source`'s first `num_blocks` blocks, full and computed (a
        recomputed group's sequences sharing what they have in common again); a tier read it had staged for
        itself is dropped."""
        if seq.seq_id in self.tables:
            raise RuntimeError(f"sequence {seq.seq_id}: sharing blocks into a sequence that already has blocks")
        self._drop_load(seq.seq_id)
        self._share(source, seq, num_blocks)

    def free(self, seq: Sequence) -> None:
        """Returns the sequence's blocks (device and host), tail first so shared prefixes are evicted last."""
        table = self.tables.pop(seq.seq_id, None)
        if table:
            self.pool.free(_live(table)[::-1])
        host = self.host_tables.pop(seq.seq_id, None)
        if host and self.host_pool is not None:
            self.host_pool.free(_live(host)[::-1])
        self._hashes.pop(seq.seq_id, None)
        self._first_live.pop(seq.seq_id, None)
        self._tier_keys.pop(seq.seq_id, None)
        self._drop_load(seq.seq_id)

    def truncate(self, seq: Sequence) -> int:
        """Frees the table's blocks past the sequence's computed tokens (tail first); returns how many.

        A verification step allocated slots for every proposed token; once the rejected ones are known,
        the blocks holding only rejected slots go back. Their slots were never registered in the prefix
        cache (only full blocks of computed tokens are), and the rejected slots left in the kept last
        block are overwritten before any step reads them: attention reads up to `context_lens` only.
        """
        table = self.tables.get(seq.seq_id)
        keep = _cdiv(seq.num_computed_tokens, self.block_size)
        if not table or len(table) <= keep:
            return 0
        tail = table[keep:]
        del table[keep:]
        self.pool.free(tail[::-1])
        return len(tail)

    def block_table(self, seq: Sequence) -> list[int]:
        return [RECLAIMED_BLOCK_ID if b is None else b.block_id for b in self.tables.get(seq.seq_id, [])]

    # ---- swap to host memory ------------------------------------------------------------------
    def can_swap_out(self, seqs: Seq[Sequence]) -> bool:
        distinct = {b.block_id for s in seqs for b in _live(self.tables.get(s.seq_id, []))}
        return self.host_pool is not None and len(distinct) <= self.host_pool.num_free

    def swap_out(self, seqs: Seq[Sequence]) -> list[tuple[int, int]]:
        """Moves the sequences' blocks to host blocks (sharing kept); returns (device, host) pairs."""
        return self._move(seqs, self.tables, self.host_tables, self.pool, self.host_pool)

    def can_swap_in(self, seqs: Seq[Sequence]) -> bool:
        distinct = {b.block_id for s in seqs for b in _live(self.host_tables.get(s.seq_id, []))}
        return len(distinct) <= self.pool.num_free

    def swap_in(self, seqs: Seq[Sequence]) -> list[tuple[int, int]]:
        """Moves the sequences' host blocks back to fresh device blocks; returns (host, device) pairs."""
        return self._move(seqs, self.host_tables, self.tables, self.host_pool, self.pool)

    @staticmethod
    def _move(seqs, src_tables, dst_tables, src_pool, dst_pool) -> list[tuple[int, int]]:
        if src_pool is None or dst_pool is None:
            raise RuntimeError("swap: no host pool (num_host_blocks is 0)")
        mapping: dict[int, KVBlock] = {}
        for seq in seqs:
            if seq.seq_id not in src_tables:  # holds nothing (waits to share a recomputed sequence's blocks)
                continue
            src = src_tables.pop(seq.seq_id)
            dst = []
            for block in src:
                if block is None:  # reclaimed: stays a hole in the table
                    dst.append(None)
                    continue
                if block.block_id in mapping:
                    dst_pool.touch([mapping[block.block_id]])
                else:
                    (mapping[block.block_id],) = dst_pool.allocate(1)
                dst.append(mapping[block.block_id])
            dst_tables[seq.seq_id] = dst
            src_pool.free(_live(src)[::-1])
        return [(src_id, dst.block_id) for src_id, dst in mapping.items()]

    # ---- statistics ---------------------------------------------------------------------------
    def stats(self, live_seqs: Iterable[Sequence]) -> dict[str, float]:
        """Block counts and utilisation: distinct tokens stored / slots of used blocks."""
        bs = self.block_size
        filled: dict[int, int] = {}  # block id -> tokens written in it (the most any of its sequences wrote)
        for seq in live_seqs:  # once a step in `bench memory`'s replay: its blocks are walked, not each token
            table = self.tables.get(seq.seq_id, [])
            full, rest = divmod(seq.num_computed_tokens, bs)
            for block in table[:full]:
                if block is not None:
                    filled[block.block_id] = bs
            partial = table[full] if rest and full < len(table) else None
            if partial is not None and filled.get(partial.block_id, 0) < rest:
                filled[partial.block_id] = rest
        used = self.pool.num_used
        tokens = sum(filled.values())
        tiers = {} if self.tiers is None else {
            "prefix_cache_tier_hits_tokens": self.tier_hits_tokens, **self.tiers.stats(),
            "kv_tier_loads_started": self.tier_loads_started, "kv_tier_loads_pending": len(self._loads),
            "kv_tier_staged_blocks": self.staged_blocks(), "kv_tier_load_timeouts": self.tier_load_timeouts,
            "kv_tier_load_wait_seconds": self.tier_load_wait_seconds}
        return {
            "kv_blocks_total": self.pool.num_kv_blocks,
            "kv_blocks_used": used,
            "kv_blocks_free": self.pool.num_free,
            "kv_blocks_cached": self.pool.num_cached,
            "kv_tokens_stored": tokens,
            "kv_slots_allocated": used * bs,
            "kv_utilisation": tokens / (used * bs) if used else 0.0,
            "kv_blocks_saved_by_sharing": self.pool.num_shared_refs(),
            "kv_blocks_used_peak": self.pool.peak_used,
            "kv_blocks_saved_by_sharing_peak": self.pool.peak_shared_refs,
            "prefix_cache_queries_tokens": self.prefix_queries_tokens,
            "prefix_cache_hits_tokens": self.prefix_hits_tokens,
            "kv_evictions": self.pool.num_evictions,
            "kv_blocks_reclaimed": self.num_reclaimed,
            **tiers,
        }


def _live(table: Seq[Optional[KVBlock]]) -> list[KVBlock]:
    """A table's blocks that are still held (not reclaimed)."""
    return [b for b in table if b is not None]


def _load_keys(load: TierLoad) -> set[bytes]:
    """The block keys a tier read holds in staging: what it read once done; until then, what it may read (the blocks
    it reads when it finds them all: one its window needs after a shorter run is read then too, past this count)."""
    read = {hit.record.key for hit in load.hits if hit.payload is not None}
    if load.done:
        return read
    return read | {record.key for record in load.records[load.first_read - load.first_index :]}


def _end(load: TierLoad) -> int:
    """The index after a tier read's last record."""
    return load.first_index + len(load.records)


def _unread(hit: PrefixHit) -> bool:
    """A tier hit found but not read (it lay before the window of its load's run)."""
    return isinstance(hit, TierHit) and hit.payload is None
