"""Resumable order for the batch samplers of trajstore.torch.

A sampler's batches depend only on ``(seed, epoch, rank)`` and their position in the epoch, so its
state is a handful of numbers: ``state_dict()`` saves them (JSON-able), ``load_state_dict()`` in
any process makes the next ``iter()`` yield exactly the batches that were still to come.  Batch
samplers run in the DataLoader's main process, so worker processes hold no position of their own;
but a DataLoader draws batches ahead of the loop (``prefetch_factor * num_workers``), so the
position to save is the number of batches the loop has *consumed*: ``state_dict(consumed=k)``.
"""

from __future__ import annotations

from typing import Any

from trajstore.errors import ResumeStateError

__all__ = ["ResumableOrder"]


class ResumableOrder:
    """Mixin: ``state_dict`` / ``load_state_dict`` for a sampler with ``seed``, ``epoch``, ``rank``,
    ``num_replicas`` whose ``__iter__`` starts at :meth:`_take_start` and counts :meth:`_advance`."""

    seed: int
    epoch: int
    rank: int
    num_replicas: int
    _position = 0
    _start = 0

    def fingerprint(self) -> dict[str, Any]:
        """What must be equal for a saved position to mean the same batches (JSON-able)."""
        raise NotImplementedError

    def _take_start(self) -> int:
        """The position the iterator starting now begins at (once: the next starts at 0)."""
        start, self._start = self._start, 0
        self._position = start
        return start

    def _advance(self) -> None:
        self._position += 1

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The sampler's position: ``consumed`` batches into epoch ``epoch`` (default: the batches
        its current iterator has yielded; pass the loop's count when a DataLoader reads ahead)."""
        return {"sampler": type(self).__name__, "seed": self.seed, "epoch": self.epoch, "rank": self.rank,
                "num_replicas": self.num_replicas, "position": self._position if consumed is None else int(consumed),
                "fingerprint": self.fingerprint()}

    def _check_fingerprint(self, saved: dict[str, Any]) -> list[str]:
        mine = self.fingerprint()
        return [f"{k}: saved {saved.get(k)!r}, this sampler {v!r}" for k, v in mine.items() if saved.get(k) != v]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` (from :meth:`state_dict`) left off: the next ``iter()`` yields the
        rest of its epoch.  ``ResumeStateError`` names every field that is not this sampler's."""
        diff = [f"{k}: saved {state.get(k)!r}, this sampler {v!r}"
                for k, v in (("sampler", type(self).__name__), ("seed", self.seed), ("rank", self.rank),
                             ("num_replicas", self.num_replicas)) if state.get(k) != v]
        diff += self._check_fingerprint(dict(state.get("fingerprint") or {}))
        position = state.get("position")
        if not isinstance(position, int) or position < 0:
            diff.append(f"position: saved {position!r}, expected an int >= 0")
        if diff:
            raise ResumeStateError("the saved sampler state is not this sampler's: " + "; ".join(diff))
        self.epoch = int(state["epoch"])
        self._start = int(position)  # type: ignore[arg-type]
