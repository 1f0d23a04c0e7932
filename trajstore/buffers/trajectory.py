"""``TrajectoryReplayBuffer``: steps, the episode id of every step, and per-episode data.

Layout (one store, two tables, one commit record):

- table ``step_data``: ``step_data/<leaf path>`` (one array per step-space leaf) and
  ``step_episode_ids`` (int64), so the id ring is always aligned with the step ring;
- table ``episode_data`` (optional): ``episode_data/<leaf path>`` (a leaf episode space is
  ``episode_data/value``) and ``episode_data/_episode_id`` (int64), one row per episode
  that has data, in insertion order.

The commit record's ``state`` holds ``current_episode_id`` and ``next_episode_id``.  Episode
rows are evicted once the last step of their episode has left the step ring.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator, cast

import gymnasium
import numpy as np

from trajstore._optional import is_tensor, to_numpy
from trajstore.buffers.backend import Backend
from trajstore.buffers.episode_edit import EpisodeEditing
from trajstore.buffers.episode_windows import EpisodeWindows
from trajstore.buffers.replay import (
    ZarrStorage,
    check_storage_cls,
    is_remote,
)
from trajstore.buffers.robot import RobotData
from trajstore.buffers.rows import TrajectoryRows
from trajstore.buffers.trajectory_edits import TrajectoryEdits
from trajstore.buffers.trajectory_layout import (
    EPISODES,
    STEPS,
    WRAPPER_KEYS,
    EpisodeIds,
    TrajectoryData,
    TrajectoryLayout,
    TrajectoryOutput,
    set_episode_rows,
)
from trajstore.buffers.trajectory_reads import TrajectoryReads
from trajstore.core.episodes import EpisodeIndex, RunIndex
from trajstore.core.stager import RowStager
from trajstore.core.store import Store, TableSpec
from trajstore.errors import (
    BadArgumentError,
    BadOptionError,
    BadValueError,
    TrajstoreError,
    UnknownEpisodeError,
    UnsupportedSpaceError,
)
from trajstore.spaces import ValuePlan, space_to_json
from trajstore.storage.fields.layout import check_compressor_keys, make_field_spec
from trajstore.storage.fields.spec import refuse_video
from trajstore.storage.runs_file import SavedRuns, load_runs, save_runs

__all__ = ["TrajectoryReplayBuffer", "TrajectoryData"]

STEP_IDS = "step_episode_ids"
EP_ID_FIELD = "_episode_id"
_ID = ((), np.dtype(np.int64))


def _field_paths(prefix: str, plan: ValuePlan, root_leaf_name: str | None) -> list[str]:
    return [f"{prefix}/{leaf.name}" if leaf.name else (f"{prefix}/{root_leaf_name}" if root_leaf_name else prefix)
            for leaf in plan.leaves]


def _specs(paths: list[str], plan: ValuePlan, capacity: int | None, compressor: Any, chunk_rows: int | None,
           extra: list[tuple[str, tuple[int, ...], np.dtype]]) -> list:
    shapes = [(p, leaf.shape, leaf.dtype) for p, leaf in zip(paths, plan.leaves)] + extra
    return [make_field_spec(p, s, d, capacity=capacity, compressor=compressor, chunk_rows=chunk_rows)
            for p, s, d in shapes]


class TrajectoryReplayBuffer(RobotData, EpisodeWindows, EpisodeEditing, TrajectoryEdits, TrajectoryReads):
    """A disk-backed buffer of steps grouped into episodes, with optional per-episode data.

    Reads return :class:`TrajectoryData` ``{"step_data": ..., "episode_data": ... or None}``;
    ``get_at_with_metadata`` adds ``{"episode_ids": ...}``.  ``single_space`` is
    ``Dict(step_data=..., episode_data=...)`` so flattened rows follow gymnasium's layout.

    Step and episode data are checked against their spaces before anything is written, as in
    :class:`~trajstore.buffers.replay.ReplayBuffer` (dtype ranges, Discrete/MultiDiscrete/
    MultiBinary values; Box bounds only with ``check_bounds=True``).
    """

    def __init__(self, store: Store, step_space: gymnasium.Space, episode_space: gymnasium.Space | None,
                 backend: Backend, *, open_args: dict[str, Any]) -> None:
        super().__init__(store, backend, open_args)
        self.step_space, self.episode_space = step_space, episode_space
        parts = {"step_data": step_space} | ({"episode_data": episode_space} if episode_space is not None else {})
        self.single_space = gymnasium.spaces.Dict(parts)
        #: Where every leaf lives (plans, tables, id fields): what the buffer's parts and the package's tools read.
        self.layout = lay = TrajectoryLayout.of(store, step_space, episode_space,
                                                bool(open_args.get("check_bounds", False)))
        self._plan, self._table = lay.plan, lay.steps  # (StoredBuffer's and BatchBase's names for them)
        #: Reads' structure and backend.
        self.output = TrajectoryOutput(lay.step_plan, lay.episode_plan, backend)
        self._stager = RowStager(self._table, [(lf.shape, lf.dtype) for lf in lay.step_plan.leaves] + [_ID])
        self._stagers = [self._stager]
        #: The episode being recorded and the next fresh id.
        self.id_counter = EpisodeIds.from_state(store.committed.state)
        #: Episode id -> episode-data row.
        self.episode_index = EpisodeIndex(store, self._table, lay.id_field, lay.episode_table, lay.episode_id_field,
                                          lambda: self.current_episode_id)
        self.run_index = RunIndex(self._table, self.layout.id_field, lambda: store.committed.epoch, self._saved_runs)
        store.state_provider = self._state
        store.refresh_listeners.append(self._adopt)
        store.op_listeners.append(self._check_fork)
        self._pid = os.getpid()
        self._table.listeners.append(self.episode_index.after_step_block)
        self._last_id: int | None = None  # episode id of the last step written (where video runs end)
        if any(f.spec.layout == "video" for f in self._table.fields):
            if store.multiprocessing:
                raise BadOptionError(f"{store.loc.url}: video fields are written by one process per store "
                                     "(multiprocessing=False): each encodes the episodes it records")
            self._table.listeners.append(self._episode_ends)
        self._table.extend_listeners.append(self.episode_index.after_step_extend)
        if store.writable and store.loc.transaction is not None:
            # An icechunk writer names its episodes in each commit's metadata: `trajstore log`
            # then reads no snapshot's data (storage/icechunk_location.py).
            store.loc.transaction.describe = self._describe_commit
        if store.writable and (store.multiprocessing or (store.lock is not None and store.lock.previous_unclean)):
            # A crashed writer's episode may be half written and another process may write
            # concurrently: this handle starts a fresh id, so no id is ever shared or reused.
            with store.write_op():
                self.id_counter.new_episode()
                if not store.multiprocessing:
                    store.commit(state=self._state())

    def _saved_runs(self) -> SavedRuns | None:
        """The run index a writer saved at close: a writer's open took it (and removed the file);
        a reader reads it at its first windowed sample."""
        st = self._store
        return st.saved_runs if st.writable else load_runs(st.loc, st.committed, self._table.capacity)

    def _describe_commit(self, head: dict[str, Any]) -> dict[str, Any]:
        """``{"episodes": n}`` for the commit record ``head`` being committed (episodes with steps
        in its step table's rows), when the run index holds them at the record's epoch; else
        nothing (`trajstore log` then counts them from the snapshot)."""
        st = (head.get("tables") or {}).get(STEPS)
        if head.get("pending") or not isinstance(st, dict):
            return {}
        n = self.run_index.episodes_between(int(st["start"]), int(st["end"]), int(head.get("epoch", 0)), 1 << 20)
        return {} if n is None else {"episodes": n}

    def _after_last_commit(self) -> None:
        """Save the run index for the next readers (:mod:`trajstore.storage.runs_file`).

        Local single writers only: a multiprocessing writer's view may lag the others' commits,
        and on a remote store the ids not yet scanned would be fetched just to save the scan.
        A cache: when it cannot be written, readers scan the ids as without it."""
        st = self._store
        if st.multiprocessing or not st.loc.is_local:
            return
        try:
            saved = self.run_index.saved()
            if saved is not None:
                save_runs(st.loc, saved)
        except (TrajstoreError, OSError) as e:
            warnings.warn(f"{st.loc.url}: the run index was not saved ({e}); readers will scan the step ids",
                          stacklevel=3)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        step_data_instance_space: gymnasium.Space,
        step_data_storage_cls: Any = None,
        *,
        step_data_capacity: int | None = None,
        step_episode_id_storage_cls: Any = None,
        step_episode_id_capacity: int | None = None,
        step_episode_id_storage_kwargs: dict[str, Any] | None = None,
        episode_data_instance_space: gymnasium.Space | None = None,
        episode_data_storage_cls: Any = None,
        episode_data_capacity: int | None = None,
        episode_data_storage_kwargs: dict[str, Any] | None = None,
        cache_path: str | os.PathLike[str] | None = None,
        multiprocessing: bool = False,
        backend: str = "numpy",
        device: Any = None,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
        check_bounds: bool = False,
        **kwargs: Any,
    ) -> "TrajectoryReplayBuffer":
        """Create an empty trajectory buffer.

        ``step_data_capacity`` bounds the step ring (``None``: unbounded); the episode-id ring is
        always the same ring (``step_episode_id_capacity``, if given, must equal it).
        ``episode_data_capacity`` bounds the episode rows.  ``**kwargs`` are storage options for
        the step data (``chunk_rows``, ``compressor``, ``fsync``, ``commit_interval``); the
        ``*_storage_kwargs`` dicts override ``chunk_rows``/``compressor`` for ids and episode data.
        ``check_bounds=True`` makes writes of step and episode data refuse Box values outside
        ``low``/``high`` and NaN, as :meth:`ReplayBuffer.create <trajstore.ReplayBuffer.create>`
        explains: a setting of this handle, not saved in the store (give it to ``load_from``
        again; pickled handles keep it).
        """
        for c in (step_data_storage_cls, step_episode_id_storage_cls, episode_data_storage_cls):
            check_storage_cls(c)
        if "capacity" in kwargs:  # ReplayBuffer.create's name; here steps and episode data each have one
            raise BadArgumentError(f"TrajectoryReplayBuffer.create takes step_data_capacity= (steps kept in the ring) "
                                   f"and episode_data_capacity= (episode-data rows), not capacity=; got "
                                   f"capacity={kwargs['capacity']!r}")
        if step_episode_id_capacity is not None and step_episode_id_capacity != step_data_capacity:
            raise BadOptionError(f"step_episode_id_capacity={step_episode_id_capacity} must equal step_data_capacity="
                             f"{step_data_capacity}: the id ring is aligned with the step ring")
        opts = ZarrStorage.check_options(dict(kwargs), ZarrStorage.CREATE_OPTIONS)
        id_opts = ZarrStorage.check_options(dict(step_episode_id_storage_kwargs or {}), ("chunk_rows", "compressor"))
        ep_opts = ZarrStorage.check_options(dict(episode_data_storage_kwargs or {}), ("chunk_rows", "compressor"))
        for cap, name in ((step_data_capacity, "step_data_capacity"), (episode_data_capacity, "episode_data_capacity")):
            if cap is not None and (not isinstance(cap, (int, np.integer)) or cap < 1):
                raise BadOptionError(f"{name} must be a positive int or None; got {cap!r}")
        bk = Backend(backend, device)
        step_plan = ValuePlan(step_data_instance_space)
        ep_plan = ValuePlan(episode_data_instance_space) if episode_data_instance_space is not None else None
        if ep_plan is not None and any(lf.path[:1] == (EP_ID_FIELD,) for lf in ep_plan.leaves):
            raise UnsupportedSpaceError(f"episode space key {EP_ID_FIELD!r} is reserved for the episode ids")
        compressor = opts.pop("compressor", "lz4" if is_remote(cache_path) else None)
        chunk_rows = opts.pop("chunk_rows", None)
        check_compressor_keys(compressor, _field_paths(STEPS, step_plan, None))  # (a dict by leaf name)
        step_fields = _specs(_field_paths(STEPS, step_plan, None), step_plan, step_data_capacity, compressor,
                             chunk_rows, [])
        id_field = _specs([], step_plan, step_data_capacity, id_opts.get("compressor", compressor),
                          id_opts.get("chunk_rows", chunk_rows), [(STEP_IDS, (), np.dtype(np.int64))])
        refuse_video(id_field, "the episode ids")
        tables = [TableSpec(STEPS, step_data_capacity, step_fields + id_field)]
        spaces = {STEPS: space_to_json(step_data_instance_space)}
        if ep_plan is not None:
            ep_comp = ep_opts.get("compressor", compressor)
            ep_fields = _specs(_field_paths(EPISODES, ep_plan, "value"), ep_plan, episode_data_capacity, ep_comp,
                               ep_opts.get("chunk_rows"), [(f"{EPISODES}/{EP_ID_FIELD}", (), np.dtype(np.int64))])
            refuse_video(ep_fields, "episode data (one row per episode)")
            tables.append(TableSpec(EPISODES, episode_data_capacity, ep_fields))
            assert episode_data_instance_space is not None  # (ep_plan is made from it)
            spaces[EPISODES] = space_to_json(episode_data_instance_space)
        store = Store.create(cache_path, "TrajectoryReplayBuffer", tables, {"spaces": spaces},
                             storage_options=storage_options, overwrite=overwrite, multiprocessing=multiprocessing,
                             options=opts)
        store.committed.state = {"current_episode_id": 0, "next_episode_id": 1}
        return cls(store, step_data_instance_space, episode_data_instance_space, bk, open_args=dict(
            backend=backend, device=device, storage_options=storage_options, options=opts,
            check_bounds=bool(check_bounds)))

    @classmethod
    def load_from(
        cls,
        path: str | os.PathLike[str],
        *,
        backend: str = "numpy",
        device: Any = None,
        read_only: bool = False,
        multiprocessing: bool = False,
        step_storage_kwargs: dict[str, Any] | None = None,
        step_episode_id_storage_kwargs: dict[str, Any] | None = None,
        episode_storage_kwargs: dict[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        check_bounds: bool = False,
        **storage_kwargs: Any,
    ) -> "TrajectoryReplayBuffer":
        """Open an existing trajectory buffer (metadata and commit record only).

        The ``*_storage_kwargs`` dicts are accepted for UniEnv compatibility; chunking and codecs
        are fixed at create, so only ``fsync`` and ``commit_interval`` (in ``**storage_kwargs``) apply.
        ``storage_options`` as in :meth:`ReplayBuffer.load_from` (fsspec's options, and the
        ``trajstore_chunk_cache`` folder for remote stores read many times).
        ``check_bounds=True``: this handle's writes refuse Box values outside the bounds (see
        :meth:`create`; not stored, so give it on every open).
        """
        opts = ZarrStorage.check_options(dict(storage_kwargs), ZarrStorage.OPEN_OPTIONS)
        for extra in (step_storage_kwargs, step_episode_id_storage_kwargs, episode_storage_kwargs):
            ZarrStorage.check_options(dict(extra or {}), ZarrStorage.OPEN_OPTIONS + ("chunk_rows", "compressor"))

        def build(store: Store, bk: Backend, open_args: dict[str, Any]) -> "TrajectoryReplayBuffer":
            return cls(store, store.space(STEPS), store.space(EPISODES), bk,
                       open_args=open_args | {"check_bounds": bool(check_bounds)})

        return cls._open_store("TrajectoryReplayBuffer", path, build, backend=backend,  # type: ignore[return-value]
                               device=device, read_only=read_only, multiprocessing=multiprocessing,
                               storage_options=storage_options, options=opts)

    # -- episode ids -------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return self.id_counter.state()

    @property
    def current_episode_id(self) -> int:
        """The id of the episode being recorded: appended steps get it."""
        return self.id_counter.current

    @current_episode_id.setter
    def current_episode_id(self, episode_id: int) -> None:
        self.id_counter.current = int(episode_id)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """A write operation of the store (:meth:`Store.write_op <trajstore.core.store.Store.write_op>`)
        with the staged appends handed to the tables first: what every edit runs in."""
        with self._store.write_op():
            self._drain()
            yield

    def _adopt(self) -> None:
        """After a newer commit record was read (readers, multi-process writers)."""
        state = self._store.committed.state
        self.id_counter.adopt(state, follow_current=self.read_only)
        self.episode_index.forget()

    def _check_fork(self) -> None:
        """Multiprocessing: a forked copy of this handle must not continue the parent's episode."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self.id_counter.new_episode()

    def mark_episode_end(self) -> None:
        """End the current episode: later steps get a new ``current_episode_id``."""
        with self.writing():
            self.id_counter.new_episode()
            if self._table.capacity is None:
                self._table.end_run(self._table.state.end)  # a video field encodes the episode

    def clear(self) -> None:
        """Remove every step and episode; ids are never reused (a fresh episode starts)."""
        with self._store.write_op():
            self._stager.discard()
            for tab in (self._table, self.layout.episode_table):
                if tab is not None:
                    tab.state.start = tab.state.end = 0
            self.episode_index.forget()
            self.id_counter.new_episode()
            head = self._store.current_head()
            head.epoch += 1
            head.state = self._state()
            self._store.write_record(head)

    def _episode_ends(self, lo: int, arrays: Any) -> None:
        """A block of steps at absolute row ``lo`` was written: where its episode id changes (also
        from the step before), an episode ended (video fields encode it at the next commit)."""
        ids = np.asarray(arrays[self.layout.id_field])
        if not len(ids):
            return
        cuts = (lo + 1 + np.flatnonzero(ids[1:] != ids[:-1])).tolist()
        if self._last_id is not None and int(ids[0]) != self._last_id:
            cuts.insert(0, lo)
        self._last_id = int(ids[-1])
        for c in cuts:
            self._table.end_run(c)

    @property
    def episode_capacity(self) -> int | None:
        """Rows of episode data kept (``episode_data_capacity`` at ``create``): ``None`` when
        unbounded or when the buffer has no episode data space."""
        et = self.layout.episode_table
        return None if et is None else et.capacity

    def episode_id_to_episode_data_index(self, episode_id: Any) -> Any:
        """Logical episode-data row(s) of episode id(s); int in, int out; array (numpy or torch) in,
        int64 array of the same kind out.

        Raises
        ------
        UnknownEpisodeError
            An id that has no episode data (never set, or evicted); a ``KeyError``.
        """
        self._sync()
        is_torch = is_tensor(episode_id)
        q = to_numpy(episode_id)
        rows = self.episode_index.lookup(q.astype(np.int64).ravel())
        if (rows < 0).any():
            raise UnknownEpisodeError(f"no episode data for episode id(s) {np.unique(q.ravel()[rows < 0]).tolist()}")
        rows = rows.reshape(q.shape)
        if q.ndim == 0 and not is_torch:
            return int(rows)
        if is_torch:
            import torch

            return torch.as_tensor(rows, device=episode_id.device)
        return rows

    # -- writes ---------------------------------------------------------------------------------
    def append(self, value: Any) -> None:
        """Add one step (bare step data, or ``{"step_data", "episode_ids"?, "episode_data"?}``)."""
        if (not self._store.multiprocessing and self._store.writable and not self._store.closed
                and not (isinstance(value, dict) and "step_data" in value and set(value) <= WRAPPER_KEYS)):
            st = self._stager
            st.room()
            self.layout.step_plan.write_row(value, st.bufs, st.n)
            st.bufs[-1][st.n] = self.current_episode_id
            st.added()
            return
        self.extend_leaves(*self.layout.split(value, batched=False))

    def extend(self, value: Any) -> None:
        """Add steps with a leading batch axis; every step gets ``current_episode_id`` unless the
        value carries ``"episode_ids"`` (B,).  ``"episode_data"`` (B rows) sets the data of the
        episodes of those steps (the last row of each episode wins)."""
        self.extend_leaves(*self.layout.split(value, batched=True))

    def extend_flattened(self, value: Any) -> None:
        """Add steps given in gymnasium's flattened layout of ``single_space`` (B, flatdim)."""
        flat = to_numpy(value)
        arrays = self._plan.unflatten(flat)
        nested = self._plan.from_arrays(arrays)
        self.extend({k: v for k, v in nested.items()})

    def append_flattened(self, value: Any) -> None:
        """Add one step given in gymnasium's flattened layout of ``single_space``.

        With an episode space, the row holds episode data too (gymnasium orders the keys:
        ``episode_data`` first, then ``step_data``); it sets the data of the current episode.

        Parameters
        ----------
        value : (flatdim,) array
            The flattened row (numpy or torch); ``flatdim`` is that of ``single_space``.

        Raises
        ------
        BadValueError
            ``value`` is not 1-D, has the wrong width or dtype, or a segment decodes to no value
            of its leaf.
        ReadOnlyError
            The buffer is open read-only.
        ClosedError
            The buffer was closed.
        """
        flat = to_numpy(value)
        if flat.ndim != 1:
            raise BadValueError(f"append_flattened expects shape ({self._plan.flat_dim},); got {flat.shape}")
        self.extend_flattened(flat[None])

    def extend_leaves(self, arrays: list[np.ndarray], n: int, ids: np.ndarray | None,
                      ep_arrays: list[np.ndarray] | None) -> None:
        """Add ``n`` steps given as checked leaf arrays (what :meth:`TrajectoryLayout.split
        <trajstore.buffers.trajectory_layout.TrajectoryLayout.split>` returns): step leaves of n
        rows, their (n,) int64 episode ids (None: the current episode) and episode leaves of n
        rows (None: no episode data; the last row of each episode wins)."""
        self._check_timestamps(arrays, np.full(n, self.current_episode_id, np.int64) if ids is None else ids)
        with self.writing():
            if ids is None:
                ids = np.full(n, self.current_episode_id, np.int64)
            else:
                self.id_counter.claim(ids)
            self._table.extend(arrays + [ids], n)
            if ep_arrays is not None and n:
                set_episode_rows(self.episode_index, ids, ep_arrays)

    def row_source(self) -> "TrajectoryRows":
        """This buffer's step rows as an :class:`~trajstore.sampling.source.EpisodeSource`."""
        return cast("TrajectoryRows", super().row_source())  # made by _make_row_source below

    def _make_row_source(self) -> "TrajectoryRows":
        return TrajectoryRows(self)
