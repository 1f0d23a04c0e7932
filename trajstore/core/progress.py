"""Progress bars: the one helper every long operation (copies, imports, exports, combine, verify)
and the CLI use (:func:`progress_bar`)."""

from __future__ import annotations

import sys
from typing import Any

from trajstore._optional import missing

__all__ = ["NoBar", "progress_bar"]


class NoBar:
    """A bar that shows nothing (what :func:`progress_bar` returns when no bar is shown)."""

    def update(self, n: int = 1) -> None:
        """Count ``n`` more done (ignored)."""

    def close(self) -> None:
        """End the bar (nothing to end)."""


def progress_bar(total: int, desc: str, enabled: bool | None = None, unit: str = "file", *,
                 leave: bool = True) -> Any:
    """A tqdm bar of ``total`` ``unit`` labelled ``desc``, with ``update(n)`` and ``close()``.

    ``enabled``: True shows one (tqdm missing: :class:`~trajstore.errors.MissingDependencyError`
    naming the extra), False never, None only when stderr is a terminal and tqdm is installed
    (otherwise a silent :class:`NoBar`).  ``leave=False`` clears the bar when it closes (the CLI's).
    """
    if enabled is False or (enabled is None and not sys.stderr.isatty()):
        return NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if enabled:
            raise missing("tqdm", "progress bars") from None
        return NoBar()
    return tqdm(total=total, desc=desc, unit=unit, leave=leave)
