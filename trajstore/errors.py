"""Exceptions raised by trajstore.

Every error a user can provoke is one of these classes, so callers can catch
``trajstore.errors.TrajstoreError`` (or a more specific class) instead of
matching messages.  Several also subclass the builtin users already expect
(``FileNotFoundError``, ``ValueError``, ``IndexError``...).
"""

from __future__ import annotations

__all__ = [
    "TrajstoreError",
    "StoreNotFoundError",
    "NotATrajstoreError",
    "FormatVersionError",
    "DamagedStoreError",
    "ForeignFileError",
    "ReadOnlyError",
    "LockedError",
    "LeaseHeldError",
    "SpaceError",
    "UnsupportedSpaceError",
    "SpaceMismatchError",
    "BadValueError",
    "StoreExistsError",
    "MissingDependencyError",
    "StoreFullError",
    "MappingLimitError",
    "IndexOutOfRangeError",
    "BadIndexError",
    "EmptyBufferError",
    "ConcurrentWriteError",
    "VersionNotFoundError",
    "DatasetMismatchError",
    "ChecksumError",
    "BadArgumentError",
    "BadOptionError",
    "ClosedError",
    "UnknownFieldError",
    "UnknownEpisodeError",
    "NoEpisodesError",
    "BadWeightsError",
    "ResumeStateError",
    "UnknownTaskError",
    "TimeOrderError",
    "EncoderError",
]


class TrajstoreError(Exception):
    """Base class of every trajstore error."""


class StoreNotFoundError(TrajstoreError, FileNotFoundError):
    """No store exists at the given path."""


class StoreExistsError(TrajstoreError, FileExistsError):
    """``create`` found an existing store and ``overwrite`` was not set."""


class NotATrajstoreError(TrajstoreError, ValueError):
    """The path holds something, but not a trajstore store (or not of the expected kind)."""


class FormatVersionError(TrajstoreError):
    """The store was written by a newer trajstore format than this version reads."""


class DamagedStoreError(TrajstoreError):
    """The store's metadata or commit record is missing, unreadable or inconsistent."""


class ForeignFileError(DamagedStoreError):
    """A file an import reads (a D4RL, robomimic or Minari HDF5 file, a Diffusion Policy zarr store)
    holds what trajstore refuses to read: a link out of it, values stored in other files, a special
    file, or sizes, nesting or link counts beyond the limits of trajstore's own stores.  The message
    names the file and the object; nothing was written to the destination."""


class ReadOnlyError(TrajstoreError, PermissionError):
    """A write was attempted on a read-only buffer or view."""


class LockedError(TrajstoreError, BlockingIOError):
    """Another writer holds the store's writer lock."""


class LeaseHeldError(LockedError):
    """A remote store's writer lease is held by another writer that is not known to be dead (also
    one whose lease expired: a paused writer cannot be told from a dead one, and would overwrite
    the next writer's rows when it resumed).  The message names the holder and how old its lease
    is; :func:`trajstore.break_lease` removes it once that writer is known to be gone."""


class SpaceError(TrajstoreError, ValueError):
    """Base class of problems with spaces and with values checked against them."""


class UnsupportedSpaceError(SpaceError, TypeError):
    """A space (or one of its leaves) cannot be stored; the message names the leaf path."""


class SpaceMismatchError(SpaceError):
    """A given space differs from the one stored, or a value's structure differs from the space."""


class BadValueError(SpaceError):
    """A value has the wrong shape, a dtype that cannot be cast safely, or a wrong flattened width."""


class MissingDependencyError(TrajstoreError, ImportError):
    """An optional dependency needed for the requested feature is not installed."""


class StoreFullError(TrajstoreError, OSError):
    """The filesystem holding the store is full (``errno`` is ``ENOSPC`` or ``EDQUOT``).

    Raised at a safe point: before anything was written through a memory mapping into space the
    filesystem had not reserved, so the last commit is intact and the buffer stays usable (the
    failed call changed nothing a reader sees); free space and write again.
    """


