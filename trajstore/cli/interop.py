"""``trajstore import FORMAT SRC DST`` and ``trajstore export FORMAT SRC DST``: other formats in
and out (:mod:`trajstore.interop`).

Each streams blocks of about 8 MiB, writes its destination under a temporary name, verifies it
and renames it into place (nothing is left behind on error).
"""

from __future__ import annotations

import argparse
from typing import Any

from trajstore.cli._common import CLIError, print_json

__all__ = ["register", "IMPORTS", "EXPORTS"]

#: Formats ``trajstore import`` reads (name -> help).
IMPORTS = {"d4rl": "D4RL's flat HDF5 file (observations, actions, rewards, terminals, timeouts, ...)",
           "diffusion-policy": "Diffusion Policy's zarr store (data/<key>, meta/episode_ends; format 2 or 3, "
                               "folder or .zarr.zip)",
           "robomimic": "robomimic's HDF5 file (data/demo_<i>/{obs/*, next_obs/*, actions, rewards, dones}, mask/*)",
           "minari": "a Minari dataset: its id (under MINARI_DATASETS_PATH) or its folder",
           "lerobot": "a LeRobot dataset folder (v3.0 or v2.1: meta/info.json, data/, videos/; cameras kept as "
                      "video, --video CODEC to store decoded frames)",
           "sb3": "a stable-baselines3 replay buffer saved by model.save_replay_buffer (a pickle: needs --trust)"}
#: Formats ``trajstore export`` writes (name -> help).
EXPORTS = {"d4rl": "D4RL's flat HDF5 file",
           "minari": "a Minari dataset: DST is its dataset id (namespace/name-v0), written under --datasets-path "
                     "or MINARI_DATASETS_PATH",
           "diffusion-policy": "Diffusion Policy's zarr store (--zarr-format 2 or 3; a name ending in .zip "
                               "writes a zip)",
           "lerobot": "a LeRobot v3.0 dataset folder (--fps unless the store declares one; --video av1|h264)"}


def _bar(args: argparse.Namespace) -> bool | None:
    return False if args.json else None  # a bar only on a terminal, never around JSON


def _cmd_import(args: argparse.Namespace) -> int:
    convert: Any
    if (args.video is not None or args.save_stats or args.link) and args.format != "lerobot":
        raise CLIError("--video, --save-stats and --link apply to lerobot imports only", code=2)
    if args.format == "d4rl":
        from trajstore.interop.d4rl import d4rl_to_store as convert
    elif args.format == "robomimic":
        from trajstore.interop.robomimic import robomimic_to_store as convert
    elif args.format == "minari":
        from trajstore.interop.minari import minari_to_store as convert
    elif args.format == "lerobot":
        from trajstore.interop.lerobot import import_lerobot

        return _report_import(args, import_lerobot(args.src, args.dst, video=args.video or "keep",
                                                   save_stats=args.save_stats, tqdm=_bar(args),
                                                   overwrite=args.overwrite, link=args.link))
    elif args.format == "sb3":
        from trajstore.interop.sb3_pickle import sb3_replay_buffer_to_store

        out = sb3_replay_buffer_to_store(args.src, args.dst, trust=args.trust, tqdm=_bar(args),
                                         overwrite=args.overwrite, stats=args.stats)
        return _report_import(args, out)
    else:
        from trajstore.interop.diffusion_policy import diffusion_policy_to_store as convert
    if args.trust:
        raise CLIError("--trust applies to sb3 imports only (the other formats are never unpickled)", code=2)
    return _report_import(args, convert(args.src, args.dst, tqdm=_bar(args), overwrite=args.overwrite,
                                        stats=args.stats))


