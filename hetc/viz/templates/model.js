// ---- model.js: decode the packed views (hetc/viz/encode.py) and lay out the rows.

const SCRIPT_T0 = performance.now();
window.addEventListener("error", e => { document.body.dataset.error = `${e.message} (line ${e.lineno})`; });
const DATA = JSON.parse(document.getElementById("hetc-data").textContent);
const KINDS = DATA.kinds, STREAMS = DATA.streams, COLORS = DATA.colors;
const TRACK_H = { compute: 18, p2p: 9, collective: 9, copy: 9 };
const MEM_H = 18, GAP = 2, PART_PAD = 4, STAGE_H = 22, LABEL_W = 190, COMPACT_H = 9;

function decodeView(d, viewIdx) {
  const ev = d.events, n = ev.index.length, unit = d.unit;
  const start = new Float64Array(n), end = new Float64Array(n), rankPos = new Int32Array(n);
  const numberAt = new Int32Array(n + 1);  // where event i's numbers start in ev.numbers
  for (let i = 0; i < n; i++) {
    start[i] = ev.start[i] * unit; end[i] = (ev.start[i] + ev.dur[i]) * unit;
    numberAt[i + 1] = numberAt[i] + d.templates[ev.template[i]].length - 1;
  }
  const ranks = [], usedStreams = new Set([0]);
  const R = d.ranks.rank.length;
  for (let p = 0; p < R; p++) {
    const from = ev.offsets[p], to = ev.offsets[p + 1], tracks = {};
    for (let i = from; i < to; i++) {
      rankPos[i] = p;
      const s = ev.stream[i];
      usedStreams.add(s);
      if (!tracks[s]) tracks[s] = [i, i + 1]; else tracks[s][1] = i + 1;
    }
    ranks.push({ pos: p, rank: d.ranks.rank[p], stage: d.ranks.stage[p], lane: d.ranks.lane[p],
      device: d.strings[d.ranks.device[p]], gpu: d.strings[d.ranks.gpu[p]], capacity: d.ranks.capacity[p],
      bubble: d.ranks.bubble[p], from: from, to: to, tracks: tracks,
      memFrom: d.memory.offsets[p], memTo: d.memory.offsets[p + 1], peak: 0, low: 0 });
  }
  const memTime = new Float64Array(d.memory.time.length);
  for (let i = 0; i < memTime.length; i++) memTime[i] = d.memory.time[i] * unit;
  for (const r of ranks) {
    r.low = r.memTo > r.memFrom ? Infinity : 0;
    for (let i = r.memFrom; i < r.memTo; i++) {
      r.peak = Math.max(r.peak, d.memory.bytes[i]); r.low = Math.min(r.low, d.memory.bytes[i]);
    }
  }
  const byRank = new Map(ranks.map(r => [r.rank, r]));
  return { idx: viewIdx, source: d.source, stepTime: d.step_time, tokensPerS: d.tokens_per_s, strings: d.strings,
    templates: d.templates, numberAt: numberAt, texts: new Array(n), labels: new Array(n),
    ranks: ranks, byRank: byRank, ev: ev, start: start, end: end, rankPos: rankPos, flows: d.flows,
    memTime: memTime, memBytes: d.memory.bytes, hasMemory: memTime.length > 0,
    streams: [...usedStreams].sort((a, b) => a - b), match: null };
}

const VIEWS = DATA.views.map(decodeView);
const SPAN = Math.max(...VIEWS.map(v => v.stepTime), 1e-9);

// One row per rank (stage header rows between stages); in a comparison each
// rank row holds one part per view, so planned and measured sit one above the other.
// Compact: only the compute track, a few pixels high, to see a whole large plan at once.
function buildLayout(compact) {
  const order = new Map();  // rank id -> {stage, lane}
  for (const v of VIEWS) for (const r of v.ranks) if (!order.has(r.rank)) order.set(r.rank, r);
  const ids = [...order.keys()].sort((a, b) => {
    const x = order.get(a), y = order.get(b);
    return x.stage - y.stage || x.lane - y.lane || a - b;
  });
  const rows = [], partOf = VIEWS.map(() => []);
  let y = 0, stage = null;
  for (const id of ids) {
    const info = order.get(id);
    if (info.stage !== stage) {
      stage = info.stage;
      rows.push({ kind: "stage", stage: stage, y: y, h: STAGE_H });
      y += STAGE_H;
    }
    const row = { kind: "rank", rank: id, stage: stage, lane: info.lane, y: y, parts: [] };
    for (const v of VIEWS) {
      const r = v.byRank.get(id);
      if (!r) continue;
      const part = { view: v, r: r, y: y, tracks: {}, mem: null, compact: compact };
      if (compact) {
        part.tracks[0] = { y: y + 1, h: COMPACT_H };
        y += COMPACT_H + 2;
      } else {
        y += PART_PAD;
        for (const s of v.streams) { part.tracks[s] = { y: y, h: TRACK_H[STREAMS[s]] }; y += TRACK_H[STREAMS[s]] + GAP; }
        if (v.hasMemory) { part.mem = { y: y, h: MEM_H }; y += MEM_H + GAP; }
        y = Math.max(y + PART_PAD, part.y + (v.hasMemory ? 54 : 42));  // room for the label lines
      }
      part.h = y - part.y;
      row.parts.push(part);
      partOf[v.idx][r.pos] = part;
    }
    row.h = y - row.y;
    rows.push(row);
  }
  return { rows: rows, partOf: partOf, height: y, compact: compact };
}

let LAYOUT = buildLayout(false);

function rowAt(y) {  // the last row starting at or above y
  const rows = LAYOUT.rows;
  let lo = 0, hi = rows.length - 1;
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1;
    if (rows[mid].y <= y) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// An event's instruction text: its template's parts around its numbers (encode.py), built once.
function eventText(v, i) {
  let text = v.texts[i];
  if (text !== undefined) return text;
  const parts = v.templates[v.ev.template[i]], nums = v.ev.numbers, at = v.numberAt[i];
  text = parts[0];
  for (let k = 1; k < parts.length; k++) text += nums[at + k - 1] + parts[k];
  return (v.texts[i] = text);
}
function kindOf(v, i) { return KINDS[v.ev.kind[i]]; }

function fmtTime(s) {
  const a = Math.abs(s);
  if (a < 1e-12) return "0";
  if (a >= 1) return s.toFixed(3) + " s";
  if (a >= 1e-3) return (s * 1e3).toFixed(3) + " ms";
  return (s * 1e6).toFixed(1) + " µs";
}

const BYTE_UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

function byteUnit(b) {  // the index of the unit that prints b with 1-4 digits before the point
  let i = 0;
  while (Math.abs(b) >= 1024 && i < BYTE_UNITS.length - 1) { b /= 1024; i++; }
  return i;
}

function fmtBytes(b, i = byteUnit(b)) {
  return (i ? (b / Math.pow(1024, i)).toFixed(1) : String(Math.round(b))) + " " + BYTE_UNITS[i];
}

function fmtBytesRange(low, high) {  // "270.1–271.6 MiB": both ends in the unit of the higher one
  const i = byteUnit(high);
  return fmtBytes(low, i).split(" ")[0] + "–" + fmtBytes(high, i);
}
