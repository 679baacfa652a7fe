// ---- draw.js: paint the visible rows of the canvas and the time axis.

const axis = document.getElementById("axis"), lanes = document.getElementById("lanes");
const scroller = document.getElementById("scroller"), spacer = document.getElementById("spacer");
const actx = axis.getContext("2d"), ctx = lanes.getContext("2d");
const STATE = { t0: 0, t1: SPAN * 1.02, flows: true, memPeak: false, selected: null, hoverRank: null };
let W = 0, H = 0, DPR = 1, CHAR_W = 6.1, pending = false;

function resize() {
  DPR = window.devicePixelRatio || 1;
  W = scroller.clientWidth; H = scroller.clientHeight;
  for (const [c, h] of [[lanes, H], [axis, 24]]) {
    c.width = Math.round(W * DPR); c.height = Math.round(h * DPR);
    c.style.width = W + "px"; c.style.height = h + "px";
  }
  spacer.style.height = Math.max(0, LAYOUT.height - H) + "px";
  ctx.font = "10px ui-monospace, SFMono-Regular, Menlo, monospace";
  CHAR_W = ctx.measureText("0123456789").width / 10;
  redraw();
}

function redraw() {
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => { pending = false; paint(); });
}

const xOf = t => LABEL_W + (t - STATE.t0) / (STATE.t1 - STATE.t0) * (W - LABEL_W);
const tOf = x => STATE.t0 + (x - LABEL_W) / (W - LABEL_W) * (STATE.t1 - STATE.t0);

function paint() {
  const top = scroller.scrollTop;
  ctx.setTransform(DPR, 0, 0, DPR, 0, -top * DPR);
  ctx.clearRect(0, top, W, H);
  const first = rowAt(top), rows = LAYOUT.rows;
  let last = first;
  while (last + 1 < rows.length && rows[last + 1].y < top + H) last++;
  ctx.save();
  ctx.beginPath(); ctx.rect(LABEL_W, top, W - LABEL_W, H); ctx.clip();
  for (let k = first; k <= last; k++) if (rows[k].kind === "rank") for (const p of rows[k].parts) paintPart(p);
  if (STATE.flows) paintFlows(top, top + H);
  paintSelection();
  ctx.restore();
  for (let k = first; k <= last; k++) paintLabel(rows[k]);
  paintAxis();
}

function paintPart(p) {
  const v = p.view, r = p.r;
  ctx.fillStyle = v.idx % 2 ? "#f3f1ec" : "#f5f7fa";
  for (const s in p.tracks) ctx.fillRect(LABEL_W, p.tracks[s].y, W - LABEL_W, p.tracks[s].h);
  for (const s in r.tracks) {
    const tr = p.tracks[s], [from, to] = r.tracks[s];
    if (tr) for (let i = from; i < to; i++) paintBlock(v, i, tr);
  }
  if (p.mem) paintMemory(v, r, p.mem);
}

function paintBlock(v, i, tr) {
  if (v.end[i] < STATE.t0 || v.start[i] > STATE.t1) return;
  const x0 = xOf(v.start[i]), x1 = xOf(v.end[i]), w = Math.max(1, x1 - x0);
  const kind = kindOf(v, i);
  ctx.globalAlpha = v.match && !v.match[i] ? 0.15 : (kind === "wait" || kind === "recv" ? 0.55 : 1);
  ctx.fillStyle = COLORS[kind];
  ctx.fillRect(x0, tr.y, w, tr.h);
  if (w > 2 * CHAR_W && tr.h >= 14) {
    const fit = Math.floor((w - 4) / CHAR_W), label = labelsOf(v, i).find(l => l.length <= fit);
    ctx.fillStyle = "#fff";
    if (label) ctx.fillText(label, Math.max(x0, LABEL_W) + 2, tr.y + tr.h - 5);
  }
  ctx.globalAlpha = 1;
}