class MappingLimitError(TrajstoreError, OSError):
    """The process cannot map more chunk files (``errno`` is ``ENOMEM``): Linux limits a process to
    ``vm.max_map_count`` mappings (65,530 by default) and every raw chunk file mapped is one.  Raise
    the limit (``sysctl vm.max_map_count=262144``), open fewer stores at once, or create the store
    with larger ``chunk_rows``.  Nothing was written; the buffer stays usable for other rows."""


class IndexOutOfRangeError(TrajstoreError, IndexError):
    """A row index (or an element of an index array) is outside ``[-len, len)``, or a bool mask's
    length differs from the buffer's."""


class BadIndexError(TrajstoreError, TypeError):
    """An index is not an int, slice, ``...``, 1-D int array or bool mask."""


class EmptyBufferError(TrajstoreError, ValueError):
    """Sampling from a buffer (or a ring a writer emptied meanwhile) that holds no rows."""


class ConcurrentWriteError(TrajstoreError, RuntimeError):
    """A reader could not get one consistent result: the writer kept evicting or rewriting the
    rows it read (retried many times first); or, on an icechunk location, another writer committed
    changes to the same keys since this writer's session began (nothing of it was published)."""


class EncoderError(TrajstoreError, RuntimeError):
    """A video encoder failed on an episode: it stalled (no frame encoded for the watchdog's limit)
    or its process exited or reported an error, on every attempt (each with a fresh encoder).  The
    message names the encoder, the field and rows, and what happened each time; nothing of the
    episode was committed, its frames are still held, and the store stays writable (the next
    commit tries them again)."""


class VersionNotFoundError(TrajstoreError, LookupError):
    """No version of this dataset has that name: an unknown tag, a snapshot id of another
    dataset, a datetime before the first commit."""


class DatasetMismatchError(TrajstoreError, ValueError):
    """Two stores that should be versions of one dataset are not (another kind, other fields),
    e.g. a push onto a remote that holds another dataset."""


class ChecksumError(DamagedStoreError):
    """Bytes read do not match the content checksum recorded when they were published (a pull
    from a remote whose chunks changed or were damaged after the push)."""


class BadArgumentError(TrajstoreError, TypeError):
    """An argument has the wrong type for its parameter (e.g. a path given positionally where
    ``create`` takes the storage class); the message names the parameter and the fix."""


class BadOptionError(TrajstoreError, ValueError):
    """An argument's value is outside what its parameter allows (a capacity, ``chunk_rows``,
    ``seq_len``, ``pad``, ``backend``, ``compressor``...); the message names the parameter, what
    it allows and what arrived."""


class ClosedError(TrajstoreError, ValueError):
    """An operation on a buffer that was closed (as Python's files, a ``ValueError``)."""


class UnknownEpisodeError(TrajstoreError, KeyError):
    """An episode id that has no data (or no steps) in the store: never written, or evicted."""

    def __str__(self) -> str:  # KeyError would show the message as a quoted repr
        return str(self.args[0]) if self.args else ""


class UnknownFieldError(TrajstoreError, KeyError):
    """A field name that the store does not have; the message lists the fields it has."""

    def __str__(self) -> str:  # KeyError would show the message as a quoted repr
        return str(self.args[0]) if self.args else ""


class NoEpisodesError(TrajstoreError, ValueError):
    """Episodes were asked of a store that records no episode boundaries (a ReplayBuffer without
    ``terminated``/``truncated``/``done`` fields); the message names the fields looked for."""


class BadWeightsError(BadOptionError):
    """Sampling weights that cannot make a distribution: a negative, NaN or infinite weight, or
    weights that are all zero; the message names the dataset (and item) and the weight."""


class ResumeStateError(TrajstoreError, ValueError):
    """A saved sampler position (``load_state_dict``) that is not this sampler's: another kind of
    sampler, another seed, rank or dataset; the message names each field that differs."""
class UnknownTaskError(TrajstoreError, KeyError):
    """A task string (or task index) that the store's task dictionary does not hold; the message
    lists the tasks it has (docs/robot.md)."""

    def __str__(self) -> str:  # KeyError would show the message as a quoted repr
        return str(self.args[0]) if self.args else ""


class TimeOrderError(BadValueError):
    """Timestamps of one episode that go back in time (a ``timestamp`` step field must not
    decrease within an episode; docs/robot.md "Time")."""
