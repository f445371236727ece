"""Local paths and URIs alike: where a run, a prepared corpus, a checkpoint or serving statistics live.

``locate(where)`` turns a local path (made absolute), a ``file://`` URI or an
object-store URI (``s3://``, ``gs://``: whatever ``pyarrow.fs`` resolves) into
a ``Location``: the ``pyarrow.fs`` file system, the path on it, and the location
as given, with the few operations training, data preparation and serving need.
A scheme ``pyarrow.fs`` lacks but an installed ``fsspec`` implementation serves
(``memory://``, which tests use as object storage) goes through
``pyarrow.fs.FSSpecHandler``. Object stores are configured by the environment,
as the AWS and Google tools are: ``AWS_ENDPOINT_URL`` names an S3-compatible
server such as MinIO, the credentials come from ``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY`` (docs/training.md, "Storage").
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs


@dataclass(frozen=True)
class Location:
    """A file or folder on a ``pyarrow.fs`` file system."""

    fs: pafs.FileSystem
    path: str  # on ``fs``: what pyarrow (and Parquet's ``filesystem=``) take
    uri: str  # as given, a local path made absolute: what to print and to hand to other processes

    @property
    def local(self) -> bool:
        """Whether this is on the local file system (a plain path or a ``file://`` URI)."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    def __truediv__(self, name: str) -> Location:
        return Location(self.fs, f"{self.path.rstrip('/')}/{name}", f"{self.uri.rstrip('/')}/{name}")

    def is_file(self) -> bool:
        """Whether a file is here."""
        return self.fs.get_file_info(self.path).type == pafs.FileType.File

    def is_dir(self) -> bool:
        """Whether a folder is here."""
        return self.fs.get_file_info(self.path).type == pafs.FileType.Directory

    def exists(self) -> bool:
        """Whether anything (file or folder) is here."""
        return self.fs.get_file_info(self.path).type != pafs.FileType.NotFound

    def read_bytes(self) -> bytes:
        """The file's contents."""
        with self.fs.open_input_stream(self.path) as f:
            return f.read()

    def read_text(self) -> str:
        """The file's contents as UTF-8 text."""
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        """Write (or replace) the file (one upload on object stores: it appears whole)."""
        with self.fs.open_output_stream(self.path) as f:
            f.write(data)

    def write_text(self, text: str) -> None:
        """Write (or replace) the file as UTF-8 text."""
        self.write_bytes(text.encode())

    def entries(self) -> list[pafs.FileInfo]:
        """The folder's direct entries, sorted by name; empty when no folder is here."""
        if not self.is_dir():
            return []
        return sorted(self.fs.get_file_info(pafs.FileSelector(self.path)), key=lambda info: info.base_name)

    def makedirs(self) -> None:
        """Create this folder and its parents (nothing when it exists)."""
        self.fs.create_dir(self.path, recursive=True)

    def delete(self) -> None:
        """Remove the folder (with everything in it) or the file here; nothing when there is none."""
        kind = self.fs.get_file_info(self.path).type
        if kind == pafs.FileType.Directory:
            self.fs.delete_dir(self.path)
        elif kind != pafs.FileType.NotFound:
            self.fs.delete_file(self.path)

    def upload(self, local_dir: str | Path) -> None:
        """Copy a local folder's files into this folder (created as needed)."""
        self.makedirs()
        pafs.copy_files(
            str(local_dir), self.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs
        )

    def download(self, local_dir: str | Path) -> None:
        """Copy this folder's files into a local folder."""
        pafs.copy_files(
            self.path, str(local_dir), source_filesystem=self.fs, destination_filesystem=pafs.LocalFileSystem()
        )

    @contextmanager
    def atomic(self) -> Iterator[str]:
        """A path (on ``fs``) beside this file to write it under, renamed onto it when the block ends.

        The partial file's name starts with a dot, which Arrow datasets and the
        readers here skip, so the file appears whole or not at all; on an error
        the partial file is removed and nothing appears.
        """
        folder, name = self.path.rsplit("/", 1)
        partial = f"{folder}/.{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            yield partial
            self.fs.move(partial, self.path)
        except BaseException:
            if self.fs.get_file_info(partial).type != pafs.FileType.NotFound:
                self.fs.delete_file(partial)
            raise


def locate(where: str | Path) -> Location:
    """The ``Location`` of a local path (made absolute, ``~`` expanded) or a URI."""
    text = absolute(where)
    if "://" not in text:
        return Location(pafs.LocalFileSystem(), text, text)
    try:
        fs, path = pafs.FileSystem.from_uri(text)
    except pa.ArrowInvalid:  # "Unrecognized filesystem type": perhaps an fsspec one
        import fsspec

        spec_fs, path = fsspec.core.url_to_fs(text)
        fs = pafs.PyFileSystem(pafs.FSSpecHandler(spec_fs))
    return Location(fs, path, text)


def absolute(where: str | Path) -> str:
    """A URI as given; a local path made absolute (Ray needs absolute local storage paths)."""
    text = str(where)
    return text if "://" in text else str(Path(text).expanduser().resolve())
