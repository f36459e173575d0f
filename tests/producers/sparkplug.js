// Sparkplug B as Eclipse Tahu's Node.js client publishes it (issue 54): an edge node and one
// device, births with aliases and datatypes, then data by alias only; after the test restarts
// bucketd (stdin "go"), one data message bucketd cannot name (it forgot the births), the
// rebirth it asks for (NCMD Node Control/Rebirth), and more data.
//
// Prints JSON lines: {"reading": [series, ts_ns, value]} for every reading bucketd must store,
// {"rejected": reason} for each metric it must count instead (a string: not_numeric; the probe's
// metrics: unknown_alias), and {"phase": name}.
//
// Usage: node sparkplug.js <host> <port> <group> <now in ms>

const sparkplug = require("sparkplug-client");
const readline = require("readline");

const [host, port, group, nowArg] = process.argv.slice(2);
const now = Number(nowArg);
const hour = Math.floor(now / 3600000) * 3600000 - 3600000;
const node = "edge1";
const device = "pump";
const out = (o) => process.stdout.write(JSON.stringify(o) + "\n");
const client = sparkplug.newClient({
  serverUrl: `tcp://${host}:${port}`,
  username: "",
  password: "",
  groupId: group,
  edgeNode: node,
  clientId: `tahu-${group}`,
  version: "spBv1.0",
});

let t = hour;
const next = () => (t += 1500);
let step = 0;
const nodeSensor = `${group}:${node}`;
const deviceSensor = `${group}:${node}:${device}`;
const record = (sensor, name, ts, value) => out({ reading: [`${sensor}/${name}`, ts * 1e6, value] });

// The node's metrics: name, alias, type, and a value for step i.
const nodeMetrics = [
  ["Inputs/Temp", 1, "Double", (i) => 20 + i * 0.25],
  ["Counter", 2, "Int64", (i) => 1000000 + i],
  ["Running", 3, "Boolean", (i) => i % 2 === 0],
  ["Small", 4, "Int8", (i) => -100 + i],
  ["Status", 5, "String", (i) => `ok ${i}`],
];
const deviceMetrics = [
  ["rpm", 10, "UInt32", (i) => 900 + 7 * i],
  ["pressure", 11, "Float", (i) => 1.1 + i / 8],
];
const numeric = (type, v) => (type === "Boolean" ? (v ? 1 : 0) : type === "Float" ? Math.fround(v) : v);

function births() {
  const ts = next();
  const i = step++;
  client.publishNodeBirth({
    timestamp: ts,
    metrics: [
      { name: "Node Control/Rebirth", type: "Boolean", value: false },
      ...nodeMetrics.map(([name, alias, type, f]) => ({ name, alias, type, value: f(i), timestamp: ts })),
    ],
  });
  client.publishDeviceBirth(device, {
    timestamp: ts,
    metrics: deviceMetrics.map(([name, alias, type, f]) => ({ name, alias, type, value: f(i), timestamp: ts })),
  });
  // Each birth marks its node or device online (bucketd's `sparkplug.online`).
  record(nodeSensor, "sparkplug.online", ts, 1);
  record(deviceSensor, "sparkplug.online", ts, 1);
  for (const [name, , type, f] of nodeMetrics) {
    if (type === "String") out({ rejected: "not_numeric" });
    else record(nodeSensor, name.replace(/\//g, "."), ts, numeric(type, f(i)));
  }
  for (const [name, , type, f] of deviceMetrics) record(deviceSensor, name, ts, numeric(type, f(i)));
}

// Data by alias only (no names), as an edge node sends once it has been born.
function data(count) {
  for (let k = 0; k < count; k++) {
    const ts = next();
    const i = step++;
    client.publishNodeData({
      timestamp: ts,
      metrics: nodeMetrics.map(([, alias, type, f]) => ({ alias, type, value: f(i), timestamp: ts })),
    });
    client.publishDeviceData(device, {
      timestamp: ts,
      metrics: deviceMetrics.map(([, alias, type, f]) => ({ alias, type, value: f(i), timestamp: ts })),
    });
    for (const [name, , type, f] of nodeMetrics) {
      if (type === "String") out({ rejected: "not_numeric" });
      else record(nodeSensor, name.replace(/\//g, "."), ts, numeric(type, f(i)));
    }
    for (const [name, , type, f] of deviceMetrics) record(deviceSensor, name, ts, numeric(type, f(i)));
  }
}

let phase = "born";
client.on("birth", () => {
  if (phase !== "born") return; // a reconnect: nothing to do in this script
  births();
  data(20);
  phase = "waiting";
  out({ phase: "sent" });
});

client.on("ncmd", (payload) => {
  const rebirth = (payload.metrics || []).find((m) => m.name === "Node Control/Rebirth" && m.value === true);
  if (!rebirth) return;
  out({ phase: "rebirth asked" });
  births();
  data(20);
  out({ phase: "done" });
});

// "go": bucketd was restarted and has forgotten the births: a data message it cannot name.
readline.createInterface({ input: process.stdin }).on("line", (line) => {
  if (line.trim() !== "go") return;
  const ts = next();
  const i = step++;
  client.publishNodeData({
    timestamp: ts,
    metrics: nodeMetrics.map(([, alias, type, f]) => ({ alias, type, value: f(i), timestamp: ts })),
  });
  for (let k = 0; k < nodeMetrics.length; k++) out({ rejected: "unknown_alias" });
  out({ phase: "probed" });
});
