// gpu-slice slice map: renders /slicemap/api/status. Every piece of cluster text (pod names, reasons)
// is set with textContent, never as markup: pod names are written by tenants.
"use strict";
(function () {
  const API = "slicemap/api/status";
  const REFRESH_MS = 5000;
  const SVG = "http://www.w3.org/2000/svg";
  let colourBy = "pod";
  let last = null;
  let timer = null;

  function token() {
    const hash = new URLSearchParams(location.hash.slice(1));
    if (hash.get("token")) {
      sessionStorage.setItem("gpuSliceToken", hash.get("token"));
      history.replaceState(null, "", location.pathname + location.search);
    }
    return sessionStorage.getItem("gpuSliceToken") || "";
  }

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  function svg(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    return e;
  }

  function hue(text) {
    let h = 2166136261;
    for (let i = 0; i < text.length; i++) { h ^= text.charCodeAt(i); h = Math.imul(h, 16777619); }
    return ((h >>> 0) % 360);
  }

  // Hues a golden angle apart for the pods (or namespaces) on the map, in name order, so neighbours
  // differ; a name not in the palette (between refreshes) falls back to a hash of itself.
  let palette = new Map();

  function keyOf(holder) {
    return colourBy === "namespace" ? holder.pod.split("/")[0] : holder.pod;
  }

  function makePalette(data) {
    const keys = new Set();
    for (const n of data.nodes) for (const g of n.gpus) for (const u of g.units) for (const h of u.holders) {
      keys.add(keyOf(h));
    }
    palette = new Map([...keys].sort().map((k, i) => [k, [Math.round((i * 137.508) % 360), i % 2 ? 50 : 66]]));
  }

  function colour(holder) {
    const key = keyOf(holder);
    const [h, light] = palette.has(key) ? palette.get(key) : [hue(key), 60];
    return "hsl(" + h + ", 62%, " + (holder.source === "reserved" ? 85 : light) + "%)";
  }

  function shortName(pod) {
    const name = pod.split("/").slice(1).join("/") || pod;
    return name.length > 14 ? name.slice(0, 13) + "…" : name;
  }

  // One GPU: its compute slices left to right; each block is a MIG instance, an MPS pod's slices,
  // a whole GPU, or free (white; pink when no known pod shape can use it).
  function gpuBlocks(gpu, S) {
    const total = gpu.mode === "mig" ? 7 : gpu.slices;
    const blocks = [];
    if (gpu.mode === "mig") {
      const units = gpu.units.slice().sort((a, b) => a.start - b.start);
      for (const u of units) {
        const h = u.holders[0];
        blocks.push({ width: u.slices, holder: h || null, label: u.profile, free: h ? 0 : u.slices,
                      stranded: u.stranded > 0, unit: u });
      }
      const used = units.reduce((s, u) => s + u.slices, 0);
      if (used < total) blocks.push({ width: total - used, holder: null, label: "no instance", empty: true });
    } else {
      const u = gpu.units[0];
      for (const h of u.holders) blocks.push({ width: h.slices, holder: h, label: "", unit: u });
      if (u.free > 0) {
        const ok = u.free - u.stranded;
        if (ok > 0) blocks.push({ width: ok, holder: null, label: "free", free: ok, unit: u });
        if (u.stranded > 0) blocks.push({ width: u.stranded, holder: null, label: "stranded", stranded: true, unit: u });
      }
    }
    return { total: Math.max(total, 1), blocks };
  }

  function drawGpu(gpu, S, legend) {
    const card = el("div", null, "gpu");
    card.dataset.gpu = gpu.uuid;
    if (!gpu.healthy || gpu.cordoned) card.classList.add("down");
    const state = !gpu.healthy ? " · unhealthy" : gpu.cordoned ? " · cordoned" : "";
    card.appendChild(el("div", "GPU " + gpu.index + " · " + gpu.product + " · " + gpu.mode + state, "gpu-title"));
    const W = 300, H = 46;
    const pic = svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img" });
    const { total, blocks } = gpuBlocks(gpu, S);
    let x = 0;
    for (const b of blocks) {
      const w = (b.width / total) * (W - 2);
      const g = svg("g");
      const fill = b.holder ? colour(b.holder) : b.empty ? "#e7e9ef" : b.stranded ? "var(--stranded)" : "#ffffff";
      const r = svg("rect", { x: 1 + x, y: 1, width: Math.max(w - 2, 1), height: H - 2, rx: 4, fill: fill,
                              stroke: "#98a1b3", "stroke-width": 1 });
      g.appendChild(r);
      const tip = svg("title");
      if (b.holder) {
        g.dataset.pod = b.holder.pod;
        g.dataset.source = b.holder.source;
        tip.textContent = b.holder.pod + " · " + b.holder.slices + " slice(s)" +
          (b.holder.source === "reserved" ? " (reserved)" : "") + (b.unit && b.unit.profile ? " · " + b.unit.profile : "");
        legend.set(colourBy === "namespace" ? b.holder.pod.split("/")[0] : b.holder.pod, colour(b.holder));
      } else {
        tip.textContent = (b.label || "free") + " · " + b.width + " slice(s)";
      }
      g.appendChild(tip);
      // A label only where it fits (about 6.5 px a character at 11 px), cut short otherwise.
      let text = b.holder ? shortName(b.holder.pod) : b.label;
      const room = Math.floor((w - 8) / 6.5);
      if (text && text.length > room) text = room >= 4 ? text.slice(0, room - 1) + "…" : "";
      if (text) {
        const t = svg("text", { x: 1 + x + w / 2, y: H / 2 + 4, "text-anchor": "middle", "font-size": 11,
                                fill: b.holder ? "#10131a" : "#6b7385" });
        t.textContent = text;
        g.appendChild(t);
      }
      pic.appendChild(g);
      x += w;
    }
    card.appendChild(pic);
    return card;
  }

  function chip(label, value, warn) {
    const c = el("span", null, "chip" + (warn ? " warn" : ""));
    c.appendChild(el("b", value));
    c.appendChild(document.createTextNode(" " + label));
    return c;
  }

  function render(data) {
    last = data;
    const S = data.slicesPerGpu || 7;
    const cap = data.capacity;
    const totals = document.getElementById("totals");
    totals.replaceChildren(chip("GPUs", cap.gpus), chip("slices", cap.slices), chip("held", cap.held),
      chip("free", cap.free), chip("stranded", cap.stranded, cap.stranded > 0),
      chip("unavailable", cap.unavailable, cap.unavailable > 0), chip("pending", data.pending.length,
      data.pending.length > 0));
    document.getElementById("gpu-count").textContent = "(" + cap.gpus + " GPUs on " + data.nodes.length + " nodes)";
    makePalette(data);
    const legend = new Map();
    const nodes = document.getElementById("nodes");
    nodes.replaceChildren();
    for (const n of data.nodes) {
      const box = el("div", null, "node");
      box.dataset.node = n.name;
      box.appendChild(el("div", n.name + (n.product ? " · " + n.product : ""), "node-title"));
      if (n.error) box.appendChild(el("div", n.error, "node-error"));
      const row = el("div", null, "gpus");
      for (const g of n.gpus) row.appendChild(drawGpu(g, S, legend));
      box.appendChild(row);
      nodes.appendChild(box);
    }
    const lg = document.getElementById("legend");
    lg.replaceChildren();
    for (const [name, fill] of [...legend.entries()].sort()) {
      const item = el("span");
      const sw = el("span", null, "swatch");
      sw.style.background = fill;
      item.appendChild(sw);
      item.appendChild(document.createTextNode(name));
      lg.appendChild(item);
    }
    const body = document.querySelector("#pending tbody");
    body.replaceChildren();
    for (const p of data.pending) {
      const tr = el("tr");
      tr.dataset.pending = p.pod;
      const sug = p.suggestions.length ? p.suggestions[0].text : "—";
      for (const [v, cls] of [[p.pod], [p.slices, "num"], [p.memory || "—"], [p.isolation || "—"],
                              [p.priority, "num"], [p.reason], [sug]]) tr.appendChild(el("td", v, cls));
      body.appendChild(tr);
    }
    if (!data.pending.length) {
      const tr = el("tr");
      const td = el("td", "none", "muted");
      td.colSpan = 7;
      tr.appendChild(td);
      body.appendChild(tr);
    }
    document.getElementById("pending-count").textContent = "(" + data.pending.length + ")";
    const dis = document.querySelector("#disagreements tbody");
    dis.replaceChildren();
    for (const d of data.disagreements) {
      const tr = el("tr");
      for (const v of [d.pod, d.node, d.assigned.join(", "), d.allocated.join(", ")]) tr.appendChild(el("td", v));
      dis.appendChild(tr);
    }
    document.getElementById("disagreements-section").hidden = data.disagreements.length === 0;
    const probs = document.getElementById("problems");
    probs.replaceChildren(...data.problems.map((p) => el("li", p)));
    document.getElementById("problems-section").hidden = data.problems.length === 0;
    const when = new Date(data.time);
    document.getElementById("updated").textContent = "updated " + when.toLocaleTimeString() +
      (data.ready ? "" : " · extender not synced yet");
    document.getElementById("map").hidden = false;
    document.getElementById("login").hidden = true;
    document.getElementById("error").hidden = true;
    document.body.dataset.loaded = "1";
  }

  async function refresh() {
    clearTimeout(timer);
    const t = token();
    try {
      const resp = await fetch(API, { headers: t ? { Authorization: "Bearer " + t } : {}, cache: "no-store" });
      if (resp.status === 401 || resp.status === 403) {
        const why = (await resp.json().catch(() => ({}))).error || resp.statusText;
        if (resp.status === 401 || t) sessionStorage.removeItem("gpuSliceToken");
        document.getElementById("login-why").textContent = why;
        document.getElementById("login").hidden = false;
        document.getElementById("map").hidden = true;
        document.getElementById("updated").textContent = "not signed in";
        return;
      }
      if (!resp.ok) throw new Error(resp.status + " " + ((await resp.json().catch(() => ({}))).error || resp.statusText));
      render(await resp.json());
    } catch (err) {
      const e = document.getElementById("error");
      e.textContent = "cannot load the slice map: " + err.message;
      e.hidden = false;
    }
    timer = setTimeout(refresh, REFRESH_MS);
  }

  function setColour(by) {
    colourBy = by;
    document.getElementById("by-pod").classList.toggle("on", by === "pod");
    document.getElementById("by-namespace").classList.toggle("on", by === "namespace");
    if (last) render(last);
  }

  document.addEventListener("DOMContentLoaded", () => {
    document.getElementById("by-pod").addEventListener("click", () => setColour("pod"));
    document.getElementById("by-namespace").addEventListener("click", () => setColour("namespace"));
    document.getElementById("use-token").addEventListener("click", () => {
      const v = document.getElementById("token").value.trim();
      if (v) sessionStorage.setItem("gpuSliceToken", v);
      document.getElementById("token").value = "";
      refresh();
    });
    refresh();
  });
})();
