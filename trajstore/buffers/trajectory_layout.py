"""The pieces of a :class:`~trajstore.TrajectoryReplayBuffer` that its parts (reads, edits, windows,
robot data, row sources) and the package's tools (combine, staged writes, interop, the CLI) share,
each with public attributes:

- :class:`TrajectoryLayout` (``buffer.layout``): where every leaf lives: the value plans of the
  buffer's space, its steps and its episode data, the step and episode tables, the field of the
  step episode ids;
- :class:`EpisodeIds` (``buffer.id_counter``): the episode being recorded and the next fresh id;
- :class:`TrajectoryOutput` (``buffer.output``): numpy leaves as reads return them (the buffer's
  structure and backend), shared with the sharded datasets of trajectory shards.

The episode index (``buffer.episode_index``, :class:`~trajstore.core.episodes.EpisodeIndex`) is
the fourth piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import gymnasium
import numpy as np

from trajstore._optional import to_numpy
from trajstore.buffers.backend import Backend
from trajstore.core.episodes import EpisodeIndex
from trajstore.core.table import Table
from trajstore.errors import BadValueError, SpaceMismatchError
from trajstore.spaces import ValuePlan
from trajstore.storage.schema import MAX_INT

if TYPE_CHECKING:
    from trajstore.core.store import Store
    from trajstore.sampling.field_windows import FieldWindows
    from trajstore.sampling.sequences import Windows

__all__ = ["TrajectoryData", "TrajectoryLayout", "EpisodeIds", "TrajectoryOutput", "as_trajectory_data",
           "check_episode_ids", "set_episode_rows", "MAX_EPISODE_ID", "STEPS", "EPISODES", "WRAPPER_KEYS"]

STEPS, EPISODES = "step_data", "episode_data"
#: The keys of a value that carries more than step data (``extend({"step_data": ..., ...})``).
WRAPPER_KEYS = frozenset({"step_data", "episode_ids", "episode_data"})

#: Episode ids are int64 and the commit record holds ``next_episode_id`` (one past the largest),
#: which must stay below the bound of every integer in a commit record (schema.MAX_INT).
MAX_EPISODE_ID = MAX_INT - 1


class TrajectoryData(TypedDict):
    """What a trajectory buffer read returns."""

    step_data: Any
    episode_data: Any | None


def as_trajectory_data(data: dict[str, Any]) -> TrajectoryData:
    """``{"step_data", "episode_data"?}`` (a value of the buffer's space) as :class:`TrajectoryData`."""
    return TrajectoryData(step_data=data["step_data"], episode_data=data.get("episode_data"))


def check_episode_ids(ids: Any) -> np.ndarray:
    """``ids`` as int64, checked to be episode ids: integers in ``[0, MAX_EPISODE_ID)``."""
    raw = np.asarray(ids)
    if raw.dtype.kind not in "iu" or raw.dtype.itemsize > 8:
        raise BadValueError(f"episode ids must be integers; got {raw.dtype}")
    if raw.size:
        lo, hi = int(raw.min()), int(raw.max())
        if lo < 0 or hi >= MAX_EPISODE_ID:
            raise BadValueError(f"episode ids must be in [0, {MAX_EPISODE_ID}); got {lo if lo < 0 else hi}")
    return raw.astype(np.int64)


@dataclass(frozen=True)
class TrajectoryLayout:
    """Where the leaves of a trajectory buffer live.

    Attributes
    ----------
    plan : ValuePlan
        The buffer's ``single_space`` (``Dict(step_data=..., episode_data=...)``): its leaves are
        the leaves reads number.
    step_plan, episode_plan : ValuePlan, ValuePlan or None
        The step space and the episode space (None without one).
    steps : Table
        The step table: one field per step leaf, then the episode ids (``id_field``).
    episode_table : Table or None
        One row per episode with data: one field per episode leaf, then its id (``episode_id_field``).
    id_field, episode_id_field : int
        The fields of the ids in ``steps`` and ``episode_table`` (-1 without episode data).
    sources : list of (str, int)
        Leaf ``j`` of ``plan`` -> ``("s", step field)`` or ``("e", episode field)``.
    """

    plan: ValuePlan
    step_plan: ValuePlan
    episode_plan: ValuePlan | None
    steps: Table
    episode_table: Table | None
    id_field: int
    episode_id_field: int
    sources: list[tuple[str, int]]

    @classmethod
    def of(cls, store: Store, step_space: gymnasium.Space, episode_space: gymnasium.Space | None,
           check_bounds: bool) -> "TrajectoryLayout":
        """The layout of ``store``'s tables for these spaces (``check_bounds``: the plans' writes
        refuse Box values outside the bounds)."""
        parts = {STEPS: step_space} | ({EPISODES: episode_space} if episode_space is not None else {})
        plan = ValuePlan(gymnasium.spaces.Dict(parts), check_bounds=check_bounds)
        step_plan = ValuePlan(step_space, check_bounds=check_bounds)
        ep_plan = ValuePlan(episode_space, check_bounds=check_bounds) if episode_space is not None else None
        # Leaf j of single_space -> ("s", step field) or ("e", episode field); looked up in a dict
        # (a search of the leaves per leaf cost O(fields**2): 3 s of an open with 3,000 fields).
        at = {(STEPS, *lf.path): ("s", i) for i, lf in enumerate(step_plan.leaves)}
        if ep_plan is not None:
            at.update({(EPISODES, *lf.path): ("e", i) for i, lf in enumerate(ep_plan.leaves)})
        return cls(plan, step_plan, ep_plan, store.tables[STEPS], store.tables.get(EPISODES),
                   len(step_plan.leaves),  # the ids array is the step table's last field
                   len(ep_plan.leaves) if ep_plan else -1, [at[tuple(leaf.path)] for leaf in plan.leaves])

    @property
    def step_leaves(self) -> list[int]:
        """Leaves of ``plan`` stored per step, in leaf order."""
        return [j for j, s in enumerate(self.sources) if s[0] == "s"]

    @property
    def episode_leaves(self) -> list[int]:
        """Leaves of ``plan`` stored once per episode, in leaf order."""
        return [j for j, s in enumerate(self.sources) if s[0] == "e"]

    def step_ids(self, idx: int | np.ndarray) -> Any:
        """The episode ids of logical step rows ``idx`` (int: an int64 scalar; array: (B,) int64)."""
        if isinstance(idx, int):
            return self.steps.read_row(idx, [self.id_field])[0]
        return self.steps.gather(idx, [self.id_field])[0]

    def split(self, value: Any, batched: bool) -> tuple[list[np.ndarray], int, np.ndarray | None,
                                                        list[np.ndarray] | None]:
        """Check an extend/append value: bare step data or ``{"step_data", "episode_ids"?,
        "episode_data"?}``; returns ``(step leaf arrays, rows n, (n,) int64 ids or None,
        episode leaf arrays of n rows or None)``."""
        if isinstance(value, dict) and STEPS in value and set(value) <= WRAPPER_KEYS:
            step, ids, ep = value[STEPS], value.get("episode_ids"), value.get(EPISODES)
        else:
            step, ids, ep = value, None, None
        arrays, n = self.step_plan.to_arrays(step, batched=batched)
        if ids is not None:
            raw = to_numpy(ids)
            if raw.dtype.kind not in "iu" or raw.shape != ((n,) if batched else ()):
                raise BadValueError(f"episode_ids must be integers of shape {(n,) if batched else ()}; "
                                    f"got {raw.dtype} {raw.shape}")
            ids = check_episode_ids(raw).reshape(n)  # range checked before the cast to int64
        ep_arrays = None
        if ep is not None:
            if self.episode_plan is None:
                raise SpaceMismatchError("this buffer has no episode_data space; create it with "
                                         "episode_data_instance_space=... to store episode data")
            ep_arrays, m = self.episode_plan.to_arrays(ep, batched=batched)
            if m != n:
                raise BadValueError(f"episode_data has {m} rows; expected one per step ({n})")
        return arrays, n, ids, ep_arrays

    def read_rows(self, index: EpisodeIndex, idx: int | np.ndarray, leaf_ids: Sequence[int]) -> list[np.ndarray]:
        """Leaves ``leaf_ids`` of ``plan`` at logical step rows ``idx`` (int: unbatched values; (B,)
        int64: (B, ...) arrays): step leaves from the step table, episode leaves from each step's
        episode found through ``index`` (zeros where it has none).  No synchronization: the
        caller resolved ``idx`` under the current commit record."""
        src = self.sources
        step_f = [src[j][1] for j in leaf_ids if src[j][0] == "s"]
        ep_f = [src[j][1] for j in leaf_ids if src[j][0] == "e"]
        single = isinstance(idx, int)
        steps = ((self.steps.read_row(idx, step_f) if isinstance(idx, int) else self.steps.gather(idx, step_f))
                 if step_f else [])
        eps: list[np.ndarray] = []
        if ep_f:
            eps = self.episode_rows(index, np.atleast_1d(self.step_ids(idx)), ep_f)
            if single:
                eps = [e[0] for e in eps]
        it_s, it_e = iter(steps), iter(eps)
        return [next(it_s) if src[j][0] == "s" else next(it_e) for j in leaf_ids]

    def episode_rows(self, index: EpisodeIndex, ids: np.ndarray, fields: list[int]) -> list[np.ndarray]:
        """Episode-data fields ``fields`` of episodes ``ids`` (B,), found through ``index``: one
        (B, *leaf.shape) array of the leaf's dtype each, zeros where an episode has none."""
        assert self.episode_table is not None and self.episode_plan is not None
        rows = index.lookup(ids)
        have = rows >= 0
        got = self.episode_table.gather(rows[have], fields) if have.any() else None
        out = []
        for k, f in enumerate(fields):
            leaf = self.episode_plan.leaves[f]
            arr = np.zeros((len(ids), *leaf.shape), leaf.dtype)
            if got is not None:
                arr[have] = got[k]
            out.append(arr)
        return out


def set_episode_rows(index: EpisodeIndex, ids: np.ndarray, ep_arrays: list[np.ndarray]) -> None:
    """Episode data given per step row (``ids`` (n,), arrays of n rows): the last row of each
    episode wins."""
    uniq, last = np.unique(ids[::-1], return_index=True)
    for eid, k in zip(uniq.tolist(), (len(ids) - 1 - last).tolist()):
        index.set_row(eid, [a[k : k + 1] for a in ep_arrays])


class EpisodeIds:
    """The episode ids a trajectory buffer hands out.

    Attributes
    ----------
    current : int
        The episode being recorded: appended steps get it.
    next : int
        The next fresh id; every id handed out or written is below it, so none is reused.
    """

    def __init__(self, current: int, next_id: int) -> None:
        self.current, self.next = current, next_id

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "EpisodeIds":
        """From a commit record's ``state`` (``current_episode_id``, ``next_episode_id``)."""
        current = int(state.get("current_episode_id", 0))
        return cls(current, int(state.get("next_episode_id", current + 1)))

    def state(self) -> dict[str, Any]:
        """What a commit record keeps of them."""
        return {"current_episode_id": self.current, "next_episode_id": self.next}

    def new_episode(self) -> None:
        """Start a fresh episode: ``current`` becomes ``next``."""
        self.current = self.next
        self.next += 1

    def fresh(self) -> int:
        """Hand out a fresh id (``current`` stays)."""
        self.next += 1
        return self.next - 1

    def claim(self, ids: np.ndarray) -> None:
        """Ids written explicitly: they never advance ``current``, but fresh ids must never collide."""
        if ids.size:
            self.next = max(self.next, int(ids.max()) + 1)

    def adopt(self, state: dict[str, Any], follow_current: bool) -> None:
        """A newer commit record's ``state`` (``follow_current``: a reader takes its current episode)."""
        self.next = max(self.next, int(state.get("next_episode_id", 0)))
        if follow_current:
            self.current = int(state.get("current_episode_id", self.current))


class TrajectoryOutput:
    """numpy leaves as a trajectory buffer's reads return them: its structure and backend.

    Parameters
    ----------
    step_plan, episode_plan : ValuePlan, ValuePlan or None
        The step space and the episode space (None without one).
    backend : Backend
        What reads return (numpy arrays, or torch tensors on a device).
    """

    def __init__(self, step_plan: ValuePlan, episode_plan: ValuePlan | None, backend: Backend) -> None:
        self.step_plan, self.episode_plan, self.backend = step_plan, episode_plan, backend

    def _episode_data(self, arrays: list[np.ndarray]) -> Any:
        out = self.backend.out
        return self.episode_plan.from_arrays([out(a) for a in arrays]) if self.episode_plan is not None else None

    def windows(self, w: Windows) -> tuple[TrajectoryData, Any]:
        """Sequence windows (numpy, per leaf): ``(data, valid mask)``."""
        out = self.backend.out
        step_data = self.step_plan.from_arrays([out(a) for a in w.steps])
        return TrajectoryData(step_data=step_data, episode_data=self._episode_data(w.episodes)), out(w.valid)

    def field_windows(self, w: FieldWindows) -> tuple[TrajectoryData, dict[str, Any]]:
        """Per-field windows: ``(data, {key: valid mask})``."""
        out = self.backend.out
        return (TrajectoryData(step_data=w.nest(out), episode_data=self._episode_data(w.episodes)),
                {k: out(v) for k, v in w.valid.items()})
