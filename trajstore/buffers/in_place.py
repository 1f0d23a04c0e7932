"""Stores of other formats opened in place, read-only, as a :class:`TrajectoryReplayBuffer`.

A foreign store has no commit record and no episode-id arrays.  :class:`InPlaceStore` gives the
existing buffer machinery what it reads of a :class:`~trajstore.core.store.Store`: one step
table whose fields are the foreign arrays (:class:`~trajstore.storage.fields.foreign.ForeignField`)
plus an id column computed from the episode ends
(:class:`~trajstore.storage.fields.foreign.EpisodeIdField`), and a commit record synthesized once
at open (all rows committed; no episode live).  So indexing, views, samplers, sequence windows,
the episode table and the torch datasets serve it unchanged, and nothing is copied.

:class:`InPlaceTrajectoryBuffer` is that buffer; a subclass per format implements ``load_from``
(opening by path, which pickling, dask workers and DataLoader workers use to reopen it).
Every write raises :class:`~trajstore.errors.ReadOnlyError` before it looks at its value.
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

import gymnasium

from trajstore.buffers.backend import Backend
from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.buffers.trajectory_layout import STEPS
from trajstore.core.store import Store
from trajstore.core.table import Table
from trajstore.errors import BadOptionError, ReadOnlyError
from trajstore.storage.fields.base import Field
from trajstore.storage.head import Head, TableState
from trajstore.storage.location import Location

__all__ = ["InPlaceStore", "InPlaceTrajectoryBuffer"]

#: Methods of TrajectoryReplayBuffer (and its bases) that write; refused on a store opened in place.
_WRITES = ("append", "extend", "append_flattened", "extend_flattened", "set_at", "set_flattened_at", "remove_at",
           "clear", "extend_from", "mark_episode_end", "set_episode_data_at", "set_current_episode_data",
           "remove_episodes")


class InPlaceStore(Store):
    """A read-only :class:`~trajstore.core.store.Store` over ``fields`` (step data leaves, then the
    episode ids), all ``rows`` rows committed; ``episodes`` episodes, none of them live.

    Nothing on disk changes it while it is open (no commit record to follow): ``refresh``
    reports no change.
    """

    def __init__(self, loc: Location, fields: list[Field], rows: int, episodes: int, closer: Any = None) -> None:
        # Not Store.__init__: that reads trajstore's own schema and commit record.
        self.loc = loc
        self.group = None  # type: ignore[assignment]  # no trajstore group; nothing reads it
        self.attrs = {}
        self.schema = {}
        self.writable = False
        self.closed = False
        self.multiprocessing = False
        self.lock = None
        self.opener_pid = os.getpid()
        self.options = {}
        self.fsync = False
        self.commit_interval = float("inf")
        # current episode = one past the last: no stored episode is being recorded
        self.committed = Head(tables={STEPS: TableState(0, rows, rows)},
                              state={"current_episode_id": episodes, "next_episode_id": episodes + 1})
        self.refresh_listeners = []
        self.op_listeners = []
        self._closer = closer
        self.tables = {STEPS: Table(self, STEPS, None, fields, TableState(0, rows, rows))}

    def refresh(self) -> bool:
        """Nothing to adopt: a store opened in place has no commit record."""
        return False

    def copy_to(self, dst: Any, *, storage_options: dict[str, Any] | None = None, progress: bool | None = None,
                overwrite: bool = True, stage: bool = True) -> None:
        raise BadOptionError(f"{self.loc.url}: a store opened in place cannot be copied as a trajstore store; "
                             "import it (trajstore.interop) to get one")

    def close(self) -> None:
        """Release the fields' caches and the foreign store's handle (a zip's file)."""
        if self.closed:
            return
        self.closed = True
        for t in self.tables.values():
            for f in t.fields:
                f.close()
        if self._closer is not None:
            self._closer()


def _refuse_write(name: str) -> Any:
    def refuse(self: InPlaceTrajectoryBuffer, *args: Any, **kwargs: Any) -> NoReturn:
        raise ReadOnlyError(f"{self.cache_path}: {type(self).__name__} is a {self.source_format} store opened "
                            f"in place, read-only ({name} refused); import it to get a store you can write")

    refuse.__name__ = name
    refuse.__doc__ = "Refused: raises ReadOnlyError (the store is opened in place, read-only)."
    return refuse


class InPlaceTrajectoryBuffer(TrajectoryReplayBuffer):
    """A read-only :class:`TrajectoryReplayBuffer` over a store of another format, opened in place.

    Reads (indexing, ``get_slice`` / ``get_column``, ``sample``, ``get_sequences`` /
    ``sample_sequences``, ``episodes`` / ``get_episode``, ``row_source``) behave as on a
    read-only trajectory buffer; there is no episode data (``episode_data`` is None).
    """

    #: Format name for messages (subclasses set it).
    source_format = "foreign"

    def __init__(self, store: InPlaceStore, step_space: gymnasium.Space, backend: str = "numpy",
                 device: Any = None) -> None:
        super().__init__(store, step_space, None, Backend(backend, device), open_args=dict(
            backend=backend, device=device, storage_options=None, options={}, check_bounds=False))

    @classmethod
    def load_from(cls, path: str | os.PathLike[str], *, backend: str = "numpy", device: Any = None,
                  read_only: bool = True, **kwargs: Any) -> "InPlaceTrajectoryBuffer":
        """Open the store at ``path`` in place (subclasses implement it per format)."""
        raise NotImplementedError  # abstract

    @staticmethod
    def check_open_args(what: str, read_only: bool, multiprocessing: bool = False,
                        storage_options: dict[str, Any] | None = None) -> None:
        """What every ``load_from`` refuses: a writer, multiprocessing, fsspec options."""
        if not read_only or multiprocessing:
            raise ReadOnlyError(f"{what}: a store opened in place is read-only (read_only=True, multiprocessing=False)")
        if storage_options:
            raise BadOptionError(f"{what}: local folders and .zip files only; storage_options are not taken")

    def dumps(self, path: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        """Nothing to commit; a copy elsewhere is refused (import the store instead)."""
        if path is None or self._same_path(path):
            return
        raise BadOptionError(f"dumps({os.fspath(path)!r}): a {self.source_format} store opened in place is not "
                             "copied as a trajstore store; import it (trajstore.interop) to get one")


for _name in _WRITES:
    setattr(InPlaceTrajectoryBuffer, _name, _refuse_write(_name))
del _name
