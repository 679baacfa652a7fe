// ---- listing.js: the DOM index (every rank row, every block) and the side panel.
//
// #listing holds one <ol class="rank-row"> per view and rank (data-view: the source,
// data-v: the view's position, data-rank, data-stage, data-lane, data-device,
// data-bubble, data-mem-peak and data-capacity in bytes), in display order, and in it one <li class="block"> per event
// (data-index, data-kind, data-stream, data-start, data-end; the <code> is the text). It is built from the decoded arrays the
// canvas draws, so it is what the canvas shows; the selected rank's lists are
// visible as its program listing, the others carry `hidden`.

const listing = document.getElementById("listing"), details = document.getElementById("details");
const LISTS = VIEWS.map(() => new Map());   // per view: rank -> <ol>

// Built in slices of ~INDEX_SLICE events between frames, so that a plan of a million
// events is drawn and usable at once while its index fills in; `done` runs at the end.
const INDEX_SLICE = 20000;

function buildIndex(done) {
  const work = [];
  for (const v of VIEWS) for (const r of v.ranks) work.push([v, r]);
  let next = 0;
  function slice() {
    const html = [];
    for (let budget = INDEX_SLICE; next < work.length && budget > 0; next++) {
      const [v, r] = work[next];
      html.push(rankListHtml(v, r));
      budget -= r.to - r.from + 1;
    }
    listing.insertAdjacentHTML("beforeend", html.join(""));
    if (next < work.length) { setTimeout(slice, 0); return; }
    for (const ol of listing.querySelectorAll("ol.rank-row")) {
      LISTS[Number(ol.dataset.v)].set(Number(ol.dataset.rank), ol);
    }
    done();
  }
  listing.addEventListener("click", onListingClick);
  slice();
}

function rankListHtml(v, r) {
  const html = [`<ol class="rank-row" hidden data-v="${v.idx}" data-view="${escapeHtml(v.source)}" ` +
    `data-rank="${r.rank}" data-stage="${r.stage}" ` +
    `data-lane="${r.lane}" data-device="${escapeHtml(r.device)}" data-bubble="${r.bubble}" ` +
    `data-mem-peak="${r.peak}" data-capacity="${r.capacity}" ` +
    `data-title="rank ${r.rank} · stage ${r.stage} · lane ${r.lane}${VIEWS.length > 1 ? " · " + escapeHtml(v.source) : ""}">`];
  for (const i of programOrder(v, r)) {
    html.push(`<li class="block" data-index="${v.ev.index[i]}" data-kind="${kindOf(v, i)}" ` +
      `data-stream="${STREAMS[v.ev.stream[i]]}" data-start="${v.start[i]}" data-end="${v.end[i]}" data-i="${i}">` +
      `<b>${v.ev.index[i]}</b><code>${escapeHtml(eventText(v, i))}</code><span>${fmtTime(v.start[i])}</span></li>`);
  }
  html.push("</ol>");
  return html.join("");
}

function onListingClick(e) {
  const li = e.target.closest("li.block");
  if (!li) return;
  const view = Number(li.parentElement.dataset.v), i = Number(li.dataset.i);
  select(view, i);
  zoomTo(VIEWS[view].start[i], VIEWS[view].end[i]);
  scrollToRank(VIEWS[view].ranks[VIEWS[view].rankPos[i]].rank);
}

// A rank's events in instruction order (the canvas keeps them by stream, then time).
function programOrder(v, r) {
  const order = [];
  for (let i = r.from; i < r.to; i++) order.push(i);
  return order.sort((a, b) => v.ev.index[a] - v.ev.index[b] || v.start[a] - v.start[b]);
}

function select(view, i) {
  STATE.selected = { view: view, i: i };
  const v = VIEWS[view];
  details.innerHTML = describe(v, i);
  showRank(v.ranks[v.rankPos[i]].rank, { view: view, i: i });
  redraw();
}

function showRank(rank, current) {
  for (const [k, lists] of LISTS.entries()) {
    for (const [r, ol] of lists) ol.hidden = r !== rank;
    const ol = lists.get(rank);
    if (!ol) continue;
    for (const li of ol.querySelectorAll("li.current")) li.classList.remove("current");
    if (current && current.view === k) {
      const li = ol.querySelector(`li[data-i="${current.i}"]`);
      if (li) { li.classList.add("current"); li.scrollIntoView({ block: "nearest" }); }
    }
  }
  if (!current) {
    const r = VIEWS[0].byRank.get(rank) || VIEWS[VIEWS.length - 1].byRank.get(rank);
    details.innerHTML = `<dl><dt>rank</dt><dd>${rank}</dd><dt>stage / lane</dt><dd>${r.stage} / ${r.lane}</dd>` +
      `<dt>device</dt><dd>${escapeHtml(r.device)} ${escapeHtml(r.gpu)}</dd>` +
      `<dt>bubble</dt><dd>${(100 * r.bubble).toFixed(1)}%</dd>` +
      `<dt>memory</dt><dd>${fmtBytes(r.peak)} peak of ${fmtBytes(r.capacity)}</dd>` +
      `<dt>events</dt><dd>${r.to - r.from}</dd></dl>`;
  }
}

function scrollToRank(rank) {
  const row = LAYOUT.rows.find(x => x.kind === "rank" && x.rank === rank);
  if (row && (row.y < scroller.scrollTop || row.y + row.h > scroller.scrollTop + H)) {
    scroller.scrollTop = Math.max(0, row.y - H / 3);
  }
}
