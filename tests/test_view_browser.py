"""``trajstore view`` in a real browser (issue 34): Debian's headless chromium driven by playwright.

One browser for the module; each test opens its own page on its own server.  Screenshots go to the
test's temp folder.  No wall-clock bound is asserted: waits are generous and only fail a page that
never shows what it should.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from _view_stores import append_episode, frames_of, image_store, serving, video_store

from trajstore import TrajectoryReplayBuffer
from trajstore.demo import record_demo

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
WAIT_MS = 30_000  # generous: the machine may be loaded; a page that works shows things in well under a second

#: The pixels of an <img> as the browser decoded them: (H * W * 4) RGBA values.
PIXELS = """(img) => { const c = document.createElement('canvas'); c.width = img.naturalWidth; c.height = img.naturalHeight;
  const x = c.getContext('2d'); x.drawImage(img, 0, 0); return Array.from(x.getImageData(0, 0, c.width, c.height).data); }"""
#: Whether a uPlot canvas has drawn anything (a non-transparent pixel).
DRAWN = """(c) => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  for (let i = 3; i < d.length; i += 4) if (d[i] !== 0) return true; return false; }"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch_persistent_context(str(tmp_path_factory.mktemp("chromium-profile")),
                                                 executable_path=CHROMIUM, headless=True, args=ARGS,
                                                 viewport={"width": 1100, "height": 900},
                                                 bypass_csp=True)  # the page's CSP forbids eval; playwright's waits use it
        try:
            yield b
        finally:
            b.close()


def _frame_pixels(page, field: str, step: int) -> np.ndarray:
    img = page.locator(f'#frames img[data-field="{field}"]')
    page.wait_for_function(f"""() => {{ const i = document.querySelector('#frames img[data-field="{field}"]');
        return i && i.complete && i.naturalWidth > 0 && i.dataset.step === '{step}'; }}""", timeout=WAIT_MS)
    rgba = np.asarray(img.evaluate(PIXELS), np.uint8)
    return rgba.reshape(-1, 4)


def test_cartpole_store_table_sort_and_episode_plots(browser, tmp_path):
    path = record_demo(str(tmp_path / "cartpole"), episodes=6)
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    with serving(path) as s:
        page.goto(s.url)
        page.wait_for_function("document.getElementById('episode-count').textContent === '6 episodes'", timeout=WAIT_MS)
        assert page.locator("#fields-table").inner_text().count("step_data/") == 6
        assert page.locator("#store-path").inner_text() == path and page.locator("#error").is_hidden()
        page.locator('#episodes-table th[data-col="return"]').click()
        page.wait_for_selector('#episodes-table th.sorted[data-col="return"]', timeout=WAIT_MS)
        cols = page.locator("#episodes-table th").all_inner_texts()
        returns = [float(r.locator("td").nth(cols.index("return")).inner_text())
                   for r in page.locator("#episodes-table tbody tr").all()]
        assert len(returns) == 6 and returns == sorted(returns, reverse=True)
        page.screenshot(path=str(tmp_path / "cartpole-list.png"))
        page.locator("#episodes-table tbody tr").first.locator("a.ep-link").click()
        page.wait_for_selector("#episode-view:not([hidden]) .plot canvas", timeout=WAIT_MS)
        canvases = page.locator("#plots .plot canvas").all()
        assert len(canvases) == 6 and all(c.evaluate(DRAWN) for c in canvases)  # obs, next_obs, action, reward, flags
        assert page.locator("#frames img").count() == 0
        page.locator("#scrubber").focus()
        page.keyboard.press("ArrowRight")
        page.wait_for_function("document.getElementById('step-label').textContent.startsWith('step 1 /')",
                               timeout=WAIT_MS)
        box = page.locator("#plots .plot .u-over").first.bounding_box()
        page.mouse.click(box["x"] + box["width"] - 2, box["y"] + box["height"] / 2)  # a click on a plot scrubs
        page.wait_for_function("""() => { const m = document.getElementById('step-label').textContent.match(/step (\\d+) \\/ (\\d+)/);
            return m && m[1] === m[2]; }""", timeout=WAIT_MS)
        page.screenshot(path=str(tmp_path / "cartpole-episode.png"))
    page.close()
    assert not errors


def test_image_store_frames_are_the_stored_pixels_and_follow_the_scrubber(browser, tmp_path):
    path = image_store(tmp_path / "images", episodes=3, length=12)
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    with serving(path) as s:
        page.goto(s.url)
        page.wait_for_function("document.getElementById('episode-count').textContent === '3 episodes'", timeout=WAIT_MS)
        page.locator('#episodes-table th[data-col="return"]').click()
        page.wait_for_selector('#episodes-table th.sorted[data-col="return"]', timeout=WAIT_MS)
        first = page.locator("#episodes-table tbody tr").first.locator("a.ep-link")
        assert first.inner_text() == "2"  # the largest return
        first.click()
        page.wait_for_selector("#episode-view:not([hidden]) .plot canvas", timeout=WAIT_MS)
        want = frames_of(2, 12)
        got = _frame_pixels(page, "step_data/cam", 0)
        np.testing.assert_array_equal(got[:, :3].reshape(want[0].shape), want[0])
        grey = _frame_pixels(page, "step_data/grey", 0)
        assert (grey[:, :3] == 20).all()
        page.locator("#scrubber").focus()
        for _ in range(5):
            page.keyboard.press("ArrowRight")
        got = _frame_pixels(page, "step_data/cam", 5)
        np.testing.assert_array_equal(got[:, :3].reshape(want[5].shape), want[5])
        assert page.locator("#step-label").inner_text() == "step 5 / 11"
        page.screenshot(path=str(tmp_path / "images-episode.png"))
    page.close()
    assert not errors


