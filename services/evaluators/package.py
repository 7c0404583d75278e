"""An evaluator's bytes: Python source (evaluator.py) or a small package (.zip / .tar.gz whose top level holds
evaluator.py and the modules it imports). Checked at upload and laid out again, the same way, wherever it runs.

What a package may hold: regular files and directories under relative paths, no links, no absolute paths or '..', at
most MAX_FILES files and MAX_UNPACKED_BYTES unpacked; every .py file must compile.
"""
from __future__ import annotations

import io
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

ENTRY = "evaluator.py"
MAX_FILES = 256
MAX_UNPACKED_BYTES = 16 << 20


class PackageError(ValueError):
    """The bytes are not a usable evaluator; the message says why (the caller names the field)."""


@dataclass(frozen=True)
class Package:
    files: dict[str, bytes]  # relative posix path -> content

    @property
    def size_bytes(self) -> int:
        return sum(len(b) for b in self.files.values())


def _archive_kind(data: bytes) -> str:
    if data[:4] == b"PK\x03\x04" or data[:4] == b"PK\x05\x06":
        return "zip"
    if data[:2] == b"\x1f\x8b":
        return "tar.gz"
    return "py"


def _safe_path(name: str) -> str:
    path = PurePosixPath(name)
    if name.startswith("/") or path.is_absolute() or "\\" in name:
        raise PackageError(f"the archive holds an absolute path: {name!r}")
    if ".." in path.parts:
        raise PackageError(f"the archive holds a path with '..': {name!r}")
    return path.as_posix()


def _add(files: dict[str, bytes], name: str, content: bytes) -> None:
    if len(files) >= MAX_FILES:
        raise PackageError(f"the archive holds more than {MAX_FILES} files")
    files[_safe_path(name)] = content
    if sum(len(b) for b in files.values()) > MAX_UNPACKED_BYTES:
        raise PackageError(f"the archive unpacks to more than {MAX_UNPACKED_BYTES >> 20} MB")


def _from_zip(data: bytes) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            if (info.external_attr >> 16) & 0o170000 == 0o120000:
                raise PackageError(f"the archive holds a link: {info.filename!r}")
            if info.is_dir():
                _safe_path(info.filename)
                continue
            if info.file_size > MAX_UNPACKED_BYTES:
                raise PackageError(f"the archive unpacks to more than {MAX_UNPACKED_BYTES >> 20} MB")
            _add(files, info.filename, archive.read(info))
    return files


def _from_tar(data: bytes) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        for member in archive:
            if member.issym() or member.islnk():
                raise PackageError(f"the archive holds a link: {member.name!r}")
            if member.isdir():
                _safe_path(member.name)
                continue
            if not member.isfile():
                raise PackageError(f"the archive holds something that is not a file: {member.name!r}")
            if member.size > MAX_UNPACKED_BYTES:
                raise PackageError(f"the archive unpacks to more than {MAX_UNPACKED_BYTES >> 20} MB")
            _add(files, member.name, archive.extractfile(member).read())
    return files


def read_package(data: bytes) -> Package:
    """The package's files, checked: safe paths, evaluator.py at the top level, every .py file compiles."""
    kind = _archive_kind(data)
    try:
        files = {"zip": _from_zip, "tar.gz": _from_tar}[kind](data) if kind != "py" else {ENTRY: data}
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as exc:
        raise PackageError(f"not a readable {kind} archive: {exc}") from None
    files = {name.removeprefix("./"): content for name, content in files.items()}
    if ENTRY not in files:
        raise PackageError(f"the archive has no {ENTRY} at its top level (found: {', '.join(sorted(files)[:5])})")
    for name, content in sorted(files.items()):
        if name.endswith(".py"):
            try:
                compile(content, name, "exec", dont_inherit=True)
            except SyntaxError as exc:
                raise PackageError(f"{name} line {exc.lineno}: SyntaxError: {exc.msg}") from None
            except ValueError as exc:  # e.g. null bytes
                raise PackageError(f"{name}: {exc}") from None
    return Package(files)


def lay_out(package: Package, dest: Path) -> Path:
    """Write the package's files under dest (created); returns dest."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, content in package.files.items():
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return dest
