// trajstore view: the page.  Everything the store says is put into the page as text
// (textContent), never as HTML.  Routes: #/ (overview and episodes), #/episode/PART/ID.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const params = new URLSearchParams(location.search);
  const POLL_MS = Math.max(200, Number(params.get("poll")) || 1000);
  const PAGE = 50;
  const state = { part: 0, parts: [], sort: "", desc: false, offset: 0, where: "", generation: null,
                  episode: null, step: 0, plots: [], playing: null, xTime: false, statsOpen: null };

  async function api(what, q) {
    const url = "/api/" + what + "?" + new URLSearchParams(Object.assign(what === "parts" ? {} : { part: state.part }, q || {}));
    const r = await fetch(url, { cache: "no-store" });
    const body = await r.json();
    if (!r.ok) { const e = new Error(body.error || r.statusText); e.status = r.status; throw e; }
    return body;
  }
  function showError(e) { const el = $("error"); el.textContent = e ? String(e.message || e) : ""; el.hidden = !e; }
  function el(tag, text, cls) {
    const n = document.createElement(tag);
    if (text !== undefined && text !== null) n.textContent = String(text);
    if (cls) n.className = cls;
    return n;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "-";
    if (typeof v === "boolean") return v ? "yes" : "no";
    if (typeof v === "number" && !Number.isInteger(v)) return Math.abs(v) >= 1e6 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toPrecision(4) : String(Math.round(v * 1e4) / 1e4);
    return String(v);
  }
  function bytes(n) {
    const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
    while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return i ? n.toFixed(1) + " " + u[i] : n + " B";
  }

  // -- overview -----------------------------------------------------------------------------
  async function loadOverview() {
    const box = $("overview"); box.replaceChildren();
    const o = await api("overview");
    const dl = el("dl");
    const add = (k, v) => { dl.append(el("dt", k), el("dd", v)); };
    add("kind", o.kind + " (format v" + o.format_version + ", " + o.created_by + ")");
    for (const [n, t] of Object.entries(o.tables)) add("table " + n, t.rows + " rows, capacity " + (t.capacity === null ? "unbounded" : t.capacity) + ", offset " + t.offset);
    if (o.episodes) add("episodes", o.episodes.finished + " finished" + (o.episodes.in_progress ? " (+1 in progress)" : "") + ", from " + o.episodes.source);
    add("size on disk", bytes(o.stored_bytes) + " (" + bytes(o.logical_bytes) + " of committed data)");
    if (o.dataset) add("dataset", JSON.stringify(o.dataset).slice(0, 400));
    const r = o.robot;
    if (r && (r.fps !== null || r.tasks || r.stats)) {
      add("frame rate", r.fps === null ? "not declared" : r.fps + " fps");
      add("tasks", r.tasks + " in the dictionary, " + r.episodes_with_task + " episode(s) with one");
      add("statistics", r.stats ? "stored for " + r.stats.episodes + " episodes" + (r.stats.current ? "" : " (stale: rows rewritten since)") : "none stored (trajstore stats --save)");
    }
    box.append(dl);
    const t = el("table"); t.id = "fields-table";
    const head = el("tr"); ["field", "shape", "dtype", "chunk rows", "codec", "stored"].forEach((h) => head.append(el("th", h)));
    t.append(head);
    for (const a of o.arrays) {
      const tr = el("tr");
      [a.path, "(" + a.shape.join(", ") + ")", a.dtype, a.chunk_rows, a.codec, bytes(a.stored_bytes)].forEach((v) => tr.append(el("td", v)));
      t.append(tr);
    }
    box.append(t);
    if (o.task_dictionary) {
      const tt = el("table"); tt.id = "tasks-table";
      const th = el("tr"); ["task_index", "task", "episodes"].forEach((h) => th.append(el("th", h))); tt.append(th);
      for (const t of o.task_dictionary.tasks) { const tr = el("tr"); [t.index, t.task, t.episodes].forEach((v) => tr.append(el("td", v))); tt.append(tr); }
      box.append(el("h3", "tasks"), tt);
      if (o.task_dictionary.more) box.append(el("p", "... and " + o.task_dictionary.more + " more tasks"));
    }
    const statsBox = el("details"); statsBox.id = "stats"; box.append(statsBox);
    if (r && r.stats) await loadStats(statsBox);
  }
  // The stored statistics, aggregated over the episodes they are current for (no rows read).
  async function loadStats(box) {
    const s = await api("stats");
    if (!s.stored) return;
    // Open unless long (it would push the episode table down): a click on its heading opens it,
    // and the page keeps the reader's choice while a live store redraws the overview.
    box.append(el("summary", "statistics (stored, " + s.episodes + " of " + s.of + " episodes)"));
    box.open = state.statsOpen !== null ? state.statsOpen : s.fields.reduce((n, f) => n + f.channels.length + (f.more ? 1 : 0), 0) <= 20;
    box.addEventListener("toggle", () => { state.statsOpen = box.open; });
    if (!s.fields.length) { box.append(el("p", "none current: rows were rewritten since they were stored (trajstore stats --save)")); return; }
    const t = el("table"); t.id = "stats-table";
    const keys = ["mean", "std", "min", "max", "q01", "q10", "q50", "q90", "q99"];
    const head = el("tr"); ["field", "steps"].concat(keys).forEach((h) => head.append(el("th", h))); t.append(head);
    for (const f of s.fields) {
      f.channels.forEach((vals, c) => {
        const tr = el("tr");
        tr.append(el("td", f.channels.length > 1 || f.more ? f.field + "[" + c + "]" : f.field), el("td", f.count, "num"));
        vals.forEach((v) => tr.append(el("td", fmt(v), "num")));
        t.append(tr);
      });
      if (f.more) { const tr = el("tr"); tr.append(el("td", f.field + ": " + f.more + " more channels")); t.append(tr); }
    }
    box.append(t);
  }

  // -- episode table ------------------------------------------------------------------------
  async function loadEpisodes() {
    let page;
    try {
      page = await api("episodes", { where: state.where, sort: state.sort, desc: state.desc ? 1 : 0, offset: state.offset, limit: PAGE });
    } catch (e) {
      if (e.status === 409) { $("episode-count").textContent = "no episodes: " + e.message; $("episodes-table").tBodies[0].replaceChildren(); return; }
      throw e;
    }
    $("episode-count").textContent = page.total + " episodes";
    $("matched").textContent = state.where ? page.matched + " match" : "";
    const thead = $("episodes-table").tHead, tbody = $("episodes-table").tBodies[0];
    const hr = el("tr");
    for (const c of page.columns) {
      const th = el("th", c); th.dataset.col = c;
      if (c === state.sort) th.className = "sorted" + (state.desc ? "" : " asc");
      th.onclick = () => { state.desc = state.sort === c ? !state.desc : c !== "episode_id" && c !== "start"; state.sort = c; state.offset = 0; refreshList(); };
      hr.append(th);
    }
    thead.replaceChildren(hr);
    const rows = page.rows.map((r) => {
      const tr = el("tr");
      r.forEach((v, i) => {
        const td = el("td", null, typeof v === "number" ? "num" : "");
        if (page.columns[i] === "episode_id") {
          const a = el("a", v, "ep-link"); a.href = "#/episode/" + state.part + "/" + v; td.append(a);
        } else td.textContent = fmt(v);
        tr.append(td);
      });
      return tr;
    });
    tbody.replaceChildren(...rows);
    const last = Math.min(page.offset + PAGE, page.matched);
    $("page-info").textContent = page.matched ? (page.offset + 1) + "-" + last + " of " + page.matched : "none";
    $("prev").disabled = page.offset === 0;
    $("next").disabled = last >= page.matched;
  }
  async function refreshList() {
    try { showError(null); await loadEpisodes(); } catch (e) { showError(e); }
  }

  // -- one episode ----------------------------------------------------------------------------
  // The x of a step: the step, or its time in seconds (the nearest step sent, for a strided episode).
  function hasTime(ep) { return !!(ep && ep.time && ep.time.source && ep.time.time.every((v) => typeof v === "number")); }
  function useTime() { return state.xTime && hasTime(state.episode); }
  function xOf(step) {
    const ep = state.episode;
    if (!useTime()) return step;
    const k = Math.min(ep.steps.length - 1, Math.round(step / ep.stride));
    return ep.time.source === "fps" ? step / ep.time.fps : ep.time.time[k];
  }
  function stepAt(x) {
    const ep = state.episode;
    if (!useTime()) return Math.round(x);
    if (ep.time.source === "fps") return Math.round(x * ep.time.fps);
    let lo = 0, hi = ep.time.time.length - 1;  // the sent step nearest to time x
    while (lo < hi) { const mid = (lo + hi) >> 1; if (ep.time.time[mid] < x) lo = mid + 1; else hi = mid; }
    if (lo > 0 && Math.abs(ep.time.time[lo - 1] - x) <= Math.abs(ep.time.time[lo] - x)) lo--;
    return ep.steps[lo];
  }
  function cursorPlugin() {
    return { hooks: { draw: [(u) => {
      const x = Math.round(u.valToPos(xOf(state.step), "x", true));
      const ctx = u.ctx; ctx.save(); ctx.strokeStyle = "#d33"; ctx.lineWidth = 2;
      ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke(); ctx.restore();
    }] } };
  }
  // A constant series (flags that never fire) gets the band around its value, not 0..100.
  const yRange = (_u, lo, hi) => (lo === hi ? [lo - 1, hi + 1] : uPlot.rangeNum(lo, hi, 0.1, true));
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];
  function drawPlots(ep) {
    state.plots.forEach((p) => p.destroy()); state.plots = [];
    const box = $("plots"); box.replaceChildren();
    const width = Math.min(900, Math.max(300, box.clientWidth || 800));
    for (const [path, cols] of Object.entries(ep.series)) {
      const div = el("div", null, "plot"); div.dataset.field = path;
      div.append(el("h3", path)); box.append(div);
      const series = [{ label: useTime() ? "time (s)" : "step" }].concat(cols.map((_c, k) => ({ label: cols.length > 1 ? "[" + k + "]" : path.split("/").pop(), stroke: COLORS[k % COLORS.length], width: 1 })));
      const u = new uPlot({ width: width, height: 160, series: series, plugins: [cursorPlugin()], scales: { x: { time: false }, y: { range: yRange } },
                            legend: { show: cols.length > 1, live: false } }, [useTime() ? ep.time.time : ep.steps].concat(cols), div);
      u.over.addEventListener("click", () => { const v = u.posToVal(u.cursor.left, "x"); if (Number.isFinite(v)) setStep(stepAt(v)); });
      state.plots.push(u);
    }
  }
  let frameBusy = false, frameWanted = null;
  function loadFrames() {
    // One request per image field at a time; a scrub while one loads asks for the newest step only.
    if (frameBusy) { frameWanted = state.step; return; }
    const imgs = Array.from(document.querySelectorAll("#frames img"));
    if (!imgs.length) return;
    frameBusy = true;
    const step = state.step;
    let left = imgs.length;
    const done = () => { if (--left === 0) { frameBusy = false; if (frameWanted !== null && frameWanted !== step) { frameWanted = null; loadFrames(); } } };
    for (const img of imgs) {
      img.onload = () => { img.dataset.step = String(step); done(); };
      img.onerror = () => { showError("frame " + step + " of " + img.dataset.field + " did not load"); done(); };
      img.src = "/api/frame?" + new URLSearchParams({ part: state.part, id: state.episode.id, field: img.dataset.field, step: step, fmt: "png", size: img.dataset.size });
    }
  }
  function setStep(s) {
    if (!state.episode) return;
    state.step = Math.max(0, Math.min(state.episode.length - 1, s));
    $("scrubber").value = String(state.step);
    $("step-label").textContent = "step " + state.step + " / " + (state.episode.length - 1) +
      (hasTime(state.episode) ? ", t = " + fmt(state.episode.time.source === "fps" ? state.step / state.episode.time.fps : state.episode.time.time[Math.min(state.episode.steps.length - 1, Math.round(state.step / state.episode.stride))]) + " s" : "");
    state.plots.forEach((u) => u.redraw(false, false));
    loadFrames();
  }
  async function showEpisode(part, id) {
    $("list-view").hidden = true; $("episode-view").hidden = false;
    state.part = part; $("part-select").value = String(part);
    const ep = await api("episode", { id: id });
    state.episode = ep; state.step = 0;
    $("ep-title").textContent = "episode " + ep.id + ": " + ep.length + " steps" + (ep.stride > 1 ? " (plots show every " + ep.stride + "th step)" : "");
    $("scrubber").max = String(Math.max(0, ep.length - 1));
    const frames = $("frames"); frames.replaceChildren();
    for (const f of ep.fields.filter((f) => f.kind === "image")) {
      const fig = el("figure"); const img = el("img", null, "frame");
      img.dataset.field = f.path; img.alt = f.path;
      const side = Math.max(f.shape[0], f.shape[1]);
      img.dataset.size = side > 512 ? "512" : "0";
      img.width = Math.max(128, Math.min(512, side * (side < 128 ? 4 : 1)));
      fig.append(img, el("figcaption", f.path + " (" + f.shape.join("x") + ")")); frames.append(fig);
    }
    $("x-axis").hidden = !hasTime(ep);
    $("x-axis").textContent = "x: " + (useTime() ? "time (s)" : "step");
    $("x-axis").title = hasTime(ep) ? "plot against " + (useTime() ? "step" : "time, from " + (ep.time.source === "fps" ? "the store's frame rate (" + ep.time.fps + " fps)" : "the timestamp field")) : "";
    const others = ep.fields.filter((f) => f.kind === "other");
    $("other-fields").textContent = others.length ? "not plotted: " + others.map((f) => f.path + " (" + f.shape.join("x") + ")").join(", ") : "";
    drawPlots(ep);
    setStep(0);
  }

  async function refreshEpisode() {
    // A new commit while an episode is shown: a live episode grows; an evicted one is gone.
    const id = state.episode.id;
    let ep;
    try { ep = await api("episode", { id: id }); } catch (e) { showError(e); return; }
    if (!state.episode || state.episode.id !== id || ep.length === state.episode.length) return;
    state.episode = ep;
    $("ep-title").textContent = "episode " + ep.id + ": " + ep.length + " steps";
    $("scrubber").max = String(Math.max(0, ep.length - 1));
    drawPlots(ep);
    setStep(state.step);
  }

  // -- routing, parts and live polling ---------------------------------------------------------
  async function route() {
    showError(null);
    if (state.playing) { clearInterval(state.playing); state.playing = null; $("play").textContent = "play"; }
    const m = location.hash.match(/^#\/episode\/(\d+)\/(-?\d+)$/);
    try {
      if (m) { await showEpisode(Number(m[1]), Number(m[2])); return; }
      state.episode = null;
      $("list-view").hidden = false; $("episode-view").hidden = true;
      await loadOverview();
      await loadEpisodes();
    } catch (e) { showError(e); }
  }
  async function poll() {
    try {
      const s = await api("status");
      $("live").className = "";
      if (state.generation !== null && s.generation !== state.generation) {
        if (!state.episode) { await loadEpisodes(); await loadOverview(); } else await refreshEpisode();
      }
      state.generation = s.generation;
    } catch (e) { $("live").className = "stale"; $("live").title = String(e.message || e); }
    setTimeout(poll, POLL_MS);
  }
  async function start() {
    try {
      const p = await api("parts");
      state.parts = p.parts;
      $("store-path").textContent = p.folder.describe;
      if (p.folder.problems.length) { $("problems").textContent = p.folder.problems.join("\n"); $("problems").hidden = false; }
      const sel = $("part-select");
      if (p.parts.length > 1) {
        sel.hidden = false;
        p.parts.forEach((q) => { const o = el("option", q.name); o.value = q.index; sel.append(o); });
        sel.onchange = () => { state.part = Number(sel.value); state.offset = 0; state.generation = null; location.hash = "#/"; route(); };
      }
    } catch (e) { showError(e); }
    $("filter").onsubmit = (ev) => { ev.preventDefault(); state.where = $("where").value; state.offset = 0; refreshList(); };
    $("prev").onclick = () => { state.offset = Math.max(0, state.offset - PAGE); refreshList(); };
    $("next").onclick = () => { state.offset += PAGE; refreshList(); };
    $("scrubber").oninput = () => setStep(Number($("scrubber").value));
    $("x-axis").onclick = () => {
      state.xTime = !state.xTime;
      if (!state.episode) return;
      $("x-axis").textContent = "x: " + (useTime() ? "time (s)" : "step");
      drawPlots(state.episode); setStep(state.step);
    };
    $("play").onclick = () => {
      if (state.playing) { clearInterval(state.playing); state.playing = null; $("play").textContent = "play"; return; }
      $("play").textContent = "pause";
      state.playing = setInterval(() => { if (!frameBusy) setStep(state.episode && state.step + 1 < state.episode.length ? state.step + 1 : 0); }, 50);
    };
    window.addEventListener("hashchange", route);
    await route();
    poll();
  }
  start();
})();
