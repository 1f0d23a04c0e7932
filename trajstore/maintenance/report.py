"""What :func:`~trajstore.maintenance.verify.verify_store` reports: :class:`Fault` and
:class:`VerifyReport` (what ``trajstore verify`` prints, and what repair acts on)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Fault", "VerifyReport"]


@dataclass
class Fault:
    """One problem: ``kind`` (a short code), the ``key`` or array path, the ``table`` and logical
    ``rows`` ``[lo, hi)`` it damages (None when not about rows), and a one-line ``message``."""

    kind: str
    key: str
    message: str
    table: str | None = None
    rows: tuple[int, int] | None = None

    def to_json(self) -> dict[str, Any]:
        """The fault as a JSON object: ``kind``, ``key``, ``table``, ``rows`` (``[lo, hi]`` or
        null) and ``message``."""
        return {"kind": self.kind, "key": self.key, "table": self.table,
                "rows": list(self.rows) if self.rows else None, "message": self.message}


@dataclass
class VerifyReport:
    """What :func:`verify_store` found: the store is sound when :attr:`ok` (no fault).

    Attributes
    ----------
    url : str
        The store checked, as given.
    deep : bool
        Whether every committed chunk was also decoded.
    faults : list of Fault
        Damage: each names the key or array path and, for rows, the table and logical rows.
    notes : list of str
        Harmless findings, one line each (orphaned temp files, chunks beyond the committed rows,
        a pending rewrite, whether the previous commit record could replace the current one).
    checked : dict
        Counts: ``arrays``, ``chunks`` and ``decoded`` (what was checked), ``rows`` (committed
        rows of every table together) and ``table_rows`` (per table).
    removable : list of (str, str)
        ``(key, why)`` of the keys :func:`~trajstore.maintenance.repair.repair_store` may delete.
    """

    url: str
    deep: bool
    faults: list[Fault] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: ``arrays``, ``chunks``, ``decoded``: what was checked; ``rows``: committed rows of every table
    #: together; ``table_rows``: of each table (step rows and episode-data rows are different things)
    checked: dict[str, Any] = field(default_factory=lambda: {"arrays": 0, "chunks": 0, "decoded": 0, "rows": 0,
                                                             "table_rows": {}})
    #: keys that repair may delete (temp files, unreferenced staging, uncommitted chunks)
    removable: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether no fault was found (notes do not count)."""
        return not self.faults

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON object (what ``trajstore verify --json`` prints).

        Returns
        -------
        dict
            ``path``, ``ok``, ``deep``, ``faults`` (:meth:`Fault.to_json` each), ``notes``,
            ``checked`` and ``removable`` (``{"key", "why"}`` objects).
        """
        return {"path": self.url, "ok": self.ok, "deep": self.deep, "faults": [f.to_json() for f in self.faults],
                "notes": self.notes, "checked": self.checked,
                "removable": [{"key": k, "why": w} for k, w in self.removable]}
