"""Writing an engine dir atomically: everything goes to a hidden temp dir next to the output, then one rename.

A failed or interrupted build (Ctrl-C, SIGTERM) removes the temp dir (and any parent dirs it had
to create), so it never leaves a half-written engine dir behind; a killed build's temp dir (SIGKILL)
is removed by the next build into the same parent, once its lock shows the build is dead. An existing engine dir at
the output path is replaced only when asked (`force`, `trtpaged build --force`),
and then only once the new one is complete; a non-empty directory that is not
an engine dir is never overwritten.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from trtpaged.builder.interrupts import held, hold_from_here, raise_if_interrupted
from trtpaged.config import ConfigError
from trtpaged.engine_files import sha256_file
from trtpaged.manifest import MANIFEST_NAME, Manifest


log = logging.getLogger("trtpaged")

BUILD_LOCK = ".trtpaged-build.lock"  # inside a build's temp dir, flock-ed while the build runs


class OutputDirError(ConfigError):
    """The output path cannot hold an engine dir (a config error of `output` / `-o`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, field="output")


def check_output(output: Path, force: bool = False) -> None:
    """Raises OutputDirError if `output` is anything but a directory (a file, a FIFO, a device, a socket, a dangling
    link), a non-empty non-engine dir, or (unless `force`) an engine dir."""
    if os.path.lexists(output) and not output.is_dir():
        kind = "a file" if output.is_file() else "not a directory"
        raise OutputDirError(f"output: {output} is {kind}; expected a directory path")
    if output.is_dir() and any(output.iterdir()):
        if not (output / MANIFEST_NAME).is_file():
            raise OutputDirError(f"output: {output} is a non-empty directory that is not an engine dir; "
                                 "refusing to replace it")
        if not force:
            raise OutputDirError(f"output: {output} is an engine dir already; pass --force to replace it "
                                 "(it is replaced only once the new build is complete)")
        foreign = _not_engine_files(output)
        if foreign:
            raise OutputDirError(f"output: {output} {foreign}; refusing to replace it, even with --force (remove it "
                                 "yourself if it is to go)")


