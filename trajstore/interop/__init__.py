"""Import and export other formats (issue 14).

- :func:`import_d4rl` / :func:`export_d4rl`: D4RL's flat HDF5 files (needs h5py).

Imports write new trajectory stores with the recorders' schema (:mod:`trajstore.recording`), so
``trajstore episodes``, ``SequenceDataset`` and the exports work on any imported store.  Every
import and export streams blocks of about 8 MiB, builds its destination under a temporary name,
verifies it and renames it into place; bad input is refused before anything is written.
docs/interop.md describes each mapping and what it loses.
"""

from __future__ import annotations

from trajstore.interop.d4rl import export_d4rl, import_d4rl

__all__ = ["import_d4rl", "export_d4rl"]
