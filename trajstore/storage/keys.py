"""The names of trajstore's own files in a store, and the format version the commit record carries.

Everything else in a store is zarr's (``zarr.json`` files and chunk keys); see docs/format.md.
"""

__all__ = ["DATASET_KEY", "FORMAT_VERSION", "HEAD_KEY", "LOCK_KEY", "MPLOCK_KEY", "PREV_KEY", "PRIORITIES_DIR",
           "ROBOT_KEY", "RUNS_KEY", "STATS_KEY", "CHECKSUMS_KEY"]

#: The commit record: which rows of every table are committed (see :mod:`trajstore.storage.head`).
HEAD_KEY = "trajstore.head.json"
#: A copy of the last commit record that a local writer keeps (recovery of a damaged head).
PREV_KEY = "trajstore.head.prev.json"
#: The writer lock file of a local store ("open pid=..." while a single writer holds it, else "closed").
LOCK_KEY = "trajstore.lock"
#: The op lock that multiprocessing writers take around each write.
MPLOCK_KEY = "trajstore.mplock"
#: The dataset description (:mod:`trajstore.metadata`).
DATASET_KEY = "trajstore.dataset.json"
#: The run index of a trajectory store's step ids, saved by a writer at close so readers need not
#: scan every id (:mod:`trajstore.storage.runs_file`).  A cache: absent, stale or damaged, it is ignored.
RUNS_KEY = "trajstore.runs"
#: Robot metadata: the store's frame rate and its task dictionary with each episode's task
#: (:mod:`trajstore.storage.robot_files`, docs/robot.md).  Replaced whole (temp file + rename).
ROBOT_KEY = "trajstore.robot.json"
#: Stored statistics per episode and field (:mod:`trajstore.storage.robot_files`): valid only under
#: the commit epoch it names; absent, stale or for other episodes, they are computed from the rows.
STATS_KEY = "trajstore.stats"
#: A store of its own inside a buffer's folder: the priorities a PrioritizedSampler keeps
#: (:mod:`trajstore.sampling.prioritized`).  Not part of the buffer's rows (a ``.zip`` leaves it out).
PRIORITIES_DIR = "trajstore.priorities"
#: The content checksums of a pushed version (:mod:`trajstore.maintenance.push_pull`): the SHA-256 of
#: every key's bytes and of the commit record pushed with them, checked by a pull.
CHECKSUMS_KEY = "trajstore.checksums.json"
#: Version of the format (root schema and commit record); a newer one is refused with
#: FormatVersionError.  2: an unbounded table's zarr ``shape`` is its committed rows (published around
#: each commit; the allocation lives in the commit record only) and arrays carry ``dimension_names``.
#: Version 1 stores open and are written as ever; their commit records say 2 once this version
#: writes them, so an older trajstore refuses them by version instead of finding a shape it
#: cannot explain.
FORMAT_VERSION = 2
