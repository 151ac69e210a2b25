"""Writing an engine dir atomically: everything goes to a hidden temp dir next to the output, then one rename.

A failed build removes the temp dir (and any parent dirs it had to create),
so it never leaves a half-written engine dir behind. An existing engine dir at
the output path is replaced only when asked (`force`, `trtpaged build --force`),
and then only once the new one is complete; a non-empty directory that is not
an engine dir is never overwritten.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from trtpaged.manifest import MANIFEST_NAME, Manifest


class OutputDirError(ValueError):
    """The output path cannot hold an engine dir."""


def check_output(output: Path, force: bool = False) -> None:
    """Raises OutputDirError if `output` is a file, a non-empty non-engine dir, or (unless `force`) an engine dir."""
    if output.is_file():
        raise OutputDirError(f"output: {output} is a file; expected a directory path")
    if output.is_dir() and any(output.iterdir()):
        if not (output / MANIFEST_NAME).is_file():
            raise OutputDirError(f"output: {output} is a non-empty directory that is not an engine dir; refusing to replace it")
        if not force:
            raise OutputDirError(f"output: {output} is an engine dir already; pass --force to replace it "
                                 "(it is replaced only once the new build is complete)")


@contextlib.contextmanager
def staged_output(output: Path, force: bool = False) -> Iterator[Path]:
    """Yields a temp dir; on success it becomes `output` (atomic rename), on failure it is deleted."""
    output = output.resolve()
    check_output(output, force)
    created = _first_missing_ancestor(output.parent)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        yield tmp
        _replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


def _first_missing_ancestor(path: Path) -> Path | None:
    missing = None
    while not path.exists():
        missing, path = path, path.parent
    return missing


def _make_readable(root: Path) -> None:
    """mkdtemp and some writers create private (0700/0600) entries; give them the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for p in root.rglob("*"):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def _replace(tmp: Path, output: Path) -> None:
    _make_readable(tmp)
    if not output.exists():
        os.rename(tmp, output)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
    os.rename(output, old / "engine")
    os.rename(tmp, output)
    shutil.rmtree(old, ignore_errors=True)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_hashes(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under root except the manifest."""
    return {
        str(p.relative_to(root)): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


def write_manifest(root: Path, manifest: Manifest) -> Path:
    path = root / MANIFEST_NAME
    path.write_text(manifest.to_json() + "\n")
    return path