def test_live_page_shows_appended_episodes_and_drops_evicted_ones(browser, tmp_path):
    path = image_store(tmp_path / "live", episodes=3, length=4, capacity=12, robot=True)  # a ring of 3 episodes
    page = browser.new_page()
    with serving(path) as s:
        page.goto(s.url + "?poll=250")
        page.wait_for_function("document.getElementById('episode-count').textContent === '3 episodes'", timeout=WAIT_MS)
        ids = "() => Array.from(document.querySelectorAll('#episodes-table a.ep-link')).map(a => a.textContent).join(',')"
        assert page.evaluate(ids) == "0,1,2"
        buf = TrajectoryReplayBuffer.load_from(path)
        done = threading.Event()
        try:
            for e in (3, 4):
                append_episode(buf, e, 4)
            done.set()
            page.wait_for_function(f"({ids})() === '2,3,4'", timeout=WAIT_MS)
        finally:
            buf.close()
        assert done.is_set()
        tasks = "() => Array.from(document.querySelectorAll('#episodes-table tbody tr')).map(r => r.lastChild.textContent).join(',')"
        assert page.evaluate(tasks) == "stack cubes,,"  # the evicted episodes' tasks went with them
        page.screenshot(path=str(tmp_path / "live.png"))
    page.close()


def test_a_damaged_store_shows_the_clis_message_on_the_page(browser, tmp_path, capsys):
    from trajstore.cli import main

    path = image_store(tmp_path / "bad", episodes=1, length=4)
    (tmp_path / "bad" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    assert main(["info", path]) == 1
    cli = capsys.readouterr().err.strip().split("error: ", 1)[1]
    page = browser.new_page()
    with serving(path) as s:
        page.goto(s.url)
        page.wait_for_selector("#error:not([hidden])", timeout=WAIT_MS)
        assert page.locator("#error").inner_text() == cli
    page.close()


def test_robot_store_tasks_stats_and_time_axis(browser, tmp_path):
    path = image_store(tmp_path / "robot", episodes=3, length=6, robot=True)
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    with serving(path) as s:
        page.goto(s.url)
        page.wait_for_selector("#stats summary", timeout=WAIT_MS)
        assert not page.locator("#stats-table").is_visible()  # 23 rows (grey's first 16 channels): folded
        page.locator("#stats summary").click()
        page.wait_for_selector("#stats-table", timeout=WAIT_MS)
        assert "10 fps" in page.locator("#overview dl").inner_text()
        assert page.locator("#tasks-table tr").all_inner_texts()[1:] == ["0\tpick cube\t1", "1\tplace cube\t1",
                                                                        "2\tstack cubes\t1"]
        stats = page.locator("#stats-table").inner_text()
        assert "action[1]" in stats and "cam[2]" in stats and "reward" in stats and "grey: 240 more channels" in stats
        page.fill("#where", "task == 'place cube'")
        page.locator("#apply").click()
        page.wait_for_function("document.getElementById('matched').textContent === '1 match'", timeout=WAIT_MS)
        row = page.locator("#episodes-table tbody tr").first
        assert row.locator("a.ep-link").inner_text() == "1" and row.locator("td").last.inner_text() == "place cube"
        row.locator("a.ep-link").click()
        page.wait_for_selector("#episode-view:not([hidden]) .plot canvas", timeout=WAIT_MS)
        assert page.locator("#step-label").inner_text() == "step 0 / 5, t = 0 s"
        page.locator("#x-axis").click()
        page.wait_for_function("document.getElementById('x-axis').textContent === 'x: time (s)'", timeout=WAIT_MS)
        box = page.locator("#plots .plot .u-over").first.bounding_box()
        page.mouse.click(box["x"] + box["width"] - 2, box["y"] + box["height"] / 2)  # the last step's time
        page.wait_for_function("document.getElementById('step-label').textContent === 'step 5 / 5, t = 0.5 s'",
                               timeout=WAIT_MS)
        assert all(c.evaluate(DRAWN) for c in page.locator("#plots .plot canvas").all())
        page.screenshot(path=str(tmp_path / "robot-episode.png"))
    page.close()
    assert not errors


def test_video_field_frames_play_in_the_scrubber(browser, tmp_path):
    path, _ = video_store(tmp_path / "video", episodes=2, length=8)
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as buf:
        want = buf[8:16]["step_data"]["cam"]  # episode 1, as the buffer decodes it
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    with serving(path) as s:
        page.goto(s.url + "#/episode/0/1")
        page.wait_for_selector("#episode-view:not([hidden]) .plot canvas", timeout=WAIT_MS)
        got = _frame_pixels(page, "step_data/cam", 0)
        np.testing.assert_array_equal(got[:, :3].reshape(want[0].shape), want[0])
        page.locator("#scrubber").focus()
        for _ in range(6):
            page.keyboard.press("ArrowRight")
        got = _frame_pixels(page, "step_data/cam", 6)
        np.testing.assert_array_equal(got[:, :3].reshape(want[6].shape), want[6])
        page.screenshot(path=str(tmp_path / "video-episode.png"))
    page.close()
    assert not errors
