"""Image fields: per-frame image codecs and the threads that decode them.

Importing this module registers the zarr v3 codec ``"trajstore.image"`` (importing trajstore's
storage does too; so does the ``zarr.codecs`` entry point of the installed package), which is
what a plain zarr-python reader needs to open an image field::

    import trajstore.images  # registers the codec
    frames = zarr.open_array("store/step_data/obs", mode="r")[:16]

- :class:`ImageCodec`: a codec object for ``compressor=`` (e.g. ``ImageCodec("webp", 90)``, or
  ``ImageCodec("png", planes=None)`` to keep an ``(H, W, 4)`` frame as RGBA instead of 4 grey planes);
  strings such as ``"jpeg:90"`` name the same codecs.
- :class:`VideoCodec`: a step field kept as one H.264 / AV1 stream per episode (``VideoCodec("h264",
  crf=23, gop=10)``; strings ``"h264:crf=23:g=10"``, ``"av1"``, ``"lerobot"`` name the same), through
  PyAV (the ``video`` extra): RGB ``(H, W, 3)``, grey ``(H, W)`` / ``(H, W, 1)`` and stacks of grey planes
  ``(84, 84, 4)`` / ``(4, 84, 84)`` (coded as one grey picture); docs/format.md "Video fields".
- :func:`set_jpeg_decoder`: the library that decodes JPEG frames (simplejpeg where installed, else
  imagecodecs; both libjpeg-turbo, the same pixels; ``JPEG_DECODERS``).
- :func:`set_decode_threads` / :func:`decode_threads`: the bounded pool that decodes a batch's frames
  (image frames and video GOPs); :func:`share_decode_threads`: a process's share of the CPUs by
  default (what each DataLoader worker of ``trajstore.torch`` sets: ``max(1, cpus // num_workers)``).
- :func:`set_batch_recycling` / :func:`batch_recycling` / :func:`release_recycled_batches`: large
  arrays that reads return (1 MiB or more: batches of frames, of any field) reuse the memory of
  batches returned earlier that nothing references any more (a fresh large array costs page
  faults and the kernel zeroing its pages on every call).  On by default (CPython); a batch, a
  view of it or a tensor sharing its memory is never reused while referenced.  The recycler holds
  at most a few arrays and ``min(1 GiB, RAM / 8)`` bytes; release them to return that memory
  (trajstore.storage.fields.recycler, docs/performance-notes.md).
"""

from trajstore.storage.fields.image import decode_threads, set_decode_threads, share_decode_threads
from trajstore.storage.fields.image_codecs import CODEC_NAME, FORMATS, JPEG_DECODERS, ImageCodec, set_jpeg_decoder
from trajstore.storage.fields.recycler import batch_recycling, release_recycled_batches, set_batch_recycling
from trajstore.storage.fields.video_codec import VIDEO_CODECS, VideoCodec

__all__ = ["CODEC_NAME", "FORMATS", "JPEG_DECODERS", "VIDEO_CODECS", "ImageCodec", "VideoCodec", "batch_recycling",
           "decode_threads", "release_recycled_batches", "set_batch_recycling", "set_decode_threads", "set_jpeg_decoder",
           "share_decode_threads"]
