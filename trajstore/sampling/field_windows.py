"""Per-field windows over an :class:`~trajstore.sampling.source.EpisodeSource` (issue 16): each
named field of a Dict step space has its own offsets and padding (an observation history with a
longer chunk of future actions, as Diffusion Policy's ``n_obs_steps`` / ``horizon`` or LeRobot's
``delta_timestamps``).

One window serves every field: the *span* ``[anchor + lo, anchor + hi]`` with ``lo`` / ``hi`` the
smallest / largest offset of any field (and 0, so the anchor row is always inside).  Which frames
are valid, and which row pads an invalid one, is decided once over the span (the run index
answers for spans wholly inside one episode, without reading ids).  Each field is then read once:
as blocks of the span's rows when its frames cover at least half the span, otherwise by
gathering its own frames' rows; fields not named are not read.

``pad="edge"`` fills an invalid frame with the nearest valid row of the span: the first step of
the anchor's episode for frames before the anchor, its last step for frames after it (Diffusion
Policy's ``pad_before`` / ``pad_after``).  A span far wider than its frames (more than 4096 rows
and four times its distinct offsets) is not read whole: its frames are resolved row by row, and
an invalid frame repeats the first or last row of the anchor's run of equal episode ids, which
the run index gives (O(runs) per call, so only for such spans).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import gymnasium
import numpy as np

from trajstore.core.ring import normalize_index
from trajstore.errors import BadArgumentError, BadOptionError, UnknownFieldError
from trajstore.sampling.sequences import PADS, block_ok, draw_anchors, pad_sources, span_frames, window_rows
from trajstore.sampling.source import EpisodeSource, put_rows, read_consistent, sample_consistent
from trajstore.spaces import leaves

__all__ = ["FieldWindow", "FieldWindows", "get_field_windows", "resolve_fields", "sample_field_windows",
           "seq_len_or_offsets", "span_of"]

#: A span wider than this (and than 4x its distinct offsets) is resolved offset by offset.
DENSE_SPAN = 4096


class FieldWindow(NamedTuple):
    """One named field: which step leaves it covers and the frames it reads."""

    key: str  # as the caller named it ("obs/image")
    path: tuple[str, ...]  # Dict keys from the step space's root
    space: gymnasium.Space[Any]  # the named subspace (a leaf, or a Dict/Tuple read whole)
    leaves: list[int]  # the source's leaf numbers, in the subspace's leaf order
    offsets: np.ndarray  # (T,) int64
    pad: str


class FieldWindows(NamedTuple):
    """Per-field windows as numpy, before a buffer gives them its structure and backend."""

    fields: list[FieldWindow]  # in the caller's key order
    steps: dict[str, list[np.ndarray]]  # key -> one (B, T_key, *leaf.shape) array per leaf of the field
    episodes: list[np.ndarray]  # one (B, *leaf.shape) array per episode leaf, of each anchor's episode
    valid: dict[str, np.ndarray]  # key -> (B, T_key) bool

    def nest(self, out: Callable[[np.ndarray], Any]) -> dict[str, Any]:
        """The named fields nested as in the step space (Dict keys in the space's order), each leaf
        converted by ``out`` (the buffer's backend)."""
        tree: dict[str, Any] = {}
        for f in sorted(self.fields, key=lambda f: f.leaves[0]):
            node = tree
            for k in f.path[:-1]:
                node = node.setdefault(k, {})
            node[f.path[-1]] = _nest(f.space, iter([out(a) for a in self.steps[f.key]]))
        return tree

    def by_key(self, out: Callable[[np.ndarray], Any]) -> dict[str, Any]:
        """``{key: value}`` in the caller's key order, each value nested as its subspace."""
        return {f.key: _nest(f.space, iter([out(a) for a in self.steps[f.key]])) for f in self.fields}


def span_of(fields: list[FieldWindow]) -> tuple[int, int]:
    """``(lo, hi)``: the smallest and largest offset of any field, and 0 (the anchor)."""
    every = np.concatenate([f.offsets for f in fields] + [np.zeros(1, np.int64)])
    return int(every.min()), int(every.max())


def _nest(space: gymnasium.Space[Any], arrays: Any) -> Any:
    """Leaf arrays (in :func:`~trajstore.spaces.leaves` order) nested like ``space``."""
    if type(space) is gymnasium.spaces.Dict:
        return {k: _nest(s, arrays) for k, s in space.spaces.items()}
    if type(space) is gymnasium.spaces.Tuple:
        return tuple(_nest(s, arrays) for s in space.spaces)
    return next(arrays)


def seq_len_or_offsets(seq_len: Any, offsets: Any) -> None:
    """Check that exactly one of ``seq_len`` and ``offsets`` was given (``sample_sequences``).

    Raises
    ------
    BadArgumentError
        Both or neither.
    """
    if (seq_len is None) == (offsets is None):
        got = "both" if seq_len is not None else "neither"
        raise BadArgumentError(f"sample_sequences takes either seq_len (one window of consecutive steps for every "
                               f"field) or offsets= (a mapping of fields to offsets); got {got}")


def _dict_nodes(space: gymnasium.Space[Any], path: tuple[str, ...] = ()) -> list[str]:
    """Names of every node reachable through Dict keys ("obs", "obs/image", ...)."""
    if type(space) is not gymnasium.spaces.Dict:
        return []
    names: list[str] = []
    for k, sub in space.spaces.items():
        names.append("/".join(path + (k,)))
        names.extend(_dict_nodes(sub, path + (k,)))
    return names


def _field_space(step_space: gymnasium.Space[Any], key: Any) -> tuple[tuple[str, ...], gymnasium.Space[Any]]:
    """Path and subspace that ``key`` names (Dict keys joined by "/")."""
    if not isinstance(key, str):
        raise BadArgumentError(f"offsets keys must be str field paths such as 'obs' or 'obs/image'; got {key!r}")
    space, path = step_space, tuple(key.split("/")) if key else ()
    for k in path:
        if type(space) is not gymnasium.spaces.Dict or k not in space.spaces:
            inside = "a Tuple is named whole, not by position; " if type(space) is gymnasium.spaces.Tuple else ""
            raise UnknownFieldError(f"offsets names {key!r}, which is not a field of the step space; {inside}"
                                    f"fields: {_dict_nodes(step_space)}")
        space = space.spaces[k]
    if not path:
        raise UnknownFieldError(f"offsets names {key!r}, which is not a field of the step space; "
                                f"fields: {_dict_nodes(step_space)}")
    return path, space


def _offsets(key: str, value: Any) -> np.ndarray:
    """``offsets[key]`` as (T,) int64, checked."""
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:  # ragged lists
        raise BadArgumentError(f"offsets[{key!r}] must be a 1-D sequence of ints; got {value!r:.80}") from e
    if arr.ndim != 1:
        raise BadArgumentError(f"offsets[{key!r}] must be a 1-D sequence of ints (a list, range or int array); "
                               f"got {type(value).__name__} of shape {arr.shape}")
    if arr.size == 0:
        raise BadOptionError(f"offsets[{key!r}] is empty; give at least one offset (0 is the anchor row)")
    if arr.dtype.kind not in "iu":
        raise BadArgumentError(f"offsets[{key!r}] must be integers; got {arr.dtype} values {value!r:.80}")
    return arr.astype(np.int64)


def resolve_fields(step_space: gymnasium.Space[Any], step_leaves: list[int], offsets: Mapping[Any, Any],
                   pad: str | Mapping[Any, Any]) -> list[FieldWindow]:
    """The fields an ``offsets`` mapping names, checked.

    Parameters
    ----------
    step_space : gymnasium.spaces.Dict
        The buffer's step space.
    step_leaves : list of int
        The source's leaf number of each step-space leaf (in :func:`~trajstore.spaces.leaves` order).
    offsets : mapping
        Field path (Dict keys joined by ``"/"``; a Dict or Tuple node is read whole) -> 1-D ints.
    pad : str or mapping
        One mode for every field, or field path -> mode (fields left out: ``"edge"``).

    Raises
    ------
    BadArgumentError
        The step space is not a Dict; a key is not a str; offsets are not 1-D integers.
    UnknownFieldError
        A key names no field of the step space.
    BadOptionError
        No field, an empty offsets list, fields that overlap, a pad mode other than "edge" /
        "zero", or a pad key that ``offsets`` does not name.
    """
    if type(step_space) is not gymnasium.spaces.Dict:
        raise BadArgumentError(f"offsets as a mapping of fields needs a Dict step space; this buffer's step space is "
                               f"{type(step_space).__name__}: pass one list of offsets instead")
    if not offsets:
        raise BadOptionError("offsets is an empty mapping; name at least one field, e.g. {'obs': [-1, 0]}")
    pads = dict(pad) if isinstance(pad, Mapping) else {}
    if isinstance(pad, Mapping):
        extra = [k for k in pads if k not in offsets]
        if extra:
            raise BadOptionError(f"pad names {extra}, which offsets does not; offsets names {list(offsets)}")
    for k, mode in (pads.items() if isinstance(pad, Mapping) else [("", pad)]):
        if not isinstance(mode, str) or mode not in PADS:
            where = f"pad[{k!r}]" if isinstance(pad, Mapping) else "pad"
            raise BadOptionError(f"{where} must be one of {PADS}; got {mode!r}")
    all_leaves = leaves(step_space)
    fields: list[FieldWindow] = []
    for key, value in offsets.items():
        path, space = _field_space(step_space, key)
        mine = [i for i, lf in enumerate(all_leaves) if lf.path[: len(path)] == path]
        for f in fields:
            if f.path[: len(path)] == path or path[: len(f.path)] == f.path:
                raise BadOptionError(f"offsets names both {f.key!r} and {key!r}, which overlap; name each leaf once")
        mode = pads.get(key, "edge") if isinstance(pad, Mapping) else pad
        fields.append(FieldWindow(key, path, space, [step_leaves[i] for i in mine], _offsets(key, value), mode))
    return fields


class _Span(NamedTuple):
    """The frames every field's window is cut from."""

    offsets: np.ndarray  # (S,) int64: lo .. hi (dense), or the distinct offsets of all fields and 0
    dense: bool  # offsets are lo .. hi, consecutive


def _span(fields: list[FieldWindow]) -> _Span:
    # A sorted set, not np.unique: a process's first np.unique imports numpy.ma (40-60 ms, which
    # landed in the first batch of every DataLoader worker).
    every = np.array(sorted({0, *(int(o) for f in fields for o in f.offsets.tolist())}), np.int64)
    lo, hi = int(every[0]), int(every[-1])
    if hi - lo + 1 <= max(DENSE_SPAN, 4 * len(every)):
        return _Span(np.arange(lo, hi + 1, dtype=np.int64), True)
    return _Span(every, False)


def _read(src: EpisodeSource, anchors: np.ndarray, fields: list[FieldWindow], span: _Span,
          all_valid: bool = False) -> FieldWindows:
    """Per-field windows of logical ``anchors``.  ``all_valid``: the caller knows every span is a
    block wholly inside one episode (``within_episode`` sampling checked it).

    Steps: the span's rows and their validity (:func:`_span_rows`), the rows ``edge`` padding
    repeats (:func:`_edge_rows`), then each field's frames, read as blocks or gathered."""
    U = span.offsets
    B, S = len(anchors), len(U)
    first, rows, valid = _span_rows(src, anchors, span, all_valid)
    edge = _edge_rows(src, anchors, fields, span, rows, valid)
    col = {int(o): t for t, o in enumerate(U.tolist())}
    steps: dict[str, list[np.ndarray]] = {}
    masks: dict[str, np.ndarray] = {}
    cols = {f.key: np.array([col[o] for o in f.offsets.tolist()], np.int64) for f in fields}
    # Fields covering at least half the span read it as blocks, in one call; the others gather their frames.
    blocked = [f.key for f in fields if first is not None and 2 * len(f.offsets) >= S]
    blocks = (src.gather_windows(first, S, [j for f in fields if f.key in blocked for j in f.leaves])
              if first is not None and blocked else [])
    it = iter(blocks)
    for f in fields:
        c = cols[f.key]
        ok = valid[:, c]
        src_rows = (edge if f.pad == "edge" else rows)[:, c]
        if f.key in blocked:
            assert first is not None
            # Wholly valid spans whose frames are the whole span, in order: the blocks as read.
            whole = all_valid and len(c) == S and bool((c == np.arange(S)).all())
            arrays = _from_blocks([next(it) for _ in f.leaves], src_rows, first, whole)
        else:
            arrays = [a.reshape(B, len(c), *a.shape[1:]) for a in src.read_rows(src_rows.ravel(), f.leaves)]
        if f.pad == "zero" and not ok.all():
            for a in arrays:
                a[~ok] = 0
        steps[f.key], masks[f.key] = arrays, np.ascontiguousarray(ok)
    episodes = src.read_episode_rows(anchors, src.episode_leaves) if src.episode_leaves else []
    return FieldWindows(fields, steps, episodes, masks)


def _from_blocks(blocks: list[np.ndarray], src_rows: np.ndarray, first: np.ndarray, whole: bool) -> list[np.ndarray]:
    """A field's frames (B, T, ...) from its leaves' blocks (B, S, ...) read from ``first``: the
    blocks themselves when ``whole`` (the field's frames are the whole span), else the columns of
    ``src_rows`` (B, T) int64."""
    if whole:
        return blocks
    b = np.arange(len(first))[:, None]
    return [a[b, src_rows - first[:, None]] for a in blocks]


def _span_rows(src: EpisodeSource, anchors: np.ndarray, span: _Span,
               all_valid: bool) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """``(first, rows, valid)``: each anchor's span as logical rows (B, S) int64 and whether each
    lies in the anchor's episode (B, S) bool; ``first`` (B,) int64 is each block's first row when
    the span is a block of consecutive rows (a dense span no longer than the table), else None."""
    U = span.offsets
    B, S = len(anchors), len(U)
    if not (span.dense and S <= src.count):
        rows, valid = window_rows(anchors, U, 0, src.count, src.step_ids)
        return None, rows, valid
    pos = np.broadcast_to(np.arange(S), (B, S))
    if all_valid:
        first, valid = anchors + U[0], np.ones((B, S), bool)
    else:
        fr = span_frames(src, anchors, U, True)
        assert fr.first is not None
        first, valid = fr.first, fr.valid
        if fr.check.size:
            pos = pos.copy()
            pos[fr.check] = fr.rows
    return first, first[:, None] + pos, valid


def _edge_rows(src: EpisodeSource, anchors: np.ndarray, fields: list[FieldWindow], span: _Span, rows: np.ndarray,
               valid: np.ndarray) -> np.ndarray:
    """The rows ``edge`` padding reads (B, S) int64: each invalid frame replaced by its episode's
    nearest end (``rows`` itself when no field pads with ``edge``)."""
    if not any(f.pad == "edge" for f in fields):
        return rows
    U = span.offsets
    if span.dense:
        return pad_sources(rows, valid, U, anchors)
    # A sparse span does not hold the episode's ends: ask the run index for the anchor's run.
    run_first, run_len, _ = src.runs()
    k = np.searchsorted(run_first, anchors, side="right") - 1
    ends = np.where(U[None, :] < 0, run_first[k][:, None], (run_first[k] + run_len[k] - 1)[:, None])
    return np.where(valid, rows, ends)


def get_field_windows(src: EpisodeSource, step_space: gymnasium.Space[Any], idx: Any, offsets: Mapping[Any, Any],
                      pad: str | Mapping[Any, Any] = "edge") -> FieldWindows:
    """Frames ``idx[b] + offsets[key][t]`` of each named field (logical rows); see
    :meth:`TrajectoryReplayBuffer.get_sequences <trajstore.TrajectoryReplayBuffer.get_sequences>`."""
    fields = resolve_fields(step_space, src.step_leaves, offsets, pad)
    span = _span(fields)
    src.sync()

    def read() -> FieldWindows:
        anchors = np.atleast_1d(np.asarray(normalize_index(idx, src.count), dtype=np.int64))
        return _read(src, anchors, fields, span)

    return read_consistent(src, read)  # a reader retries until no commit happened while it read


def sample_field_windows(src: EpisodeSource, step_space: gymnasium.Space[Any], batch_size: int,
                         offsets: Mapping[Any, Any], rng: np.random.Generator, pad: str | Mapping[Any, Any],
                         within_episode: bool, allow_pad: bool = False) -> FieldWindows:
    """Per-field windows around ``batch_size`` anchor rows drawn uniformly.

    ``within_episode=True`` draws only anchors whose whole span lies inside one run of the
    anchor's episode (so every field's every frame is valid), by rejection as
    :func:`~trajstore.sampling.sequences.sample_sequences` does; with ``allow_pad=True`` every row
    is an anchor and frames outside its episode are padded.
    """
    fields = resolve_fields(step_space, src.step_leaves, offsets, pad)
    span = _span(fields)
    strict = within_episode and not allow_pad

    def draw(k: int) -> np.ndarray:
        if not strict:
            return rng.integers(0, src.count, size=k)
        try:
            return draw_anchors(src, k, span.offsets, rng, True)
        except BadOptionError:
            lo, hi = int(span.offsets[0]), int(span.offsets[-1])
            raise BadOptionError(f"no anchor's window (offsets {lo} .. {hi} of the anchor, all fields together) lies "
                                 "inside one episode (or almost none do): use fewer offsets, allow_pad=True or "
                                 "within_episode=False") from None

    def read(anchors: np.ndarray) -> FieldWindows:
        # Drawn anchors' spans lay in one run; checked again at every read (O(B), no id read): after
        # a live ring's eviction, sample_consistent keeps an anchor that survived, but the rows of
        # its negative offsets may be gone (sample_sequences' windows start at the anchor).
        block = strict and span.dense and len(span.offsets) <= src.count
        all_valid = block and bool(block_ok(src, anchors, span.offsets)[1].all())
        return _read(src, anchors, fields, span, all_valid=all_valid)

    # Frames before the anchor are read too: the eviction check follows the earliest of them.
    return sample_consistent(src, draw, read, batch_size, _put_field_windows, reach_back=-int(span.offsets[0]))


def _put_field_windows(out: FieldWindows, positions: np.ndarray, part: FieldWindows) -> None:
    """The ``put`` of :func:`~trajstore.sampling.source.sample_consistent` for
    :class:`FieldWindows`: ``part``'s windows into rows ``positions`` of ``out``."""
    for key, arrays in out.steps.items():
        put_rows(arrays, positions, part.steps[key])
        out.valid[key][positions] = part.valid[key]
    put_rows(out.episodes, positions, part.episodes)