def _not_engine_files(output: Path, most: int = 5) -> str:
    """What in `output` is not its engine's, as text ("" when nothing is), so that --force replacing it deletes no
    one's files: a trtpaged.json that is not an engine's manifest (a JSON object with an integer format_version and
    a `files` map; read leniently, so that an engine of another format version can be rebuilt), or files that
    neither it nor its `files` map names (up to `most` of them)."""
    import json

    try:
        data = json.loads((output / MANIFEST_NAME).read_text())
    except (OSError, ValueError) as e:
        return f"holds a {MANIFEST_NAME} that is not an engine's ({str(e)[:160]})"
    files = data.get("files") if isinstance(data, dict) else None
    version = data.get("format_version") if isinstance(data, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or not isinstance(files, dict):
        return f"holds a {MANIFEST_NAME} that is not an engine's (no format_version and files map)"
    named = {MANIFEST_NAME}
    for name in [*files, *(data.get(k) for k in ("weights_file", "onnx_file", "plan_file")),
                 *(v for shard in data.get("shards") or [] if isinstance(shard, dict) for v in shard.values())]:
        if isinstance(name, str) and name not in ("", ".") and not name.startswith("/") and ".." not in name.split("/"):
            named.add(name)
    extra: list[str] = []
    for path in sorted(output.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            continue  # a directory goes with the files in it
        relative = path.relative_to(output).as_posix()
        if relative not in named:
            extra.append(relative)
            if len(extra) == most:
                break
    return f"holds files its {MANIFEST_NAME} does not name ({', '.join(extra)})" if extra else ""


@contextlib.contextmanager
def staged_output(output: Path, force: bool = False) -> Iterator[Path]:
    """Yields a temp dir; on success it becomes `output` (atomic rename), on failure it is deleted.

    The temp dir holds BUILD_LOCK, locked (flock) for as long as this build runs: the kernel drops the
    lock when the process dies however it dies, so `remove_dead_builds` can tell a killed build's
    leftovers from a live build's. Raises OutputDirError when the output's parent cannot be made.
    """
    output = output.resolve()
    if output.parent.is_dir():  # a killed replacement's old engine dir back in place first, for check_output to see
        remove_dead_builds(output.parent)
    check_output(output, force)
    created = _first_missing_ancestor(output.parent)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_builds(output.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    except OSError as e:
        _remove_made_dirs(output.parent, created)
        raise OutputDirError(f"output: cannot create {output} ({_why_not_created(output, e)})") from None
    lock = None
    try:
        lock = _hold_lock(tmp)
        yield tmp
        raise_if_interrupted()  # one a finalizer swallowed: nothing is written
        hold_from_here()  # a signal from here on cannot leave the old engine dir moved aside and the new one not in
        _replace(tmp, output, force)  # (it takes tmp's BUILD_LOCK out; the fd keeps the lock until the rename is done)
    except BaseException:
        with held():
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_made_dirs(output.parent, created)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _hold_lock(tmp: Path, note: str = "") -> int:
    """Creates tmp/BUILD_LOCK already locked (made under another name and renamed once locked, so no one
    sees it unlocked), with this process's pid for people and `note` on a second line; returns the fd that holds
    the lock."""
    partial = tmp / (BUILD_LOCK + ".new")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"{os.getpid()}\n".encode() + os.fsencode(note).hex().encode() + b"\n")  # any name, as hex
    os.rename(partial, tmp / BUILD_LOCK)
    return fd


def _dead_lock(directory: Path) -> tuple[int, str] | None:
    """(fd holding it now, its note) when directory/BUILD_LOCK exists and no live process holds it; else None."""
    try:
        fd = os.open(directory / BUILD_LOCK, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None  # held: the build is alive
    lines = os.read(fd, 8192).split(b"\n")
    try:
        note = os.fsdecode(bytes.fromhex(lines[1].decode())) if len(lines) > 1 else ""
    except ValueError:
        note = ""  # not ours (another build's format): nothing named
    return fd, note


def remove_dead_builds(parent: Path) -> list[Path]:
    """Removes the temp dirs of builds into `parent` that were killed (SIGKILL, a crash): those whose
    BUILD_LOCK nobody holds any more. A live build's temp dir, or one without a lock (not provably
    dead), is left alone. A build killed between the two renames of a replacement (`_replace`) left the old
    engine dir aside in a `.NAME.old-*` dir: it goes back to NAME when NAME is missing (else the new one is in place
    and the old one goes), and that build's complete temp dir (named in the lock) is removed. Returns what was
    removed."""
    removed = []
    for holder in sorted(parent.glob(".*.old-*")):
        dead = _dead_lock(holder) if holder.is_dir() and not holder.is_symlink() else None
        if dead is None:
            continue
        fd, tmp_name = dead
        try:
            output = parent / holder.name[1:].rsplit(".old-", 1)[0]
            if not os.path.lexists(output) and (holder / "engine").is_dir():
                os.rename(holder / "engine", output)  # the old engine dir back where it was
            new = parent / tmp_name if tmp_name.startswith(f".{output.name}.tmp-") and "/" not in tmp_name else None
            if new is not None and new.is_dir() and not (new / BUILD_LOCK).exists():
                shutil.rmtree(new, ignore_errors=True)
                removed.append(new)
            shutil.rmtree(holder, ignore_errors=True)  # put back above, or superseded by the engine dir at NAME
            removed.append(holder)
        except OSError as e:  # left for a later build: one holder that cannot go back stops no build
            log.warning("%s: cannot put the engine dir it holds back (%s); left in place", holder, e)
        finally:
            os.close(fd)
    for tmp in sorted(parent.glob(".*.tmp-*")):
        dead = _dead_lock(tmp) if tmp.is_dir() and not tmp.is_symlink() else None
        if dead is None:
            continue
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
        finally:
            os.close(dead[0])
    return removed


def _remove_made_dirs(parent: Path, created: Path | None) -> None:
    """Removes the directories this build made, from `parent` up to `created`, while they are empty: what someone
    (or a build beside this one) put there during the build stays."""
    if created is None:
        return
    path = parent
    while True:
        try:
            os.rmdir(path)
        except OSError:
            return
        if path == created:
            return
        path = path.parent


def _first_missing_ancestor(path: Path) -> Path | None:
    missing = None
    while not path.exists():
        missing, path = path, path.parent
    return missing


def _why_not_created(output: Path, error: OSError) -> str:
    """The reason `error` gives, or the existing ancestor that is not a directory (mkdir says "File exists" of a
    regular file on the way)."""
    existing = next((p for p in output.parents if os.path.lexists(p)), None)
    if existing is not None and not existing.is_dir():
        return f"{existing} is not a directory"
    return error.strerror or str(error)


def _make_readable(root: Path) -> None:
    """mkdtemp and some writers create private (0700/0600) entries; give them the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for p in root.rglob("*"):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def _replace(tmp: Path, output: Path, force: bool) -> None:
    """`tmp` (without its BUILD_LOCK, which is not part of an engine dir) becomes `output`, an engine dir already
    there replaced. What is at `output` is checked again first: a build runs for minutes, and a directory made there
    meanwhile (someone's files, or a build beside this one that finished first) is not this build's to replace."""
    check_output(output, force)
    _make_readable(tmp)
    if not os.path.lexists(output):
        (tmp / BUILD_LOCK).unlink()
        os.rename(tmp, output)  # a directory with files made since the check fails this (ENOTEMPTY): nothing lost
        return
    old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
    # held while the old engine dir is aside: if this process dies between the renames, the next build into this
    # parent finds the lock dead, puts the old engine dir back and removes `tmp` (remove_dead_builds)
    lock = _hold_lock(old, note=tmp.name)
    try:
        (tmp / BUILD_LOCK).unlink()  # from here `old`'s lock vouches for tmp
        os.rename(output, old / "engine")
        try:
            os.rename(tmp, output)
        except OSError:
            os.rename(old / "engine", output)
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        os.close(lock)


def file_hashes(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under root except the manifest."""
    return {rel: sha256_file(root / rel) for rel in _engine_files(root)}


def _engine_files(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in (MANIFEST_NAME, BUILD_LOCK)]


def write_manifest(root: Path, manifest: Manifest) -> Path:
    path = root / MANIFEST_NAME
    path.write_text(manifest.to_json() + "\n")
    return path
