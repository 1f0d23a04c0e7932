"""Encoding an image field's rows on a background thread as they are written (issue 31).

A writer's rows are otherwise encoded when their shard is written (``ImageField._write_chunk``):
a ring filled one ``add`` at a time then stalls at each full shard for the encode of all its
frames.  :class:`EncodeAhead` hands each written block of rows (a copy) to one background thread
that encodes them while the writer goes on; the shard's write waits for what is still running
and encodes only the rest.  Jobs run in order on one thread, and a row written again before its
job ran is recognised by a token per row, so a frame's bytes are always those of its last write.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from trajstore.storage.fields.image_codecs import ImageCodec

__all__ = ["EncodeAhead"]

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def _get_executor() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="trajstore-encode")
        return _executor


def _forget_executor() -> None:
    """In a forked child the parent's thread does not exist: start a new one when needed."""
    global _executor, _lock
    _executor, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):  # no fork on Windows
    os.register_at_fork(after_in_child=_forget_executor)


class EncodeAhead:
    """Background encodes of one field's rows, per chunk: ``blobs`` lists (the field's encoded
    frames of a chunk, None where a row waits to be encoded) filled in as jobs finish."""

    def __init__(self, codec: ImageCodec) -> None:
        self.codec = codec
        self._lock = threading.Lock()
        self._tokens: dict[int, list[object | None]] = {}
        self._jobs: dict[int, list[Future[None]]] = {}

    def submit(self, k: int, blobs: list[bytes | None], lo: int, rows: np.ndarray) -> None:
        """Encode ``rows`` (a copy of rows ``lo..`` of chunk ``k``) into ``blobs[lo:]`` in the background."""
        tok = object()
        with self._lock:
            tokens = self._tokens.setdefault(k, [None] * len(blobs))
            tokens[lo : lo + len(rows)] = [tok] * len(rows)
        codec, lock = self.codec, self._lock

        def job() -> None:
            for j in range(len(rows)):
                b = codec.encode_frame(rows[j])
                with lock:
                    if tokens[lo + j] is tok:  # not written again since
                        blobs[lo + j] = b

        self._jobs.setdefault(k, []).append(_get_executor().submit(job))

    def wait(self, k: int) -> None:
        """Wait for chunk ``k``'s jobs (raising what one raised)."""
        for f in self._jobs.pop(k, []):
            f.result()

    def forget(self, k: int) -> None:
        """Chunk ``k``'s frames are read afresh: jobs still running write into lists no longer used."""
        with self._lock:
            self._tokens.pop(k, None)
        self._jobs.pop(k, None)

    def invalidate(self, k: int, lo: int, hi: int) -> None:
        """Rows ``lo..hi`` of chunk ``k`` were given their bytes: no job may overwrite them."""
        with self._lock:
            tokens = self._tokens.get(k)
            if tokens is not None:
                tokens[lo:hi] = [None] * (hi - lo)

    def close(self) -> None:
        """Wait for every job (a close does not leave a thread writing into freed lists)."""
        for k in list(self._jobs):
            for f in self._jobs.pop(k):
                f.exception()
        with self._lock:
            self._tokens.clear()