def _report_import(args: argparse.Namespace, out: dict[str, Any]) -> int:
    out = {"format": args.format, **out}
    if args.json:
        print_json(out)
    else:
        extra = (f"; task {out['task']!r}" if out.get("task") else "") + ("; statistics stored" if out.get("stats") else "")
        if "linked" in out:
            extra += f"; {sum(out['linked'].values())} camera episodes linked, {out['link_fallbacks']} MP4s copied"
        print(f"imported {out['source']} ({args.format}): {out['steps']} steps, {out['episodes']} episodes -> "
              f"{out['destination']}{extra}; verified")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    if args.zarr_format is not None and args.format != "diffusion-policy":
        raise CLIError("--zarr-format applies to diffusion-policy exports only", code=2)
    if args.datasets_path is not None and args.format != "minari":
        raise CLIError("--datasets-path applies to minari exports only", code=2)
    if (args.fps is not None or args.video is not None) and args.format != "lerobot":
        raise CLIError("--fps and --video apply to lerobot exports only", code=2)
    if args.format == "lerobot":
        from trajstore.interop.lerobot_export import export_lerobot

        out = export_lerobot(args.src, args.dst, fps=args.fps, video=args.video or "av1", overwrite=args.overwrite)
    elif args.format == "d4rl":
        from trajstore.interop.d4rl import export_d4rl

        out = export_d4rl(args.src, args.dst, tqdm=_bar(args), overwrite=args.overwrite)
    elif args.format == "minari":
        from trajstore.interop.minari import export_minari

        folder = export_minari(args.src, args.dst, datasets_path=args.datasets_path, tqdm=_bar(args),
                               overwrite=args.overwrite)
        out = {"source": args.src, "destination": folder, "dataset_id": args.dst, "verified": True}
        if args.json:
            print_json({"format": args.format, **out})
        else:
            print(f"exported {args.src} as Minari dataset {args.dst} -> {folder}; opened with minari and counted")
        return 0
    else:
        from trajstore.interop.diffusion_policy import export_diffusion_policy

        out = export_diffusion_policy(args.src, args.dst, zarr_format=args.zarr_format or 2, tqdm=_bar(args),
                                      overwrite=args.overwrite)
    out = {"format": args.format, **out}
    if args.json:
        print_json(out)
    else:
        print(f"exported {out['source']}: {out['steps']} steps, {out['episodes']} episodes -> {out['destination']} "
              f"({args.format}); read back and verified")
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``import`` and ``export`` to the subparsers ``sub``; ``common`` holds the options every
    command takes."""
    formats = "\n".join(f"  {k:18s}{v}" for k, v in IMPORTS.items())
    p = sub.add_parser("import", parents=[common], help="a new store from a file of another format (verified)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Write the data of SRC (a file of FORMAT) to a new trajectory store DST (a local "
                                   "folder) with the recorders' schema: step data obs, action, reward, terminated, "
                                   "truncated, next_obs, info/<key>; episode data seed, return, length.  DST is "
                                   "written under a temporary name, verified, then renamed; nothing is left behind "
                                   f"on error.  docs/interop.md describes each mapping.\n\nformats:\n{formats}")
    p.add_argument("format", choices=sorted(IMPORTS), metavar="FORMAT", help=f"one of {', '.join(sorted(IMPORTS))}")
    p.add_argument("src", metavar="SRC", help="the file to import")
    p.add_argument("dst", metavar="DST", help="the new store (a local folder)")
    p.add_argument("--trust", action="store_true",
                   help="sb3: unpickle SRC (unpickling runs code named in the file: only for files you trust)")
    p.add_argument("--video", default=None, metavar="CODEC",
                   help="lerobot: store the cameras' decoded frames with this compressor (png, jpeg:90, h264...) "
                        "instead of keeping the MP4s' packets")
    p.add_argument("--save-stats", action="store_true", help="lerobot: store every episode's statistics")
    p.add_argument("--link", action="store_true",
                   help="lerobot: hard-link each AV1 MP4 into the store and read its packets there instead of "
                        "copying them (same filesystem; editing a source MP4 in place then changes the store, "
                        "which `trajstore verify` reports; else copied)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store at DST")
    p.add_argument("--stats", action="store_true",
                   help="store every episode's statistics, computed at import (buf.stats(), docs/robot.md)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_cmd_import)

    formats = "\n".join(f"  {k:18s}{v}" for k, v in EXPORTS.items())
    p = sub.add_parser("export", parents=[common], help="write a store in another format (verified)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Write the trajectory store SRC (recorders' schema: obs, action, reward, "
                                   "terminated, truncated, next_obs?, info/*) as DST in FORMAT.  DST is written under "
                                   "a temporary name, read back and compared, then renamed.  docs/interop.md says "
                                   f"what each format keeps.\n\nformats:\n{formats}")
    p.add_argument("format", choices=sorted(EXPORTS), metavar="FORMAT", help=f"one of {', '.join(sorted(EXPORTS))}")
    p.add_argument("src", metavar="SRC", help="the store to export")
    p.add_argument("dst", metavar="DST", help="the file to write")
    p.add_argument("--datasets-path", default=None, metavar="DIR",
                   help="minari: root of the datasets folder (default MINARI_DATASETS_PATH or ~/.minari/datasets)")
    p.add_argument("--zarr-format", type=int, choices=(2, 3), default=None,
                   help="diffusion-policy: zarr format of DST (default 2, what Diffusion Policy's code reads)")
    p.add_argument("--fps", type=float, default=None, help="lerobot: frames per second (default: the store's)")
    p.add_argument("--video", default=None, choices=("av1", "h264"), help="lerobot: the cameras' codec (default av1)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file at DST")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_cmd_export)
