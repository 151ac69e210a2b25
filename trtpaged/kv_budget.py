"""How many KV blocks the pool has: decided here once, for the runtime, `inspect` and the TensorRT profile."""

from __future__ import annotations

import os
from typing import Optional

from trtpaged.manifest import MAX_KV_BLOCKS, KVCacheBudget, Limits, Manifest


def free_memory_bytes(device: str) -> int:
    """Free memory on `device` now: the GPU's free memory, or the host's available pages."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def available_memory_bytes(device: str) -> int:
    """Memory a new pool could take on `device` now: the GPU's free memory, or on the host the least of its
    MemAvailable (free pages plus the page cache the kernel would give up; free pages alone where /proc is
    missing), the room under this process's cgroup memory limit and the room under its address-space limit
    (ulimit -v): a pool or host tier sized by MemAvailable alone failed inside steps under a tighter limit."""
    if device.startswith("cuda"):
        return free_memory_bytes(device)
    host = _proc_value("/proc/meminfo", "MemAvailable:")
    rooms = [free_memory_bytes(device) if host is None else host]
    cgroup = cgroup_memory_room()
    if cgroup is not None:
        rooms.append(cgroup)
    import resource

    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    mapped = _proc_value("/proc/self/status", "VmSize:")
    if soft != resource.RLIM_INFINITY and mapped is not None:
        rooms.append(max(0, soft - mapped))
    return min(rooms)


_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge number (2**63 rounded to pages)


def cgroup_memory_room(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> Optional[int]:
    """Bytes left under the tightest memory limit of this process's cgroups, the page cache they could give back
    (inactive_file) counted as free; None without a limit. cgroup v2: every level from the process's own group up
    to the root (a systemd-run MemoryMax= sits above it); v1: its memory controller's group, or the mount's root
    (a container's own namespace)."""
    try:
        with open(self_cgroup) as f:
            lines = f.read(1 << 16).splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        names = [n for n in path.split("/") if n]
        v1 = "memory" in controllers.split(",")
        if hierarchy == "0" and not controllers:  # v2: its own group, then each one above it
            groups = [os.path.join(root, *names[:depth]) for depth in range(len(names), -1, -1)]
            files = ("memory.max", "memory.current", "inactive_file")
        elif v1:  # v1: its group as the host names it, else the mount's root (a container's namespace)
            groups = [os.path.join(root, "memory", *names), os.path.join(root, "memory")]
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        for group in groups:
            limit, used = _read_int(os.path.join(group, files[0])), _read_int(os.path.join(group, files[1]))
            if limit is None or used is None:
                continue
            if limit < _NO_LIMIT:
                cache = _stat_value(os.path.join(group, "memory.stat"), files[2]) or 0
                rooms.append(max(0, limit - max(0, used - cache)))
            if v1:
                break  # the first v1 group found is this process's
    return min(rooms) if rooms else None


def _stat_value(path: str, key: str) -> Optional[int]:
    """A "key N" line's N in a cgroup memory.stat file (None where missing or unreadable)."""
    try:
        with open(path) as f:
            for line in f.read(1 << 16).splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def _proc_value(path: str, key: str) -> Optional[int]:
    """A "KEY: N kB" line's bytes in a /proc file (None where it is missing or unreadable)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> Optional[int]:
    """The integer a small control file holds (None: missing, unreadable, or "max")."""
    try:
        with open(path) as f:
            return int(f.read(64).strip())
    except (OSError, ValueError):
        return None


def machine_memory_bytes() -> int:
    """The most memory one device of this machine has: the host's RAM or the largest GPU's, whichever is more.

    The bound a KV budget fixed at build time (num_kv_blocks, memory) is checked against: no pool beyond it
    could ever be allocated here.
    """
    host = int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    try:
        import torch

        gpus = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001  (a broken CUDA install must not hide the host's figure)
        gpus = []
    return max([host, *gpus])


class KVBudgetError(ValueError):
    """A KV pool that cannot be allocated: `field` is the setting (num_kv_blocks, kv_cache.num_kv_blocks, ...),
    `limit` the bytes available."""

    def __init__(self, field: str, message: str, limit: Optional[int] = None) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.limit = limit


def check_pool_fits(blocks: int, bytes_per_block: int, available: int, field: str, where: str) -> None:
    """Raises KVBudgetError when `blocks` blocks need more than `available` bytes (before anything is allocated)."""
    needed = blocks * bytes_per_block
    if needed > available:
        raise KVBudgetError(field, f"{blocks} blocks of {bytes_per_block} bytes need {_gib(needed)}; {where} has "
                                   f"{_gib(available)}", available)


def _check_block_ids(field: str, blocks: int, what: str, bytes_per_block: Optional[int] = None) -> None:
    """Raises ValueError naming `field` when a pool of `blocks` blocks has ids past the int32 of the block tables
    and the kernels ("{field}: {what} {blocks} blocks[ of {bytes_per_block} bytes], past 2147483647 ...")."""
    if blocks > MAX_KV_BLOCKS:
        size = f" of {bytes_per_block} bytes" if bytes_per_block is not None else ""
        raise ValueError(f"{field}: {what} {blocks} blocks{size}, past {MAX_KV_BLOCKS} (int32 block ids)")


def check_host_pool(num_host_blocks: int, bytes_per_block: int, device: str, num_kv_blocks: int) -> None:
    """Raises ValueError (KVBudgetError for the size) when the host pool of swap preemption, `num_host_blocks`
    blocks, is not a count or does not fit the host's available memory, less the KV pool's when that is on the
    host too (before either is allocated)."""
    if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int) or num_host_blocks < 0:
        raise ValueError(f"num_host_blocks: must be an integer >= 0, got {num_host_blocks!r}")
    _check_block_ids("num_host_blocks", num_host_blocks, "got")  # the swaps' pairs name host blocks in int32 too
    available = _host_left(bytes_per_block, device, num_kv_blocks)
    where = "the host now" + ("" if device.startswith("cuda") else f" besides the KV pool of {num_kv_blocks} blocks")
    check_pool_fits(num_host_blocks, bytes_per_block, available, "num_host_blocks", where)


def check_host_tier(host_memory: int, bytes_per_block: int, device: str, num_kv_blocks: int,
                    num_host_blocks: int) -> None:
    """Raises KVBudgetError when the host-memory KV tier (`kv_tiers.host_memory` bytes) does not fit the host's
    available memory less the pools it shares it with (the KV pool on a CPU device, a swap pool): it fills as
    the pool evicts prefix blocks, hours after loading, so it is checked before anything loads."""
    available = _host_left(bytes_per_block, device, num_kv_blocks, num_host_blocks)
    if host_memory > available:
        raise KVBudgetError("kv_tiers.host_memory", f"{_gib(host_memory)} exceeds what the host has now besides the "
                                                     f"engine's pools ({_gib(available)})", available)  # fmt: skip


def _host_left(bytes_per_block: int, device: str, num_kv_blocks: int, num_host_blocks: int = 0) -> int:
    """The host's available memory less the engine's blocks held there: a swap pool's, and the KV pool's on a CPU
    device."""
    held = num_host_blocks + (0 if device.startswith("cuda") else num_kv_blocks)
    return max(0, available_memory_bytes("cpu") - held * bytes_per_block)


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def useful_blocks(limits: Limits) -> int:
    """Blocks that max_batch_size sequences of max_seq_len tokens can use: the cap of a fraction budget."""
    return limits.max_batch_size * limits.max_blocks_per_seq


def budget_blocks(limits: Limits, budget: KVCacheBudget, bytes_per_block: int,
                  free_memory: Optional[int] = None) -> Optional[int]:
    """Blocks a KV budget holds: its num_kv_blocks, else memory_bytes // bytes_per_block, else its
    fraction of `free_memory` (bytes free on the device) capped at `useful_blocks`, so a CPU run does
    not claim most of the host's memory. None only for a fraction with `free_memory` unknown. Raises
    ValueError naming the setting when the budget holds no block.

    The one block count: the runtime's pool (`kv_blocks`), `inspect`'s memory plan, the TensorRT
    profile and the build's limit check all call it.
    """
    if budget.num_kv_blocks is not None:
        return int(budget.num_kv_blocks)
    if budget.memory_bytes is not None:
        blocks = int(budget.memory_bytes) // bytes_per_block
        if blocks < 1:
            raise ValueError(f"kv_cache.memory_bytes: {budget.memory_bytes} holds no block of {bytes_per_block} bytes")
        _check_block_ids("kv_cache.memory_bytes", blocks, f"{budget.memory_bytes} holds", bytes_per_block)
        return blocks
    if budget.fraction is not None:
        if free_memory is None:
            return None
        blocks = min(int(free_memory * budget.fraction) // bytes_per_block, useful_blocks(limits))
        if blocks < 1:
            raise ValueError(f"kv_cache.fraction: {budget.fraction} of {free_memory} free bytes holds no KV block")
        _check_block_ids("kv_cache.fraction", blocks, f"{budget.fraction} of {free_memory} free bytes holds",
                        bytes_per_block)
        return blocks
    raise ValueError("kv_cache: the manifest sets none of num_kv_blocks, memory_bytes, fraction")


def kv_blocks(manifest: Manifest, free_memory: Optional[int] = None, override: Optional[int] = None) -> Optional[int]:
    """Blocks of the KV pool: `override`, else the manifest's budget (`budget_blocks`).

    With tensor parallelism the budget is per rank (each device has its own memory) and a block of one
    rank's pool holds only its KV heads, so N ranks get N times the blocks of one.
    """
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or override < 1:
            raise ValueError(f"num_kv_blocks: must be an integer >= 1, got {override!r}")
        _check_block_ids("num_kv_blocks", override, "got")
        return override
    return budget_blocks(manifest.limits, manifest.kv_cache, manifest.kv_bytes_per_block_per_rank, free_memory)


def resolve_num_kv_blocks(manifest: Manifest, device: str = "cpu", override: Optional[int] = None) -> int:
    """`kv_blocks` with the free memory of `device` measured now: the pool the runtime allocates.

    Raises KVBudgetError when that pool does not fit the device's free memory (a `num_kv_blocks`
    override, or a num_kv_blocks / memory budget from the manifest), before anything is allocated.
    """
    free = free_memory_bytes(device) if manifest.kv_cache.fraction is not None and override is None else None
    blocks = kv_blocks(manifest, free, override)
    assert blocks is not None
    field = "num_kv_blocks" if override is not None else next(
        name for name, value in (("kv_cache.num_kv_blocks", manifest.kv_cache.num_kv_blocks),
                                 ("kv_cache.memory_bytes", manifest.kv_cache.memory_bytes),
                                 ("kv_cache.fraction", manifest.kv_cache.fraction)) if value is not None)
    check_pool_fits(blocks, manifest.kv_bytes_per_block_per_rank, available_memory_bytes(device), field,
                    f"device {device} now")
    return blocks