// Labels for a block, longest first: the instruction text, the text without shape and
// handle, then torch.distributed.pipelining's action form ("0F2": ministage 0, forward,
// microbatch 2), so a narrow block still says which microbatch it is.
const SHORT_OPS = { fwd: "F", bwd: "B", bwd_i: "I", bwd_w: "W" };

function labelsOf(v, i) {
  let labels = v.labels[i];
  if (labels) return labels;
  const text = eventText(v, i), op = text.split(" ")[0];
  const ms = (text.match(/ ms=(\d+)/) || [])[1], mb = (text.match(/ mb=(\d+)/) || [])[1];
  labels = [text, text.replace(/ (shape|h)=\S+/g, "")];
  if (SHORT_OPS[op] && ms !== undefined && mb !== undefined) labels.push(`${ms}${SHORT_OPS[op]}${mb}`);
  else if (op === "step" && ms !== undefined) labels.push(`opt${ms}`);
  else if (op === "load" && mb !== undefined) labels.push(`L${mb}`);
  return (v.labels[i] = labels);
}

// A rank's memory curve (a step per sample) against its capacity (red dashed line), or,
// with "memory to peak", stretched between its lowest and peak use so that small swings
// on a large resident base still show.
function paintMemory(v, r, m) {
  if (r.memTo <= r.memFrom) return;
  const [low, top] = memRange(r);
  const yOf = b => m.y + m.h - (b - low) / (top - low) * (m.h - 1);
  ctx.fillStyle = "#eef3f8"; ctx.fillRect(LABEL_W, m.y, W - LABEL_W, m.h);
  const line = new Path2D(), x0 = xOf(v.memTime[r.memFrom]);
  let prev = v.memBytes[r.memFrom];
  line.moveTo(x0, yOf(prev));
  for (let i = r.memFrom + 1; i < r.memTo; i++) {
    const x = xOf(v.memTime[i]);
    line.lineTo(x, yOf(prev)); line.lineTo(x, yOf(v.memBytes[i])); prev = v.memBytes[i];
  }
  const x1 = xOf(SPAN);
  line.lineTo(x1, yOf(prev));
  const area = new Path2D(line);
  area.lineTo(x1, m.y + m.h); area.lineTo(x0, m.y + m.h); area.closePath();
  const over = r.peak > r.capacity;
  ctx.fillStyle = over ? "rgba(214,39,40,.3)" : "rgba(49,130,189,.25)"; ctx.fill(area);
  ctx.strokeStyle = over ? "#d62728" : "#2f6fa7"; ctx.lineWidth = 1; ctx.stroke(line);
  if (r.capacity <= top) {
    ctx.strokeStyle = "#d62728"; ctx.setLineDash([4, 3]);
    ctx.beginPath(); ctx.moveTo(LABEL_W, yOf(r.capacity) + .5); ctx.lineTo(W, yOf(r.capacity) + .5); ctx.stroke();
    ctx.setLineDash([]);
  }
}

function memRange(r) {  // [bottom, top] of the memory track, bytes
  if (STATE.memPeak) return [r.low, Math.max(r.peak, r.low + 1)];
  return [0, Math.max(r.capacity, r.peak, 1)];
}

function trackOf(v, i) {  // in compact rows everything sits on the compute track
  const part = LAYOUT.partOf[v.idx][v.rankPos[i]];
  return part.tracks[v.ev.stream[i]] || part.tracks[0];
}

function p2pY(v, i) {
  const tr = trackOf(v, i);
  return tr.y + tr.h / 2;
}

function paintFlows(yTop, yBottom) {
  for (const v of VIEWS) {
    const f = v.flows;
    ctx.strokeStyle = "rgba(40,40,40,.45)"; ctx.fillStyle = "rgba(40,40,40,.6)"; ctx.lineWidth = 1;
    for (let k = 0; k < f.length; k += 3) {
      const y0 = p2pY(v, f[k]), y1 = p2pY(v, f[k + 1]);
      if (Math.max(y0, y1) < yTop || Math.min(y0, y1) > yBottom) continue;
      if (v.match && !v.match[f[k]] && !v.match[f[k + 1]]) continue;
      arrow(xOf(v.end[f[k]]), y0, xOf(v.end[f[k + 1]]), y1);
    }
  }
}

