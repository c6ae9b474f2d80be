// Line plots on a <canvas>, no library: several series over shared x values, nulls as gaps,
// a y axis from 0 in even steps of 1, 2 or 5 times a power of ten (0, 5, 10, 15, 20), a
// legend. Sets canvas.dataset.points to the number of points drawn and canvas.dataset.ticks
// to the axis labels (what the browser tests read).
"use strict";

(function () {
  const COLORS = ["#2f6fde", "#e08a00", "#c0392b", "#1e8e3e"];

  const MAX_STEPS = 4;

  // The y axis for values up to `max`: at most MAX_STEPS steps of a round size (1, 2 or 5
  // times a power of ten), its labels written with the step's decimals.
  function axis(max) {
    if (!(max > 0)) max = 1;
    const rough = max / MAX_STEPS;
    const p = Math.pow(10, Math.floor(Math.log10(rough)));
    let step = 10 * p;
    for (const m of [1, 2, 5]) {
      if (m * p >= rough * (1 - 1e-9)) {
        step = m * p;
        break;
      }
    }
    const numSteps = Math.max(1, Math.ceil(max / step - 1e-9));
    const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
    const labels = [];
    for (let k = 0; k <= numSteps; k++) labels.push((k * step).toFixed(decimals));
    return { ymax: numSteps * step, step, labels };
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
    const { ymax, step, labels } = axis(max);
    const x = (i) => left + (xs.length > 1 ? (i / (xs.length - 1)) * (w - left - right) : 0);
    const y = (v) => top + (1 - v / ymax) * (h - top - bottom);
    ctx.strokeStyle = "#e2e2e6";
    ctx.fillStyle = "#6b6b75";
    labels.forEach((label, k) => {
      const v = k * step;
      ctx.beginPath();
      ctx.moveTo(left, y(v));
      ctx.lineTo(w - right, y(v));
      ctx.stroke();
      ctx.fillText(label, 4, y(v) + 4);
    });
    canvas.dataset.ticks = labels.join(" ");
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

  window.duetPlot = { draw, axis };
})();
