"""Import and export other formats (issue 14).

- :func:`import_d4rl` / :func:`export_d4rl`: D4RL's flat HDF5 files (needs h5py).
- :func:`import_diffusion_policy` / :func:`export_diffusion_policy`: Diffusion Policy's zarr
  replay buffers (format 2 or 3, folders or ``.zarr.zip``); :func:`open_diffusion_policy` opens
  one read-only in place, without a copy, as a :class:`~trajstore.TrajectoryReplayBuffer`.
- :func:`import_minari` / :func:`export_minari`: Minari datasets (needs minari).
- :func:`import_robomimic`: robomimic's HDF5 datasets (``data/demo_<i>``, ``mask/*``; needs h5py).
- :func:`import_lerobot` / :func:`export_lerobot`: LeRobot datasets (v3.0 in and out, v2.1 in;
  cameras kept as video); :func:`open_lerobot` opens one read-only in place (needs pyarrow, PyAV).
- :func:`import_sb3_replay_buffer`: stable-baselines3's ``save_replay_buffer`` pickles, only with
  ``trust=True`` (the one place trajstore unpickles).

Imports write new trajectory stores with the recorders' schema (:mod:`trajstore.recording`), so
``trajstore episodes``, ``SequenceDataset`` and the exports work on any imported store.  Every
import and export streams blocks of about 8 MiB, builds its destination under a temporary name,
verifies it and renames it into place; bad input is refused before anything is written.
docs/interop.md describes each mapping and what it loses.
"""

from __future__ import annotations

from trajstore.interop.d4rl import export_d4rl, import_d4rl
from trajstore.interop.diffusion_policy import export_diffusion_policy, import_diffusion_policy
from trajstore.interop.dp_open import DiffusionPolicyBuffer, open_diffusion_policy
from trajstore.interop.lerobot import import_lerobot
from trajstore.interop.lerobot_export import export_lerobot
from trajstore.interop.lerobot_open import LeRobotBuffer, open_lerobot
from trajstore.interop.minari import export_minari, import_minari
from trajstore.interop.robomimic import import_robomimic
from trajstore.interop.sb3_pickle import import_sb3_replay_buffer

__all__ = ["import_d4rl", "export_d4rl", "import_diffusion_policy", "export_diffusion_policy", "import_robomimic",
           "import_sb3_replay_buffer", "import_minari", "export_minari",
           "open_diffusion_policy", "DiffusionPolicyBuffer", "import_lerobot", "export_lerobot", "open_lerobot",
           "LeRobotBuffer"]