function arrow(x0, y0, x1, y1) {
  ctx.beginPath(); ctx.moveTo(x0, y0); ctx.lineTo(x1, y1); ctx.stroke();
  const a = Math.atan2(y1 - y0, x1 - x0), s = 5;
  ctx.beginPath(); ctx.moveTo(x1, y1);
  ctx.lineTo(x1 - s * Math.cos(a - .45), y1 - s * Math.sin(a - .45));
  ctx.lineTo(x1 - s * Math.cos(a + .45), y1 - s * Math.sin(a + .45));
  ctx.fill();
}

function paintSelection() {
  const sel = STATE.selected;
  if (!sel) return;
  const v = VIEWS[sel.view], tr = trackOf(v, sel.i);
  const x0 = xOf(v.start[sel.i]), w = Math.max(2, xOf(v.end[sel.i]) - x0);
  ctx.strokeStyle = "#111"; ctx.lineWidth = 2; ctx.strokeRect(x0 - 1, tr.y - 1, w + 2, tr.h + 2);
  ctx.strokeStyle = "#111"; ctx.fillStyle = "#111"; ctx.lineWidth = 1.5;
  for (let k = 0; k < v.flows.length; k += 3) {
    if (v.flows[k] !== sel.i && v.flows[k + 1] !== sel.i) continue;
    arrow(xOf(v.end[v.flows[k]]), p2pY(v, v.flows[k]), xOf(v.end[v.flows[k + 1]]), p2pY(v, v.flows[k + 1]));
  }
  ctx.lineWidth = 1;
}

function paintLabel(row) {
  ctx.fillStyle = row.kind === "stage" ? "#e4e9f0" : (row.rank === STATE.hoverRank ? "#eef3fb" : "#fff");
  ctx.fillRect(0, row.y, LABEL_W, row.h);
  ctx.fillStyle = "#d5dbe3"; ctx.fillRect(0, row.y + row.h - 1, W, 1);
  if (row.kind === "stage") {
    ctx.fillStyle = "#e4e9f0"; ctx.fillRect(LABEL_W, row.y, W - LABEL_W, row.h - 1);
    ctx.fillStyle = "#1d232b"; ctx.font = "600 12px system-ui, sans-serif";
    ctx.fillText(stageTitle(row.stage), 8, row.y + 15);
    ctx.font = "10px ui-monospace, SFMono-Regular, Menlo, monospace";
    return;
  }
  for (const p of row.parts) {
    if (p.compact) { paintCompactLabel(p); continue; }
    const r = p.r, y = p.y + PART_PAD;
    ctx.fillStyle = "#1d232b"; ctx.font = "600 11px system-ui, sans-serif";
    ctx.fillText(`rank ${r.rank}  lane ${r.lane}` + (VIEWS.length > 1 ? `  · ${p.view.source}` : ""), 8, y + 10);
    ctx.font = "10px system-ui, sans-serif"; ctx.fillStyle = "#66707c";
    ctx.fillText(`${r.device} ${r.gpu}`, 8, y + 22);
    const bw = 60, bx = LABEL_W - bw - 8;
    ctx.fillText(`bubble ${(100 * r.bubble).toFixed(1)}%`, 8, y + 34);
    bubbleBar(r.bubble, bx, y + 27, bw, 6);
    if (p.mem) {
      ctx.fillStyle = r.peak > r.capacity ? "#d62728" : "#66707c";
      const used = STATE.memPeak ? fmtBytesRange(r.low, r.peak) : fmtBytes(r.peak);
      ctx.fillText(`mem ${used} / ${fmtBytes(r.capacity)}`, 8, y + 46);
    }
    ctx.font = "10px ui-monospace, SFMono-Regular, Menlo, monospace";
  }
}

