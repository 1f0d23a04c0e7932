"""Where a LeRobot dataset's files are read from: :class:`Source` (a local folder or fsspec).

Files of a local folder are opened below it without following links
(:func:`~trajstore.interop.foreign_gate.open_below`; :meth:`Source.check` refuses any link or
special file in the folder first); files behind fsspec by key, a key with ``..`` or a leading
``/`` refused.  Every file is bounded in size before it is read.
"""

from __future__ import annotations

import os
from typing import Any

from trajstore.errors import BadOptionError, ForeignFileError, NotATrajstoreError, StoreNotFoundError
from trajstore.interop.foreign_gate import MAX_FOREIGN_FILE_BYTES, check_folder, open_below

__all__ = ["Source"]


class Source:
    """Where a dataset's files are: a local folder (every file opened below it without following
    links: :func:`~trajstore.interop.foreign_gate.open_below`) or a folder behind fsspec (``url``
    with ``storage_options``).  Keys are rendered paths (:func:`render` refuses ``..``)."""

    def __init__(self, path: Any, storage_options: dict[str, Any] | None = None) -> None:
        p = os.fspath(path)
        self.fs: Any = None
        if "://" in p or "::" in p:
            import fsspec

            self.fs, self.base = fsspec.core.url_to_fs(p, **(storage_options or {}))
            self.base = self.base.rstrip("/")
            self.root = p.rstrip("/")
            if not self.fs.isdir(self.base):
                raise StoreNotFoundError(f"LeRobot dataset {p}: no such folder")
        else:
            if storage_options:
                raise BadOptionError(f"LeRobot dataset {p}: storage_options apply to fsspec URLs only")
            self.root = self.base = os.path.abspath(p)
            if not os.path.exists(self.root):
                raise StoreNotFoundError(f"LeRobot dataset {self.root}: no such file or folder")
            if not os.path.isdir(self.root):
                raise NotATrajstoreError(f"{self.root} is a file; a LeRobot dataset is a folder with meta/info.json")

    def where(self, key: str) -> str:
        """``key``'s full path or URL, for messages."""
        return f"{self.root}/{key}"

    def check(self) -> None:
        """A local folder holds no link or special file (a remote one has none)."""
        if self.fs is None:
            check_folder(self.root, "LeRobot dataset")

    def open(self, key: str) -> Any:
        """The file ``key`` opened for reading (binary, seekable)."""
        if self.fs is None:
            return open_below(self.root, key, "LeRobot dataset")
        if key.startswith("/") or ".." in key.split("/"):
            raise ForeignFileError(f"{self.where(key)}: a path outside the dataset folder is refused")
        try:
            size = self.fs.size(f"{self.base}/{key}")
            if size is not None and size > MAX_FOREIGN_FILE_BYTES:
                raise ForeignFileError(f"{self.where(key)}: {size} bytes; more than trajstore reads")
            return self.fs.open(f"{self.base}/{key}", "rb")
        except FileNotFoundError:
            raise StoreNotFoundError(f"LeRobot dataset: {self.where(key)}: no such file") from None

    def listdir(self, key: str) -> tuple[list[str], list[str]]:
        """``(folders, files)`` directly in folder ``key`` (names, sorted; empty when absent)."""
        if self.fs is None:
            path = os.path.join(self.root, key)
            if not os.path.isdir(path):
                return [], []
            names = sorted(os.listdir(path))
            return ([n for n in names if os.path.isdir(os.path.join(path, n))],
                    [n for n in names if os.path.isfile(os.path.join(path, n))])
        try:
            entries = self.fs.ls(f"{self.base}/{key}", detail=True)
        except FileNotFoundError:
            return [], []
        dirs = sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")
        files = sorted(e["name"].rsplit("/", 1)[-1] for e in entries if e.get("type") == "file")
        return dirs, files
