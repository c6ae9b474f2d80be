// The cluster dashboard: polls GET /v1/dashboard (behind the API key) every 2 s and draws the
// workers, queues, recent KV transfers, a mixture of experts' expert load, the live plots and the
// planner's last decisions.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const api = window.duetApi;
  const plot = window.duetPlot;
  const POLL_MS = 2000;

  const pct = (v) => (v === null || v === undefined ? "\u2013" : (100 * v).toFixed(1) + "%");
  const num = (v, d) => (v === null || v === undefined ? "\u2013" : Number(v).toFixed(d || 0));
  // Rates to three significant digits: a slow transfer (a busy host) is 0.000512 GB/s, not 0.000.
  const rate = (v) => (v === null || v === undefined ? "\u2013" : Number(v).toPrecision(3));

  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i++;
    }
    return n.toFixed(i ? 1 : 0) + " " + units[i];
  }

  function rows(tableId, items, cells) {
    const body = $(tableId).querySelector("tbody");
    body.replaceChildren();
    for (const item of items) {
      const tr = document.createElement("tr");
      tr.dataset.name = item.name || item.request_id;
      for (const [text, cls] of cells(item)) {
        const td = document.createElement("td");
        td.textContent = text;
        if (cls) td.className = cls;
        tr.appendChild(td);
      }
      body.appendChild(tr);
    }
  }

  function cards(queues) {
    const div = $("queues");
    div.replaceChildren();
    const labels = {
      admitted: "admitted requests",
      admission_queued: "queued at admission",
      engine_running: "running",
      engine_waiting: "waiting",
      prefill_queued_tokens: "prefill queue (tokens)",
      decode_waiting_for_kv: "waiting for KV",
      transfers_in_flight: "transfers in flight",
    };
    for (const [key, label] of Object.entries(labels)) {
      if (!(key in queues)) continue;
      const card = document.createElement("div");
      card.className = "card";
      card.dataset.key = key;
      const l = document.createElement("div");
      l.className = "label";
      l.textContent = label;
      const v = document.createElement("div");
      v.className = "value";
      v.textContent = String(queues[key]);
      card.append(l, v);
      div.appendChild(card);
    }
  }

  const PLANNER_ROWS = 10;

  function planner(p) {
    // p: null while no planner reported to this router (router/planner_log.py).
    $("no-planner").hidden = !!p;
    $("planner").hidden = !p;
    if (!p) return;
    const mode = p.decisions.length && p.decisions[0].dry_run ? " (dry run: logged, not applied)" : "";
    $("planner-updated").textContent =
      "last report " + new Date(p.last_report * 1000).toLocaleTimeString() + mode;
    const size = (d, pool) =>
      d.current[pool] === d.sizes[pool] ? String(d.sizes[pool]) : d.current[pool] + " \u2192 " + d.sizes[pool];
    const items = p.decisions.slice(0, PLANNER_ROWS).map((d, i) => ({ ...d, name: "decision-" + i }));
    rows("planner-decisions", items, (d) => [
      [new Date(d.time * 1000).toLocaleTimeString()],
      [size(d, "prefill"), d.changed.includes("prefill") ? "changed" : ""],
      [size(d, "decode"), d.changed.includes("decode") ? "changed" : ""],
      [["prefill", "decode"].filter((pool) => d.reasons[pool]).map((pool) => pool + ": " + d.reasons[pool]).join("; ")],
    ]);
  }

  function experts(e) {
    // e: null for a dense model; else tokens routed to each expert since start, summed over
    // MoE layers, and the last step's max/mean imbalance (engine/model/expert_load.py).
    $("experts-section").hidden = !e;
    if (!e) return;
    $("expert-imbalance").textContent = "last step's imbalance (max/mean tokens per expert): " + num(e.imbalance, 2);
    const total = e.tokens.reduce((a, b) => a + b, 0);
    const items = e.tokens.map((n, i) => ({ name: "expert-" + i, index: i, tokens: n }));
    rows("experts", items, (x) => [[String(x.index)], [String(x.tokens)], [pct(total ? x.tokens / total : null)]]);
  }

  function render(d) {
    // Aggregated: one engine, no prefill groups and no KV transfers to show.
    const aggregated = d.mode === "aggregated";
    $("prefill-section").hidden = aggregated;
    $("transfers-section").hidden = aggregated;
    $("bandwidth-plot").hidden = aggregated;
    $("decode-title").textContent = aggregated ? "Engine" : "Decode workers";
    $("model").textContent = d.model + " \u00b7 " + d.mode;
    $("updated").textContent = "updated " + new Date(d.time * 1000).toLocaleTimeString();
    cards(d.queues);
    rows("prefill", d.prefill, (p) => [
      [p.name], [p.state, p.state], [String(p.queued_tokens)], [pct(p.kv_usage)],
      [pct(p.prefix_hit_rate)], [String(p.num_cached_blocks)],
    ]);
    rows("decode", d.decode, (w) => [
      [w.name], [w.state, w.state], [String(w.num_running)], [String(w.num_waiting)],
      [String(w.num_waiting_for_kv)], [w.num_streams === undefined ? "\u2013" : String(w.num_streams)],
      [pct(w.load)], [pct(w.kv_usage)],
    ]);
    rows("transfers", d.transfers, (t) => [
      [t.request_id], [t.prefill + " \u2192 " + t.decode],
      [t.reason ? t.status + " (" + t.reason + ")" : t.status, t.status === "failed" ? "unhealthy" : "healthy"],
      [bytes(t.bytes)], [num(t.duration_ms, 2)], [t.status === "done" ? rate(t.gbps) : "\u2013"],
      [t.link_gbps ? rate(t.link_gbps) : "\u2013"],
    ]);
    planner(d.planner);
    experts(d.experts);
    const s = d.series;
    const q = (name) => ["p50", "p90", "p99"].map((p) => ({ label: p, values: s[name + "_" + p + "_ms"] }));
    plot.draw($("plot-ttft"), s.t, q("ttft"));
    plot.draw($("plot-itl"), s.t, q("itl"));
    plot.draw($("plot-throughput"), s.t, [{ label: "tok/s", values: s.tokens_per_s }]);
    plot.draw($("plot-bandwidth"), s.t, [{ label: "GB/s", values: s.transfer_gbps }]);
  }

  async function poll() {
    try {
      render(await api.json("/v1/dashboard"));
      $("error").hidden = true;
    } catch (e) {
      $("error").hidden = false;
      $("error").textContent = "Cannot load the cluster state: " + e.message;
    }
    setTimeout(poll, POLL_MS);
  }

  poll();
})();