function paintCompactLabel(p) {
  const r = p.r, bw = 40, bx = LABEL_W - bw - 8;
  ctx.font = "9px system-ui, sans-serif"; ctx.fillStyle = "#454e59";
  ctx.fillText(`rank ${r.rank} · lane ${r.lane}` + (VIEWS.length > 1 ? ` · ${p.view.source}` : "") +
    ` · ${(100 * r.bubble).toFixed(0)}%`, 8, p.y + COMPACT_H);
  bubbleBar(r.bubble, bx, p.y + 3, bw, 5);
  ctx.font = "10px ui-monospace, SFMono-Regular, Menlo, monospace";
}

function bubbleBar(bubble, x, y, w, h) {
  ctx.fillStyle = "#e1e5ea"; ctx.fillRect(x, y, w, h);
  ctx.fillStyle = bubble > .3 ? "#d62728" : bubble > .15 ? "#f0a330" : "#4c9a5a";
  ctx.fillRect(x, y, w * Math.min(1, bubble), h);
}

function stageTitle(stage) {
  const stats = VIEWS[0].ranks.filter(r => r.stage === stage);
  const lanes = new Set(stats.map(r => r.lane)).size, devices = [...new Set(stats.map(r => r.device))].join(", ");
  const bubble = stats.reduce((a, r) => a + r.bubble, 0) / Math.max(1, stats.length);
  return `stage ${stage} · ${lanes} lane${lanes === 1 ? "" : "s"} · ${devices} · mean bubble ${(100 * bubble).toFixed(1)}%`;
}

function niceStep(span, px) {
  const raw = span / Math.max(1, px / 90), pow = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 5, 10]) if (m * pow >= raw) return m * pow;
  return 10 * pow;
}

function paintAxis() {
  actx.setTransform(DPR, 0, 0, DPR, 0, 0);
  actx.clearRect(0, 0, W, 24);
  actx.fillStyle = "#f7f8fa"; actx.fillRect(0, 0, W, 24);
  actx.font = "10px system-ui, sans-serif"; actx.fillStyle = "#66707c"; actx.strokeStyle = "#c5ccd5";
  const step = niceStep(STATE.t1 - STATE.t0, W - LABEL_W), marks = VIEWS.map(v => xOf(v.stepTime));
  for (let t = Math.ceil(STATE.t0 / step) * step; t <= STATE.t1; t += step) {
    const x = Math.round(xOf(t)) + .5;
    if (x < LABEL_W) continue;
    actx.beginPath(); actx.moveTo(x, 14); actx.lineTo(x, 24); actx.stroke();
    const text = fmtTick(t, step), right = x + 3 + actx.measureText(text).width;
    // a label that would run off the edge or under a step-time mark is left out
    if (right < W - 2 && !marks.some(m => m >= x && m <= right + 2)) actx.fillText(text, x + 3, 12);
  }
  for (const v of VIEWS) {
    const x = xOf(v.stepTime);
    actx.fillStyle = v.idx ? "#8a5a00" : "#1d232b"; actx.fillRect(x, 0, 2, 24);
  }
  actx.fillStyle = "#1d232b"; actx.fillText(`${fmtTime(STATE.t1 - STATE.t0)} shown`, 8, 16);
}

// A tick's time in the unit the visible span reads best in, with as many decimals as the step needs.
function fmtTick(t, step) {
  const span = Math.max(Math.abs(STATE.t0), Math.abs(STATE.t1));
  const [scale, unit] = span >= 1 ? [1, "s"] : span >= 1e-3 ? [1e3, "ms"] : [1e6, "µs"];
  if (Math.abs(t) < step / 2) return "0";
  const decimals = Math.max(0, Math.ceil(-Math.log10(step * scale) - 1e-9));
  return `${(t * scale).toFixed(decimals)} ${unit}`;
}
