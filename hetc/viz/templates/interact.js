// ---- interact.js: zoom, pan, hover, selection and search.

const tip = document.getElementById("tip");

function zoom(factor, atX) {
  const t = tOf(atX === undefined ? LABEL_W + (W - LABEL_W) / 2 : atX);
  const span = Math.min(SPAN * 4, Math.max(1e-9, (STATE.t1 - STATE.t0) * factor));
  const share = (t - STATE.t0) / (STATE.t1 - STATE.t0);
  STATE.t0 = t - share * span; STATE.t1 = STATE.t0 + span;
  redraw();
}

function pan(dx) {
  const dt = dx / (W - LABEL_W) * (STATE.t1 - STATE.t0);
  STATE.t0 += dt; STATE.t1 += dt;
  redraw();
}

function fit() { STATE.t0 = -SPAN * 0.01; STATE.t1 = SPAN * 1.02; redraw(); }

function zoomTo(start, end) {
  const pad = Math.max((end - start) * 2, SPAN * 1e-4);
  STATE.t0 = start - pad; STATE.t1 = end + pad;
  redraw();
}

// The event under a point: its view and index, or the rank row's part when between blocks.
function hit(x, y) {
  const row = LAYOUT.rows[rowAt(y)];
  if (!row || row.kind !== "rank") return null;
  const part = row.parts.find(p => y >= p.y && y < p.y + p.h);
  if (!part) return null;
  if (x < LABEL_W) return { part: part };
  for (const s in part.tracks) {
    const tr = part.tracks[s], range = part.r.tracks[s];
    if (y < tr.y || y >= tr.y + tr.h || !range) continue;
    const v = part.view, t = tOf(x), slack = 3 / (W - LABEL_W) * (STATE.t1 - STATE.t0);
    let best = -1, bestDist = Infinity;
    for (let i = range[0]; i < range[1]; i++) {
      const d = t < v.start[i] ? v.start[i] - t : t > v.end[i] ? t - v.end[i] : 0;
      if (d <= slack && d < bestDist) { best = i; bestDist = d; }
    }
    if (best >= 0) return { part: part, view: v.idx, i: best };
  }
  return { part: part };
}

function counterpart(v, i) {  // the same instruction in the other view, when comparing
  if (VIEWS.length < 2) return null;
  const other = VIEWS[1 - v.idx], r = other.byRank.get(v.ranks[v.rankPos[i]].rank);
  if (!r) return null;
  for (let j = r.from; j < r.to; j++) if (other.ev.index[j] === v.ev.index[i]) return { view: other, i: j };
  return null;
}

function describe(v, i) {
  const r = v.ranks[v.rankPos[i]], dur = v.end[i] - v.start[i];
  let html = `<code>${escapeHtml(eventText(v, i))}</code><br>` +
    `<span class="muted">rank ${r.rank} · #${v.ev.index[i]} · ${kindOf(v, i)} on ${STREAMS[v.ev.stream[i]]}` +
    (VIEWS.length > 1 ? ` · ${escapeHtml(v.source)}` : "") + `</span><br>` +
    `${fmtTime(v.start[i])} → ${fmtTime(v.end[i])} (${fmtTime(dur)})`;
  const other = counterpart(v, i);
  if (other) {
    const od = other.view.end[other.i] - other.view.start[other.i];
    const pct = dur > 0 ? ` (${od >= dur ? "+" : ""}${(100 * (od - dur) / dur).toFixed(0)}%)` : "";
    html += `<br><span class="muted">${escapeHtml(other.view.source)}: ${fmtTime(other.view.start[other.i])}, ` +
      `lasts ${fmtTime(od)}${pct}</span>`;
  }
  for (let k = 0; k < v.flows.length; k += 3) {
    const peerIdx = v.flows[k] === i ? v.flows[k + 1] : v.flows[k + 1] === i ? v.flows[k] : -1;
    if (peerIdx < 0) continue;
    html += `<br><span class="muted">${v.flows[k] === i ? "to" : "from"} rank ${v.ranks[v.rankPos[peerIdx]].rank}: ` +
      `${escapeHtml(eventText(v, peerIdx))} · ${fmtBytes(v.flows[k + 2])}</span>`;
  }
  return html;
}

