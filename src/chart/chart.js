// The chart page: the series list with a filter; for the series ticked (up to 8), the hourly
// mean, the min-max band (one series) and a quantile (p50, p90 or p99) over the last 24 hours,
// 7 or 30 days or a range of one's own, from the JSON API (/api/v1/series, /api/v1/buckets).
// Dragging across the chart zooms to that span (the data is read again for it); local time or
// UTC; refresh now or every minute or five. The state is in the URL (?series=a&series=b
// &range=&from=&to=&q=&tz=&filter=), so a view can be bookmarked or linked. What was drawn is
// also in #drawn (JSON) and #rows (a table).
"use strict";

const RANGES = { "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400 };
const SERIES_MAX = 8;
const COLOURS = ["#1f5fa8", "#c0392b", "#2e8b57", "#8e44ad", "#d35400", "#16a085", "#7f8c8d", "#b8860b"];
const TOKEN_KEY = "bucketd-token";
const $ = (id) => document.getElementById(id);

const params = new URLSearchParams(location.search);
const state = {
  series: params.getAll("series").slice(0, SERIES_MAX),
  range: RANGES[params.get("range")] || params.get("range") === "custom" ? params.get("range") : "7d",
  from: Number(params.get("from")) || 0,
  to: Number(params.get("to")) || 0,
  q: ["p50", "p90", "p99"].includes(params.get("q")) ? params.get("q") : "p99",
  tz: params.get("tz") === "utc" ? "utc" : "local",
  filter: params.get("filter") || "",
  names: [],
};
if (state.range === "custom" && !(state.from < state.to)) state.range = "7d";
let plot = null;
let timer = null;

function status(text) {
  $("status").textContent = text;
}

function remember() {
  const p = new URLSearchParams();
  for (const s of state.series) p.append("series", s);
  p.set("range", state.range);
  if (state.range === "custom") {
    p.set("from", String(state.from));
    p.set("to", String(state.to));
  }
  p.set("q", state.q);
  p.set("tz", state.tz);
  if (state.filter) p.set("filter", state.filter);
  history.replaceState(null, "", "?" + p.toString());
}

class NeedToken extends Error {}

async function api(path) {
  const headers = {};
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = "Bearer " + token;
  const response = await fetch(path, { headers });
  if (response.status === 401) throw new NeedToken();
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function failed(e) {
  if (e instanceof NeedToken) {
    $("token-form").hidden = false;
    status("The query API needs a token.");
  } else {
    status("Error: " + e.message);
  }
}

function renderList() {
  const list = $("series");
  list.replaceChildren();
  const needle = state.filter.toLowerCase();
  const shown = state.names.filter((n) => n.toLowerCase().includes(needle));
  for (const name of shown) {
    const box = document.createElement("input");
    box.type = "checkbox";
    box.checked = state.series.includes(name);
    box.disabled = !box.checked && state.series.length >= SERIES_MAX;
    box.addEventListener("change", () => {
      state.series = box.checked
        ? [...state.series, name].slice(0, SERIES_MAX)
        : state.series.filter((s) => s !== name);
      remember();
      renderList();
      loadChart();
    });
    const label = document.createElement("label");
    label.append(box, " ", name);
    const li = document.createElement("li");
    li.dataset.name = name;
    if (box.checked) li.setAttribute("aria-current", "true");
    li.append(label);
    list.append(li);
  }
  status(shown.length + " of " + state.names.length + " series");
}

async function loadSeries() {
  try {
    const body = await api("api/v1/series");
    state.names = body.series.map((s) => s.name);
    renderList();
    await loadChart();
  } catch (e) {
    failed(e);
  }
}

// A time as the page shows it, in the chosen zone.
function label(seconds) {
  const d = new Date(seconds * 1000);
  if (state.tz === "utc") return d.toISOString().slice(0, 16).replace("T", " ");
  const pad = (n) => String(n).padStart(2, "0");
  return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " +
    pad(d.getHours()) + ":" + pad(d.getMinutes());
}

// The range shown: [from, to) in seconds, on bucket boundaries.
function span() {
  if (state.range === "custom") return [state.from, state.to];
  const hour = Math.floor(Date.now() / 3600000) * 3600;
  const to = hour + 3600;
  return [to - RANGES[state.range], to];
}

// The columns uPlot draws: the union of every series' bucket starts, each series null where it
// has no bucket (so that its line breaks there).
function columns(answers) {
  const starts = new Set();
  for (const a of answers) for (const b of a.buckets) starts.add(Date.parse(b.start) / 1000);
  const x = [...starts].sort((a, b) => a - b);
  const at = new Map(x.map((t, i) => [t, i]));
  const per = answers.map((a) => {
    const col = { series: a.series, count: [], mean: [], min: [], max: [], q: [] };
    for (const k of ["count", "mean", "min", "max", "q"]) col[k] = x.map(() => null);
    for (const b of a.buckets) {
      const i = at.get(Date.parse(b.start) / 1000);
      col.count[i] = b.count;
      col.mean[i] = b.mean;
      col.min[i] = b.min;
      col.max[i] = b.max;
      col.q[i] = b[state.q];
    }
    return col;
  });
  return { x, per };
}

function renderTable(cols) {
  $("hour-head").textContent = state.tz === "utc" ? "Hour (UTC)" : "Hour (local)";
  $("q-head").textContent = state.q;
  const rows = $("rows");
  rows.replaceChildren();
  cols.x.forEach((x, i) => {
    for (const c of cols.per) {
      if (c.count[i] === null) continue;
      const tr = document.createElement("tr");
      for (const v of [label(x), c.series, c.count[i], c.mean[i], c.min[i], c.max[i], c.q[i]]) {
        const td = document.createElement("td");
        td.textContent = v === null ? "" : String(v);
        tr.append(td);
      }
      rows.append(tr);
    }
  });
}

function draw(cols, from, to) {
  const el = $("chart");
  const one = cols.per.length === 1;
  const data = [cols.x];
  const series = [{ label: state.tz === "utc" ? "hour (UTC)" : "hour (local)" }];
  const bands = [];
  cols.per.forEach((c, k) => {
    const colour = COLOURS[k % COLOURS.length];
    data.push(c.mean);
    series.push({ label: one ? "mean" : c.series + " mean", stroke: colour, width: 2 });
    if (one) {
      data.push(c.min, c.max);
      series.push({ label: "min", stroke: "#8fb0d8", width: 1 }, { label: "max", stroke: "#8fb0d8", width: 1 });
      bands.push({ series: [3, 2], fill: "rgba(31, 95, 168, 0.15)" });
    }
    data.push(c.q);
    series.push({ label: (one ? "" : c.series + " ") + state.q, stroke: one ? "#c0392b" : colour, width: 1.5, dash: [6, 4] });
  });
  const size = { width: Math.max(320, el.clientWidth), height: 320 };
  if (plot) plot.destroy();
  plot = new uPlot(
    {
      ...size,
      tzDate: state.tz === "utc" ? (ts) => uPlot.tzDate(new Date(ts * 1000), "Etc/UTC") : (ts) => new Date(ts * 1000),
      series,
      bands,
      cursor: { drag: { x: true, y: false, setScale: false } },
      // 24-hour times and ISO dates (uPlot's defaults are 12-hour, month/day).
      axes: [
        {
          values: [
            // tick step, label, then the label's second line at a new year/month/day/...
            [86400 * 365, "{YYYY}", null, null, null, null, null, null, 1],
            [86400 * 28, "{MMM}", "\n{YYYY}", null, null, null, null, null, 1],
            [86400, "{MM}-{DD}", "\n{YYYY}", null, null, null, null, null, 1],
            [3600, "{HH}:{mm}", "\n{YYYY}-{MM}-{DD}", null, "\n{MM}-{DD}", null, null, null, 1],
            [60, "{HH}:{mm}", "\n{YYYY}-{MM}-{DD}", null, "\n{MM}-{DD}", null, null, null, 1],
          ],
        },
        {},
      ],
      // The whole range chosen, not just the hours that have data; a zoom changes the range.
      scales: { x: { time: true, min: from, max: to } },
      hooks: {
        setSelect: [
          (u) => {
            if (u.select.width < 2) return;
            const a = u.posToVal(u.select.left, "x");
            const b = u.posToVal(u.select.left + u.select.width, "x");
            u.setSelect({ left: 0, width: 0, top: 0, height: 0 }, false);
            zoom(a, b);
          },
        ],
      },
    },
    data,
    el,
  );
}

// Shows [a, b) (seconds), widened to whole hours, at least one hour.
function zoom(a, b) {
  const from = Math.floor(Math.min(a, b) / 3600) * 3600;
  const to = Math.max(from + 3600, Math.ceil(Math.max(a, b) / 3600) * 3600);
  state.range = "custom";
  state.from = from;
  state.to = to;
  remember();
  loadChart();
}

function localInput(seconds) {
  const d = new Date(seconds * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  if (state.tz === "utc") return d.toISOString().slice(0, 16);
  return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + "T" + pad(d.getHours()) + ":" + pad(d.getMinutes());
}

function parseInput(text) {
  if (!text) return NaN;
  const ms = state.tz === "utc" ? Date.parse(text + ":00Z") : new Date(text).getTime();
  return Math.floor(ms / 1000);
}

function pressed() {
  for (const b of document.querySelectorAll("#ranges button")) b.setAttribute("aria-pressed", String(b.dataset.range === state.range));
  for (const b of document.querySelectorAll("#quantiles button")) b.setAttribute("aria-pressed", String(b.dataset.q === state.q));
  for (const b of document.querySelectorAll("#zones button")) b.setAttribute("aria-pressed", String(b.dataset.tz === state.tz));
}

async function loadChart() {
  pressed();
  const [from, to] = span();
  $("from").value = localInput(from);
  $("to").value = localInput(to);
  if (state.series.length === 0) {
    $("title").textContent = "Choose a series";
    return;
  }
  $("title").textContent = state.series.join(", ");
  try {
    const answers = await Promise.all(
      state.series.map((s) => api("api/v1/buckets?series=" + encodeURIComponent(s) + "&from=" + from + "&to=" + to)),
    );
    const cols = columns(answers);
    draw(cols, from, to);
    renderTable(cols);
    $("drawn").textContent = JSON.stringify({
      series: state.series, range: state.range, from, to, q: state.q, tz: state.tz,
      x: cols.x, per: cols.per,
    });
    const n = answers.reduce((sum, a) => sum + a.buckets.length, 0);
    status(n + " buckets, " + label(from) + " to " + label(to) + (state.tz === "utc" ? " UTC" : " local time"));
  } catch (e) {
    failed(e);
  }
}

$("filter").value = state.filter;
$("filter").addEventListener("input", () => {
  state.filter = $("filter").value;
  remember();
  renderList();
});
for (const b of document.querySelectorAll("#ranges button")) {
  b.addEventListener("click", () => {
    state.range = b.dataset.range;
    remember();
    loadChart();
  });
}
for (const b of document.querySelectorAll("#quantiles button")) {
  b.addEventListener("click", () => {
    state.q = b.dataset.q;
    remember();
    loadChart();
  });
}
for (const b of document.querySelectorAll("#zones button")) {
  b.addEventListener("click", () => {
    state.tz = b.dataset.tz;
    remember();
    loadChart();
  });
}
$("custom").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const from = parseInput($("from").value);
  const to = parseInput($("to").value);
  if (!(from < to)) {
    status("The range must end after it starts.");
    return;
  }
  zoom(from, to);
});
$("refresh").addEventListener("click", () => loadSeries());
$("every").addEventListener("change", () => {
  if (timer) clearInterval(timer);
  const every = Number($("every").value);
  timer = every > 0 ? setInterval(loadSeries, every * 1000) : null;
});
$("token-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value);
  $("token-form").hidden = true;
  loadSeries();
});
window.addEventListener("resize", () => {
  if (plot) plot.setSize({ width: Math.max(320, $("chart").clientWidth), height: 320 });
});
loadSeries();
