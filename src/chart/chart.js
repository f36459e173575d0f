// The chart page: the series list with a filter, and for the chosen series the hourly mean with
// the min-max band and p99 over the last 24 hours, 7 or 30 days, from the JSON API
// (/api/v1/series, /api/v1/buckets). The state is in the URL (?series=&range=&filter=), so a
// view can be bookmarked or linked. What was drawn is also in #drawn (JSON) and #rows (a table).
"use strict";

const RANGES = { "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400 };
const TOKEN_KEY = "bucketd-token";
const $ = (id) => document.getElementById(id);

const params = new URLSearchParams(location.search);
const state = {
  series: params.get("series") || "",
  range: RANGES[params.get("range")] ? params.get("range") : "7d",
  filter: params.get("filter") || "",
  names: [],
};
let plot = null;

function status(text) {
  $("status").textContent = text;
}

function remember() {
  const p = new URLSearchParams();
  if (state.series) p.set("series", state.series);
  p.set("range", state.range);
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
    const a = document.createElement("a");
    a.href = "?series=" + encodeURIComponent(name) + "&range=" + state.range;
    a.textContent = name;
    if (name === state.series) a.setAttribute("aria-current", "true");
    a.addEventListener("click", (ev) => {
      ev.preventDefault();
      state.series = name;
      remember();
      renderList();
      loadChart();
    });
    const li = document.createElement("li");
    li.append(a);
    list.append(li);
  }
  status(shown.length + " of " + state.names.length + " series");
}

async function loadSeries() {
  try {
    const body = await api("api/v1/series");
    state.names = body.series.map((s) => s.name);
    renderList();
    if (state.series) await loadChart();
  } catch (e) {
    failed(e);
  }
}

function utc(seconds) {
  return new Date(seconds * 1000).toISOString().slice(0, 16).replace("T", " ");
}

// The columns uPlot draws: bucket starts, with a null point in every gap so that lines break.
function columns(buckets) {
  const cols = { x: [], count: [], mean: [], min: [], max: [], p99: [] };
  let prevEnd = null;
  for (const b of buckets) {
    const start = Date.parse(b.start) / 1000;
    if (prevEnd !== null && start > prevEnd) {
      cols.x.push(prevEnd);
      for (const k of ["count", "mean", "min", "max", "p99"]) cols[k].push(null);
    }
    cols.x.push(start);
    cols.count.push(b.count);
    cols.mean.push(b.mean);
    cols.min.push(b.min);
    cols.max.push(b.max);
    cols.p99.push(b.p99);
    prevEnd = Date.parse(b.end) / 1000;
  }
  return cols;
}

function renderTable(cols) {
  const rows = $("rows");
  rows.replaceChildren();
  cols.x.forEach((x, i) => {
    if (cols.count[i] === null) return;
    const tr = document.createElement("tr");
    for (const v of [utc(x), cols.count[i], cols.mean[i], cols.min[i], cols.max[i], cols.p99[i]]) {
      const td = document.createElement("td");
      td.textContent = v === null ? "" : String(v);
      tr.append(td);
    }
    rows.append(tr);
  });
}

function draw(cols, from, to) {
  const el = $("chart");
  const data = [cols.x, cols.mean, cols.min, cols.max, cols.p99];
  const size = { width: Math.max(320, el.clientWidth), height: 320 };
  if (plot) plot.destroy();
  plot = new uPlot(
    {
      ...size,
      tzDate: (ts) => uPlot.tzDate(new Date(ts * 1000), "Etc/UTC"),
      series: [
        { label: "hour (UTC)" },
        { label: "mean", stroke: "#1f5fa8", width: 2 },
        { label: "min", stroke: "#8fb0d8", width: 1 },
        { label: "max", stroke: "#8fb0d8", width: 1 },
        { label: "p99", stroke: "#c0392b", width: 1.5, dash: [6, 4] },
      ],
      bands: [{ series: [3, 2], fill: "rgba(31, 95, 168, 0.15)" }],
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
      // The whole range chosen, not just the hours that have data.
      scales: { x: { time: true, range: () => [from, to] } },
    },
    data,
    el,
  );
}

async function loadChart() {
  for (const b of document.querySelectorAll("#ranges button")) {
    b.setAttribute("aria-pressed", String(b.dataset.range === state.range));
  }
  if (!state.series) return;
  $("title").textContent = state.series;
  const hour = Math.floor(Date.now() / 3600000) * 3600;
  const to = hour + 3600;
  const from = to - RANGES[state.range];
  try {
    const body = await api(
      "api/v1/buckets?series=" + encodeURIComponent(state.series) + "&from=" + from + "&to=" + to,
    );
    const cols = columns(body.buckets);
    draw(cols, from, to);
    renderTable(cols);
    $("drawn").textContent = JSON.stringify({ series: state.series, range: state.range, from, to, ...cols });
    status(body.buckets.length + " buckets of " + state.series + ", " + utc(from) + " to " + utc(to) + " UTC");
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
    renderList();
    loadChart();
  });
}
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
