// Line plots on a <canvas>, no library: several series over shared x values, nulls as gaps,
// a y axis from 0 to a rounded maximum, a legend. Sets canvas.dataset.points to the number of
// points drawn (what the browser tests read).
"use strict";

(function () {
  const COLORS = ["#2f6fde", "#e08a00", "#c0392b", "#1e8e3e"];

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  // series: [{label, values}] aligned with xs (epoch seconds)
  function draw(canvas, xs, series) {
    const ctx = canvas.getContext("2d");
    const w = canvas.width;
    const h = canvas.height;
    const left = 48, right = 8, top = 18, bottom = 20;
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    let max = 0;
    for (const s of series) for (const v of s.values) if (v !== null && v > max) max = v;
    const ymax = niceMax(max);
    const x = (i) => left + (xs.length > 1 ? (i / (xs.length - 1)) * (w - left - right) : 0);
    const y = (v) => top + (1 - v / ymax) * (h - top - bottom);
    ctx.strokeStyle = "#e2e2e6";
    ctx.fillStyle = "#6b6b75";
    for (let k = 0; k <= 4; k++) {
      const v = (ymax * k) / 4;
      ctx.beginPath();
      ctx.moveTo(left, y(v));
      ctx.lineTo(w - right, y(v));
      ctx.stroke();
      ctx.fillText(v >= 100 ? v.toFixed(0) : v.toPrecision(2), 4, y(v) + 4);
    }
    ctx.fillText("-5 min", left, h - 4);
    ctx.fillText("now", w - right - 22, h - 4);
    let points = 0;
    series.forEach((s, si) => {
      ctx.strokeStyle = ctx.fillStyle = COLORS[si % COLORS.length];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let pen = false;
      s.values.forEach((v, i) => {
        if (v === null) {
          pen = false;
          return;
        }
        points += 1;
        if (pen) ctx.lineTo(x(i), y(v));
        else ctx.moveTo(x(i), y(v));
        ctx.fillRect(x(i) - 1.5, y(v) - 1.5, 3, 3);
        pen = true;
      });
      ctx.stroke();
      ctx.fillText(s.label, left + 8 + si * 60, 12);
    });
    canvas.dataset.points = String(points);
  }

  window.duetPlot = { draw };
})();
