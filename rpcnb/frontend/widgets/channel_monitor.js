// rpcnb channel monitor: the member-by-member matrix, latency over time, and the
// probe's latency-versus-size curve. Plain DOM and SVG; redraws when the kernel pushes
// a new snapshot (the kernel side throttles).

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b"];
const SVG = "http://www.w3.org/2000/svg";

function fmtMs(ms) {
  if (ms === null || ms === undefined) return "–";
  return ms < 1 ? `${ms.toFixed(3)} ms` : ms < 100 ? `${ms.toFixed(2)} ms` : `${ms.toFixed(0)} ms`;
}

function fmtRate(bps) {
  if (!bps) return "–";
  if (bps >= 1e9) return `${(bps / 1e9).toFixed(2)} GB/s`;
  if (bps >= 1e6) return `${(bps / 1e6).toFixed(1)} MB/s`;
  return `${(bps / 1e3).toFixed(0)} KB/s`;
}

function fmtSize(n) {
  const units = [["GB", 2 ** 30], ["MB", 2 ** 20], ["KB", 2 ** 10]];
  for (const [u, s] of units) if (n >= s) return `${+(n / s).toFixed(1)} ${u}`;
  return `${n} B`;
}

function s(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function colorOf(peers, peer) {
  return COLORS[Math.max(0, peers.indexOf(peer)) % COLORS.length];
}

function matrixTable(model) {
  const members = model.get("members");
  const matrix = model.get("matrix");
  const me = model.get("me");
  const table = h("table", { class: "rpcnb-matrix" });
  const head = h("tr", {}, h("th", {}, "from \\ to"));
  for (const b of members) head.append(h("th", {}, b));
  table.append(head);
  for (const a of members) {
    const row = h("tr", {}, h("th", {}, a === me ? `${a} (this kernel)` : a));
    for (const b of members) {
      if (a === b) {
        row.append(h("td", { class: "rpcnb-self" }, "·"));
        continue;
      }
      const c = matrix[`${a}->${b}`] || {};
      const td = h("td", { class: "rpcnb-cell", "data-pair": `${a}->${b}`, title: c.reason || "" },
        h("div", { class: "rpcnb-path" }, `${c.transport || "?"} / ${c.channel || "?"}`),
        c.ucx ? h("div", { class: "rpcnb-path rpcnb-ucx" }, c.ucx) : "",
        h("div", { class: "rpcnb-num" }, `p50 ${fmtMs(c.p50_ms)}`),
        h("div", { class: "rpcnb-num" }, `${fmtRate(c.bytes_per_s)} · ${c.calls || 0} calls`));
      // tensors that took rpcnb's own paths (rpcnb_shm: copied; zero_copy: shared pages)
      const paths = Object.entries(c.paths || {});
      if (paths.length) {
        td.append(h("div", { class: "rpcnb-paths" },
          paths.map(([p, v]) => `${p} ×${v.tensors}`).join(" · ")));
      }
      row.append(td);
    }
    table.append(row);
  }
  return table;
}

function axes(svg, w, hgt, pad, xLabel, yLabel) {
  svg.append(s("line", { x1: pad, y1: hgt - pad, x2: w - 8, y2: hgt - pad, stroke: "#888" }));
  svg.append(s("line", { x1: pad, y1: 8, x2: pad, y2: hgt - pad, stroke: "#888" }));
  const xl = s("text", { x: w - 8, y: hgt - 6, "text-anchor": "end", "font-size": 10 });
  xl.textContent = xLabel;
  const yl = s("text", { x: 4, y: 12, "font-size": 10 });
  yl.textContent = yLabel;
  svg.append(xl, yl);
}

function latencyChart(model) {
  const series = model.get("series");
  const peers = Object.keys(series).sort();
  const w = 420, hgt = 180, pad = 36;
  const svg = s("svg", { width: w, height: hgt, class: "rpcnb-latency" });
  axes(svg, w, hgt, pad, "time →", "ms");
  const all = peers.flatMap((p) => series[p]);
  if (!all.length) {
    const t = s("text", { x: w / 2, y: hgt / 2, "text-anchor": "middle", "font-size": 12 });
    t.textContent = "no calls yet";
    svg.append(t);
    return svg;
  }
  const t0 = Math.min(...all.map((p) => p[0])), t1 = Math.max(...all.map((p) => p[0]), t0 + 1);
  const yMax = Math.max(...all.map((p) => p[1]), 0.001);
  const x = (t) => pad + ((t - t0) / (t1 - t0)) * (w - pad - 12);
  const y = (v) => hgt - pad - (v / yMax) * (hgt - pad - 12);
  const top = s("text", { x: pad + 2, y: 20, "font-size": 10 });
  top.textContent = fmtMs(yMax);
  svg.append(top);
  for (const p of peers) {
    const pts = series[p].map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
    svg.append(s("polyline", { points: pts, fill: "none", stroke: colorOf(peers, p), "stroke-width": 1.5,
      "data-peer": p }));
  }
  return svg;
}

function curveChart(model) {
  const curve = model.get("curve");
  const peers = Object.keys(curve).sort();
  const w = 420, hgt = 180, pad = 36;
  const svg = s("svg", { width: w, height: hgt, class: "rpcnb-curve" });
  axes(svg, w, hgt, pad, "size (log) →", "ms (log)");
  const all = peers.flatMap((p) => curve[p]);
  if (!all.length) {
    const t = s("text", { x: w / 2, y: hgt / 2, "text-anchor": "middle", "font-size": 12 });
    t.textContent = "run %rpc_probe for this curve";
    svg.append(t);
    return svg;
  }
  const lx = all.map((p) => Math.log2(p[0])), ly = all.map((p) => Math.log10(Math.max(p[1], 1e-3)));
  const x0 = Math.min(...lx), x1 = Math.max(...lx, x0 + 1);
  const y0 = Math.min(...ly), y1 = Math.max(...ly, y0 + 0.5);
  const x = (n) => pad + ((Math.log2(n) - x0) / (x1 - x0)) * (w - pad - 12);
  const y = (v) => hgt - pad - ((Math.log10(Math.max(v, 1e-3)) - y0) / (y1 - y0)) * (hgt - pad - 12);
  for (const [n, anchor] of [[2 ** x0, "start"], [2 ** x1, "end"]]) {
    const t = s("text", { x: x(n), y: hgt - pad + 12, "text-anchor": anchor, "font-size": 10 });
    t.textContent = fmtSize(n);
    svg.append(t);
  }
  for (const [v, yy] of [[10 ** y0, hgt - pad - 2], [10 ** y1, 20]]) {
    const t = s("text", { x: pad + 2, y: yy, "font-size": 10 });
    t.textContent = fmtMs(v);
    svg.append(t);
  }
  for (const p of peers) {
    const pts = curve[p];
    svg.append(s("polyline", {
      points: pts.map(([n, ms]) => `${x(n).toFixed(1)},${y(ms).toFixed(1)}`).join(" "),
      fill: "none", stroke: colorOf(peers, p), "stroke-width": 1.5, "data-peer": p,
    }));
    for (const [n, ms, bps, path] of pts) {
      const dot = s("circle", { cx: x(n), cy: y(ms), r: 2.5, fill: colorOf(peers, p) });
      const tip = s("title");
      tip.textContent = `${p}: ${fmtSize(n)} in ${fmtMs(ms)} (${fmtRate(bps)}, ${path})`;
      dot.append(tip);
      svg.append(dot);
    }
  }
  return svg;
}

function legend(peers) {
  const box = h("div", { class: "rpcnb-legend" });
  for (const p of peers) {
    const sw = h("span", { class: "rpcnb-swatch" });
    sw.style.background = colorOf(peers, p);
    box.append(h("span", {}, sw, ` ${p}  `));
  }
  return box;
}

const STYLE = `
.rpcnb-monitor { font: 12px/1.35 var(--jp-ui-font-family, sans-serif); color: var(--jp-ui-font-color1, #222); }
.rpcnb-monitor h4 { margin: 8px 0 4px; font-size: 13px; }
.rpcnb-matrix { border-collapse: collapse; }
.rpcnb-matrix th, .rpcnb-matrix td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
.rpcnb-path { font-weight: 600; }
.rpcnb-num { color: #555; font-variant-numeric: tabular-nums; }
.rpcnb-paths { color: #2a6f2a; font-size: 11px; }
.rpcnb-self { color: #bbb; text-align: center !important; }
.rpcnb-status { margin: 4px 0; }
.rpcnb-status.stopped { color: #a33; }
.rpcnb-charts { display: flex; gap: 16px; flex-wrap: wrap; }
.rpcnb-swatch { display: inline-block; width: 10px; height: 10px; }
`;

function render({ model, el }) {
  const root = h("div", { class: "rpcnb-monitor" });
  const style = h("style");
  style.textContent = STYLE;
  el.append(style, root);

  const draw = () => {
    const status = model.get("status");
    const when = model.get("updated") ? new Date(model.get("updated") * 1000).toLocaleTimeString() : "";
    const peers = [...new Set([...Object.keys(model.get("series")), ...Object.keys(model.get("curve"))])].sort();
    root.replaceChildren(
      h("div", { class: `rpcnb-status ${status === "live" ? "live" : "stopped"}` },
        `channel monitor for ${model.get("me")}: ${status}${when ? ` · updated ${when}` : ""}`),
      h("h4", {}, "Pairs (row sends to column): predicted transport / channel, measured latency and bandwidth"),
      matrixTable(model),
      h("div", { class: "rpcnb-charts" },
        h("div", {}, h("h4", {}, "Latency over time (this kernel's calls)"), latencyChart(model)),
        h("div", {}, h("h4", {}, "Probe: round trip versus size"), curveChart(model))),
      legend(peers),
    );
  };
  draw();
  const events = ["members", "matrix", "series", "curve", "status", "updated"];
  for (const e of events) model.on(`change:${e}`, draw);
  return () => {
    for (const e of events) model.off(`change:${e}`, draw);
  };
}

export default { render };
