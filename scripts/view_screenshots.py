"""Refresh the screenshots of docs/view.md: ``trajstore view`` over a recorded CartPole store.

Records 8 CartPole episodes (random policy) into a trajectory store with a drawn camera frame per
step (the cart and pole drawn from the observation, PNG-coded), serves it with ``trajstore
view``'s server, drives Debian's headless chromium with playwright and writes
``docs/view-episodes.png`` (the overview and the episode table sorted by return) and
``docs/view-episode.png`` (the best episode, its plots, and its frame at a middle step).

Usage::

    python scripts/view_screenshots.py [--out DIR] [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Sequence

import gymnasium
import numpy as np
from gymnasium.spaces import Box, Dict, Discrete

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.cli.view import open_view  # noqa: E402

H, W = 60, 120
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


def draw(obs: np.ndarray) -> np.ndarray:
    """A (H, W, 3) uint8 picture of CartPole state ``obs`` (x, x_dot, theta, theta_dot)."""
    img = np.full((H, W, 3), 245, np.uint8)
    img[H - 12, :] = 120  # the track
    cx = int(np.clip(W / 2 + obs[0] / 2.4 * (W / 2 - 10), 8, W - 9))
    img[H - 17:H - 11, cx - 8:cx + 8] = (40, 70, 160)  # the cart
    t = np.linspace(0, 1, 60)
    px = (cx + np.sin(obs[2]) * 36 * t).astype(int)
    py = (H - 17 - np.cos(obs[2]) * 36 * t).astype(int)
    for dx in (-1, 0, 1):  # the pole, 3 pixels wide
        ok = (px + dx >= 0) & (px + dx < W) & (py >= 0) & (py < H)
        img[py[ok], px[ok] + dx] = (200, 90, 40)
    return img


def record(path: str, episodes: int = 8, seed: int = 0) -> str:
    """CartPole episodes with a drawn frame per step, into a new trajectory store at ``path``."""
    env = gymnasium.make("CartPole-v1")
    env.action_space.seed(seed)
    space = Dict({"obs": env.observation_space, "action": Discrete(2), "reward": Box(0, 1, (), np.float32),
                  "terminated": Discrete(2), "truncated": Discrete(2), "camera": Box(0, 255, (H, W, 3), np.uint8)})
    buf = TrajectoryReplayBuffer.create(space, cache_path=path, compressor={"camera": "png"})
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        done = False
        while not done:
            action = int(env.action_space.sample())
            nxt, reward, term, trunc, _ = env.step(action)
            buf.append({"obs": obs, "action": action, "reward": np.float32(reward), "terminated": int(term),
                        "truncated": int(trunc), "camera": draw(obs)})
            obs, done = nxt, term or trunc
        buf.mark_episode_end()
    buf.close()
    env.close()
    return path


def _shrink(path: Path) -> None:
    """Re-save a screenshot as a 128-colour palette PNG (a third of the bytes; text stays sharp)."""
    from PIL import Image  # matplotlib's dependency: installed with the test extra

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def main(argv: Sequence[str] | None = None) -> list[Path]:
    """Write the screenshots; returns their paths."""
    from playwright.sync_api import sync_playwright

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs"), help="folder for the PNGs (default docs/)")
    ap.add_argument("--chromium", default="/usr/bin/chromium", help="the chromium executable")
    args = ap.parse_args(argv)
    out = Path(args.out)
    shots = [out / "view-episodes.png", out / "view-episode.png"]
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # the page shows the path it was given: "cartpole", as a user would type it
        server = open_view(record("cartpole"))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            with sync_playwright() as p:
                ctx = p.chromium.launch_persistent_context(str(Path(tmp) / "profile"), executable_path=args.chromium,
                                                           headless=True, args=ARGS, bypass_csp=True,
                                                           viewport={"width": 960, "height": 720})
                page = ctx.new_page()
                page.goto(server.url)
                page.wait_for_function("document.getElementById('episode-count').textContent === '8 episodes'")
                page.locator('#episodes-table th[data-col="return"]').click()
                page.wait_for_selector('#episodes-table th.sorted[data-col="return"]')
                page.screenshot(path=str(shots[0]))
                page.locator("#episodes-table tbody tr").first.locator("a.ep-link").click()
                page.wait_for_selector("#episode-view:not([hidden]) .plot canvas")
                n = int(page.locator("#scrubber").get_attribute("max") or "0")
                page.locator("#scrubber").focus()
                for _ in range(n // 2):
                    page.keyboard.press("ArrowRight")
                page.wait_for_function(f"document.querySelector('#frames img').dataset.step === '{n // 2}'")
                page.screenshot(path=str(shots[1]), full_page=True)
                ctx.close()
        finally:
            server.shutdown()
            server.server_close()
            os.chdir(here)
    for s in shots:
        _shrink(s)
        print(f"wrote {s} ({s.stat().st_size / 1024:.0f} KiB)")
    return shots


if __name__ == "__main__":
    main()