function escapeHtml(s) {
  return String(s).replace(/[&<>"]/g, c => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
}

function canvasPoint(e) {
  const box = lanes.getBoundingClientRect();
  return [e.clientX - box.left, e.clientY - box.top + scroller.scrollTop];
}

let drag = null;

function onMove(e) {
  if (drag) {
    pan(drag.x - e.clientX); scroller.scrollTop += drag.y - e.clientY;
    drag.moved = drag.moved || Math.abs(drag.x - e.clientX) + Math.abs(drag.y - e.clientY) > 2;
    drag.x = e.clientX; drag.y = e.clientY;
    return;
  }
  const [x, y] = canvasPoint(e), h = hit(x, y);
  const rank = h ? h.part.r.rank : null;
  if (rank !== STATE.hoverRank) { STATE.hoverRank = rank; redraw(); }
  if (!h || h.i === undefined) { tip.hidden = true; return; }
  tip.innerHTML = describe(VIEWS[h.view], h.i);
  tip.hidden = false;
  const left = Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
  tip.style.left = left + "px"; tip.style.top = (e.clientY + 16) + "px";
}

function installInteraction() {
  lanes.addEventListener("mousedown", e => { drag = { x: e.clientX, y: e.clientY, moved: false }; lanes.classList.add("dragging"); });
  window.addEventListener("mouseup", e => {
    if (drag && !drag.moved && e.target === lanes) {
      const [x, y] = canvasPoint(e), h = hit(x, y);
      if (h && h.i !== undefined) select(h.view, h.i); else if (h) showRank(h.part.r.rank, null);
    }
    drag = null; lanes.classList.remove("dragging");
  });
  lanes.addEventListener("mousemove", onMove);
  lanes.addEventListener("mouseleave", () => { tip.hidden = true; STATE.hoverRank = null; redraw(); });
  lanes.addEventListener("dblclick", e => {
    const [x, y] = canvasPoint(e), h = hit(x, y);
    if (h && h.i !== undefined) zoomTo(VIEWS[h.view].start[h.i], VIEWS[h.view].end[h.i]);
  });
  scroller.addEventListener("wheel", e => {
    const box = lanes.getBoundingClientRect();
    if (e.ctrlKey || e.metaKey || e.altKey) { e.preventDefault(); zoom(Math.exp(e.deltaY * 0.002), e.clientX - box.left); }
    else if (e.shiftKey || Math.abs(e.deltaX) > Math.abs(e.deltaY)) { e.preventDefault(); pan(e.deltaX || e.deltaY); }
  }, { passive: false });
  scroller.addEventListener("scroll", redraw);
  window.addEventListener("resize", resize);
  window.addEventListener("keydown", onKey);
  document.getElementById("zoom-in").onclick = () => zoom(0.5);
  document.getElementById("zoom-out").onclick = () => zoom(2);
  document.getElementById("fit").onclick = fit;
  document.getElementById("show-flows").onchange = e => { STATE.flows = e.target.checked; redraw(); };
  document.getElementById("mem-peak").onchange = e => { STATE.memPeak = e.target.checked; redraw(); };
  document.getElementById("compact").onchange = e => setCompact(e.target.checked);
  window.addEventListener("hashchange", applyHash);
  document.getElementById("search").addEventListener("input", e => search(e.target.value));
}

function onKey(e) {
  if (e.target.tagName === "INPUT") { if (e.key === "Escape") e.target.blur(); return; }
  const actions = { w: () => zoom(0.7), s: () => zoom(1 / 0.7), a: () => pan(-(W - LABEL_W) * 0.2),
    d: () => pan((W - LABEL_W) * 0.2), "0": fit, f: fit, "/": () => document.getElementById("search").focus(),
    Escape: () => { STATE.selected = null; redraw(); } };
  const act = actions[e.key];
  if (act) { e.preventDefault(); act(); }
}

function setCompact(compact) {
  const rank = STATE.hoverRank;
  LAYOUT = buildLayout(compact);
  document.getElementById("compact").checked = compact;
  resize();
  if (rank !== null) scrollToRank(rank);
}

// Deep links: #rank=5&index=17 selects that instruction (add &view=measured when
// comparing); #rank=5 lists a rank; #q=mb%3D3 highlights; #compact shows the overview;
// #mem=peak scales memory curves to each rank's peak instead of its capacity.
function applyHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  if (params.has("compact")) setCompact(true);
  if (params.get("mem") === "peak") { STATE.memPeak = true; document.getElementById("mem-peak").checked = true; redraw(); }
  if (params.has("q")) { document.getElementById("search").value = params.get("q"); search(params.get("q")); }
  if (!params.has("rank")) return;
  const rank = Number(params.get("rank")), wanted = params.get("view");
  const view = Math.max(0, VIEWS.findIndex(v => v.source === wanted));
  const v = VIEWS[view], r = v.byRank.get(rank);
  if (!r) return;
  scrollToRank(rank);
  if (!params.has("index")) { showRank(rank, null); return; }
  const index = Number(params.get("index"));
  for (let i = r.from; i < r.to; i++) {
    if (v.ev.index[i] === index) { select(view, i); zoomTo(v.start[i], v.end[i]); return; }
  }
}

// Highlight blocks whose text contains every word of the query as a whole token ("rank N" matches a rank).
function search(query) {
  const words = query.trim().toLowerCase().split(/\s+/).filter(Boolean);
  let rankWanted = null;
  const k = words.indexOf("rank");
  if (k >= 0 && k + 1 < words.length) { rankWanted = Number(words[k + 1]); words.splice(k, 2); }
  for (const v of VIEWS) {
    if (!words.length && rankWanted === null) { v.match = null; continue; }
    v.match = new Uint8Array(v.ev.index.length);
    // whole tokens: "mb=2" does not match "mb=21"
    const patterns = words.map(w => new RegExp(w.replace(/[.*+?^${}()|[\]\\]/g, "\\$&") + "(?![\\w])", "i"));
    for (let i = 0; i < v.match.length; i++) {
      const rankOk = rankWanted === null || v.ranks[v.rankPos[i]].rank === rankWanted;
      v.match[i] = rankOk && patterns.every(p => p.test(eventText(v, i))) ? 1 : 0;
    }
  }
  redraw();
}
