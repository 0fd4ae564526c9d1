// autodidact view: the page, drawn in the browser from the JSON API (docs/viewer.md).
//
// Plain JavaScript, no build step. Routes live in the URL hash (#/run/0, #/groups/0?outcome=mixed,
// #/group/0/<id>, #/tokens/0/<id>/<traj>, #/tasks/0, #/compare?runs=0,1), so every view is a
// link. Every element is made with el(), which sets text as text nodes: nothing the API returns
// (model outputs hold "<", quotes...) ever goes through innerHTML. The one piece of state is `app`.
"use strict";

(() => {
  const POLL_MS = 2000;
  const PER_PAGE = 50;
  const LONG_TEXT = 400; // observations longer than this start collapsed
  const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
    "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"];
  const DASHES = [[], [6, 4], [2, 3], [10, 3, 2, 3]];
  const X_LABELS = { update: "learner update", version: "policy version", wall: "seconds" };
  const NO_VALUE = "#d0d0d0"; // a generated token without a value in the chosen mode

  const app = {
    runs: [], // /api/runs
    gen: 0, // bumped on every route change: an answer for an older route is dropped
    charts: [], // {chart, holder, key}: the uPlot charts on the page
    poll: null, // the current view's refresh, or null
    timer: null,
  };

  // --- DOM helpers --------------------------------------------------------------------------

  function el(tag, attrs, ...kids) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "style") Object.assign(node.style, value);
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const kid of kids.flat(Infinity)) {
      if (kid === null || kid === undefined || kid === false) continue;
      node.append(kid instanceof Node ? kid : String(kid));
    }
    return node;
  }

  const $ = (sel, root = document) => root.querySelector(sel);
  const main = () => $("#main");

  function showError(message) {
    const box = $("#error");
    box.textContent = message;
    box.hidden = false;
  }

  function clearError() {
    const box = $("#error");
    box.textContent = "";
    box.hidden = true;
  }

  function table(headers, rows, attrs) {
    return el("table", attrs || {},
      el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
      el("tbody", {}, rows));
  }

  function select(id, choices, value, onchange) {
    // a value from a link that is none of the choices (an exploration id as origin) stays shown
    const all = value && !choices.some(([v]) => v === value) ? [...choices, [value, value]]
      : choices;
    const node = el("select", { id, onchange },
      all.map(([v, label]) => el("option", { value: v }, label)));
    node.value = value || "";
    return node;
  }

  function bar(fraction) {
    const share = Number.isFinite(fraction) ? Math.max(0, Math.min(1, fraction)) : 0;
    return el("span", { class: "bar" }, el("span", { style: { width: `${100 * share}%` } }));
  }

  // --- formatting ----------------------------------------------------------------------------

  const isNum = (x) => typeof x === "number" && Number.isFinite(x);

  function num(x, digits = 3) {
    if (!isNum(x)) return "–";
    if (Number.isInteger(x)) return String(x);
    return Math.abs(x) >= 1000 ? x.toFixed(0) : String(Number(x.toPrecision(digits)));
  }

  const pct = (x) => (isNum(x) ? `${(100 * x).toFixed(1)}%` : "–");
  const yesNo = (x) => (x === null || x === undefined ? "–" : x ? "yes" : "no");
  const signed = (x) => (isNum(x) ? (x > 0 ? "+" : "") + x.toFixed(3) : "–");
  const interval = (ci) => (Array.isArray(ci) && ci.length === 2
    ? `${pct(ci[0])} to ${pct(ci[1])}` : "–");

  function clock(date) {
    return date.toTimeString().slice(0, 8);
  }

  function when(unixSeconds) {
    if (!isNum(unixSeconds)) return "–";
    const d = new Date(unixSeconds * 1000);
    const pad = (n) => String(n).padStart(2, "0");
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${clock(d)}`;
  }

  // --- the API -------------------------------------------------------------------------------

  async function api(path) {
    let resp;
    try {
      resp = await fetch(path, { cache: "no-store" });
    } catch (err) {
      throw new Error(`the viewer server does not answer (${path}); is it still running?`);
    }
    let body = null;
    try {
      body = await resp.json();
    } catch (err) {
      body = null;
    }
    if (!resp.ok) {
      throw new Error((body && body.error) || `${path}: ${resp.status} ${resp.statusText}`);
    }
    if (body === null) throw new Error(`${path} did not answer JSON`);
    return body;
  }

  function query(params) {
    const kept = Object.entries(params).filter(([, v]) => v !== "" && v !== null && v !== undefined);
    const text = new URLSearchParams(kept).toString();
    return text ? `?${text}` : "";
  }

  // --- routes --------------------------------------------------------------------------------

  function parseHash() {
    const raw = location.hash.replace(/^#\/?/, "");
    const cut = raw.indexOf("?");
    const path = cut < 0 ? raw : raw.slice(0, cut);
    const params = new URLSearchParams(cut < 0 ? "" : raw.slice(cut + 1));
    const parts = path.split("/").filter(Boolean).map(decodePart);
    return { view: parts[0] || "run", args: parts.slice(1), params };
  }

  function decodePart(part) {
    try {
      return decodeURIComponent(part);
    } catch (err) {
      return part; // a stray "%": taken as written
    }
  }

  function link(view, args, params) {
    const path = [view, ...args.map((a) => encodeURIComponent(String(a)))].join("/");
    return `#/${path}${query(params || {})}`;
  }

  function runIndex(route) {
    const text = route.args[0] === undefined ? "0" : route.args[0];
    const index = Number(text);
    if (!Number.isInteger(index) || index < 0) throw new Error(`"${text}" is not a run number`);
    if (app.runs.length && index >= app.runs.length) {
      throw new Error(`no run ${index}: this viewer serves runs 0 to ${app.runs.length - 1}`);
    }
    return index;
  }

  function runLabel(index) {
    const run = app.runs[index];
    return run ? run.label : `run ${index}`;
  }

  const VIEWS = {
    run: renderRun,
    groups: renderGroups,
    group: renderGroup,
    tokens: renderTokens,
    tasks: renderTasks,
    compare: renderCompare,
  };

  async function onRoute() {
    stopPolling();
    destroyCharts();
    const gen = ++app.gen;
    delete main().dataset.rendered;
    const route = parseHash();
    clearError();
    updateNav(route);
    const view = VIEWS[route.view];
    if (!view) {
      main().replaceChildren();
      showError(`no page #/${route.view}: use Run, Groups, Tasks or Compare above`);
      main().dataset.rendered = location.hash;
      return;
    }
    main().replaceChildren(el("p", { class: "muted" }, "loading…"));
    try {
      await view(route, gen);
    } catch (err) {
      if (gen !== app.gen) return;
      main().replaceChildren();
      showError(err.message);
    }
    if (gen === app.gen) main().dataset.rendered = location.hash; // drawn: a hook for tests
  }

  const stale = (gen) => gen !== app.gen;

  function updateNav(route) {
    let run = 0;
    try {
      run = route.view === "compare" ? Number($("#run-picker").value || 0) : runIndex(route);
    } catch (err) {
      run = 0;
    }
    for (const a of document.querySelectorAll("#nav a")) {
      const view = a.dataset.view;
      a.href = view === "compare" ? "#/compare" : link(view, [run]);
      const active = view === route.view
        || (view === "groups" && ["group", "tokens"].includes(route.view));
      a.classList.toggle("active", active);
    }
    $("#run-picker").value = String(run);
    $("#run-picker-label").hidden = app.runs.length < 2 || route.view === "compare";
  }

  function fillRunPicker() {
    const picker = $("#run-picker");
    picker.replaceChildren(...app.runs.map((r) => el("option", { value: r.index }, r.label)));
    // Another run: the same list view of it (a group or a rollout of one run is not in another).
    picker.addEventListener("change", () => {
      const { view } = parseHash();
      const same = ["run", "groups", "tasks"].includes(view) ? view : "groups";
      location.hash = link(same, [picker.value]);
    });
  }

  // --- polling -------------------------------------------------------------------------------

  // refresh() answers whether to go on polling; polling waits while the tab is hidden.
  function startPolling(refresh) {
    stopPolling();
    app.poll = refresh;
    schedulePoll();
  }

  function schedulePoll() {
    if (!app.poll || app.timer !== null || document.hidden) return;
    app.timer = setTimeout(async () => {
      app.timer = null;
      const refresh = app.poll;
      if (!refresh || document.hidden) return;
      const goOn = await refresh();
      if (goOn && app.poll === refresh) schedulePoll();
      else if (app.poll === refresh) app.poll = null;
    }, POLL_MS);
  }

  function stopPolling() {
    app.poll = null;
    if (app.timer !== null) clearTimeout(app.timer);
    app.timer = null;
  }

  function stamp(finished) {
    const line = $("#last-updated");
    if (line) {
      line.textContent = `updated ${clock(new Date())}`
        + (finished ? " · the run has finished, no more updates" : " · refreshed every 2 s");
    }
  }

  // --- charts --------------------------------------------------------------------------------

  // Lines with different x values on one chart: the union of their x, null where a line has
  // no point (uPlot wants one shared x array).
  function alignLines(lines) {
    const xs = [...new Set(lines.flatMap((l) => l.x))].sort((a, b) => a - b);
    const at = new Map(xs.map((x, i) => [x, i]));
    const ys = lines.map((l) => {
      const col = new Array(xs.length).fill(null);
      l.x.forEach((x, i) => { col[at.get(x)] = isNum(l.y[i]) ? l.y[i] : null; });
      return col;
    });
    return [xs, ...ys];
  }

  // Per-record series over wall time are noisy: drawn as a running mean over n/25 records,
  // as `autodidact report` draws them (autodidact/report.py _running_mean).
  function smoothed(line) {
    const window = line.x_axis === "wall" ? Math.max(1, Math.floor(line.y.length / 25)) : 1;
    if (window <= 1) return { line, note: "" };
    const y = [];
    const kept = [];
    let acc = 0;
    line.y.forEach((v) => {
      if (isNum(v)) {
        kept.push(v);
        acc += v;
        if (kept.length > window) acc -= kept[kept.length - 1 - window];
        y.push(acc / Math.min(kept.length, window));
      } else {
        y.push(null);
      }
    });
    return { line: { ...line, y }, note: ` (mean of ${window})` };
  }

  function drawnPoints(data) {
    return data.slice(1).reduce((n, col) => n + col.filter((v) => v !== null).length, 0);
  }

  // One chart: `series` is [{label, color, dash, line}] over a panel's lines; drawn in
  // `spec.parent` when the spec names one (the Run page's "why" charts), else in `container`.
  function makeChart(container, spec) {
    const holder = el("div", { class: "chart", "data-plot": spec.plot, "data-panel": spec.panel });
    (spec.parent || container).append(holder);
    const data = alignLines(spec.series.map((s) => s.line));
    if (spec.logY) data.slice(1).forEach((col) => col.forEach((v, i) => { if (v !== null && v <= 0) col[i] = null; }));
    const xAxis = spec.series.length ? spec.series[0].line.x_axis : "update";
    const xLabel = X_LABELS[xAxis] || xAxis;
    const opts = {
      title: spec.title,
      width: chartWidth(holder),
      height: 220,
      scales: { x: { time: false }, y: spec.logY ? { distr: 3 } : {} },
      axes: [{ label: xLabel }, { values: (u, ticks) => ticks.map(yTick), size: yAxisSize }],
      series: [{ label: xLabel }, ...spec.series.map((s) => ({
        label: s.label, stroke: s.color, width: 1.5, dash: s.dash, spanGaps: true,
        points: { size: 4 },
      }))],
    };
    const chart = new uPlot(opts, data, holder);
    holder.dataset.points = String(drawnPoints(data));
    app.charts.push({ chart, holder, key: spec.key, logY: spec.logY });
    return chart;
  }

  // uPlot rounds small ticks to "0" (a learning rate of 1e-4): those get an exponent.
  function yTick(v) {
    if (v === null || v === undefined) return "";
    return v !== 0 && Math.abs(v) < 0.01 ? v.toExponential(1) : String(Number(v.toPrecision(6)));
  }

  // Wide enough for the longest tick label (uPlot's default of 50 px cuts "1.0e-4").
  function yAxisSize(u, values) {
    const longest = Math.max(0, ...(values || []).map((v) => String(v).length));
    return Math.max(50, 12 + 7 * longest);
  }

  function chartWidth(holder) {
    return Math.max(280, Math.floor(holder.clientWidth || 480) - 4);
  }

  function destroyCharts() {
    for (const c of app.charts) c.chart.destroy();
    app.charts = [];
  }

  function resizeCharts() {
    for (const c of app.charts) c.chart.setSize({ width: chartWidth(c.holder), height: 220 });
  }

  // The chart specs of one run's plots (run view): one chart per panel, a line per metric;
  // those of "Why RL moved or stalled" (section "why") go in `whyParent` when given.
  function runChartSpecs(curves, whyParent) {
    const specs = [];
    for (const plot of curves.plots || []) {
      (plot.panels || []).forEach((panel, p) => {
        const lines = panel.lines || [];
        specs.push({
          plot: plot.name, panel: p, logY: !!panel.log_y,
          parent: plot.section === "why" ? whyParent : null,
          title: plot.panels.length > 1 ? `${plot.title}: ${panel.ylabel}` : plot.title,
          key: `${plot.name}/${p}/${lines.map((l) => `${l.metric}@${l.x_axis}`).join(",")}`,
          series: lines.map((raw, i) => {
            const { line, note } = smoothed(raw);
            return { label: line.metric + note, color: PALETTE[i % PALETTE.length], dash: [], line };
          }),
        });
      });
    }
    return specs;
  }

  // Several runs on one chart (compare view): colour by run, dash by metric.
  function compareChartSpecs(runs) {
    const byKey = new Map();
    runs.forEach((curves, r) => {
      for (const plot of curves.plots || []) {
        (plot.panels || []).forEach((panel, p) => {
          const key = `${plot.name}/${p}`;
          if (!byKey.has(key)) {
            byKey.set(key, {
              plot: plot.name, panel: p, logY: !!panel.log_y, key, series: [],
              title: plot.panels.length > 1 ? `${plot.title}: ${panel.ylabel}` : plot.title,
            });
          }
          (panel.lines || []).forEach((raw, i) => {
            const { line, note } = smoothed(raw);
            byKey.get(key).series.push({
              label: (panel.lines.length > 1 ? `${curves.label} · ${line.metric}` : curves.label)
                + note,
              color: PALETTE[r % PALETTE.length], dash: DASHES[i % DASHES.length], line,
            });
          });
        });
      }
    });
    return [...byKey.values()];
  }

  function drawCharts(container, specs) {
    destroyCharts();
    container.replaceChildren();
    for (const parent of new Set(specs.map((s) => s.parent).filter(Boolean))) {
      parent.replaceChildren();
    }
    if (!specs.length) container.append(el("p", { class: "muted" }, "no metrics recorded yet"));
    for (const spec of specs) makeChart(container, spec);
  }

  // New data for the same charts: setData in place; anything else: draw them again.
  function updateCharts(container, specs) {
    const same = specs.length === app.charts.length
      && specs.every((s, i) => s.key === app.charts[i].key);
    if (!same) {
      drawCharts(container, specs);
      return;
    }
    specs.forEach((spec, i) => {
      const data = alignLines(spec.series.map((s) => s.line));
      app.charts[i].chart.setData(data);
      app.charts[i].holder.dataset.points = String(drawnPoints(data));
    });
  }

  // --- run -----------------------------------------------------------------------------------

  async function renderRun(route, gen) {
    const run = runIndex(route);
    const [info, curves] = await Promise.all([api(`/api/run?run=${run}`),
      api(`/api/curves?runs=${run}`)]);
    if (stale(gen)) return;
    const summary = el("section", { id: "run-summary" });
    const why = el("section", { id: "why" });
    const charts = el("section", { id: "charts", class: "charts" });
    charts.whyCharts = el("div", { id: "why-charts", class: "charts" });
    main().replaceChildren(
      el("div", { class: "title-row" }, el("h1", {}, info.label || runLabel(run)),
        el("span", { id: "last-updated", class: "muted" })),
      summary, el("h2", {}, "Why RL moved or stalled"), why, charts.whyCharts,
      el("h2", {}, "Curves"), charts);
    const runCurves = firstCurves(curves);
    fillRunSummary(summary, info, runCurves);
    fillWhy(why, runCurves);
    drawCharts(charts, runChartSpecs(runCurves, charts.whyCharts));
    stamp(info.finished);
    if (!info.finished) startPolling(() => refreshRun(run, gen, summary, charts, why));
  }

  // The likely cause (autodidact/diagnosis.py) and the series its charts lack, with why.
  function fillWhy(section, curves) {
    const d = curves.diagnosis || {};
    const missing = curves.missing || [];
    section.replaceChildren(
      el("p", { id: "why-line", "data-cause": d.cause || "" },
        el("strong", {}, d.cause || "unknown"), d.reason ? `: ${d.reason}` : ""),
      missing.length ? el("ul", { class: "notes", id: "why-missing" },
        missing.map((m) => el("li", {}, m))) : null);
  }

  function firstCurves(body) {
    const runs = body.runs || [];
    if (!runs.length) throw new Error("/api/curves answered no run");
    return runs[0];
  }

  async function refreshRun(run, gen, summary, charts, why) {
    try {
      const [info, curves] = await Promise.all([api(`/api/run?run=${run}`),
        api(`/api/curves?runs=${run}`)]);
      if (stale(gen)) return false;
      clearError();
      const runCurves = firstCurves(curves);
      fillRunSummary(summary, info, runCurves);
      fillWhy(why, runCurves);
      updateCharts(charts, runChartSpecs(runCurves, charts.whyCharts));
      stamp(info.finished);
      return !info.finished;
    } catch (err) {
      if (stale(gen)) return false;
      showError(err.message);
      return true; // the server may be restarting: keep asking
    }
  }

  function fillRunSummary(section, info, curves) {
    const perMin = isNum(info.groups_per_min) ? info.groups_per_min
      : isNum(info.groups_per_s) ? 60 * info.groups_per_s : null;
    const facts = [
      ["phase", el("span", { id: "run-phase", class: `phase ${info.finished ? "done" : "live"}` },
        info.phase || "unknown")],
      ["finished", yesNo(info.finished)],
      ["policy version", num(info.version)],
      ["version lag (mean / max)", `${num(info.lag_mean)} / ${num(info.lag_max)}`],
      ["groups/min", num(perMin)],
      ["groups stored", num(info.replay && info.replay.groups)],
      ["uninformative-group share", pct(info.uninformative_share)],
      ["actor success rate", pct(info.actor_success_rate)],
    ];
    section.replaceChildren(
      el("div", { class: "summary-row" },
        el("div", {}, el("h2", {}, "Run"),
          el("dl", { class: "facts" }, facts.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]))),
        el("div", {}, el("h2", {}, "Roles"), rolesTable(info.roles || [])),
        el("div", {}, el("h2", {}, "Held-out success"), heldoutTable(heldoutRows(info, curves)))),
      (info.heldout_envs || []).length ? envsBlock(info.heldout_envs) : null,
      info.task_origins ? originsBlock(info.task_origins) : null,
      info.replay ? el("p", { class: "muted small" }, replayLine(info.replay)) : null,
      (info.notes || []).length
        ? el("ul", { class: "notes" }, info.notes.map((n) => el("li", {}, n))) : null);
  }

  // An env mix: each member env's held-out success and the mean over envs, per split and
  // stage (summary.json through autodidact/status_cli.py heldout_envs); absent for one env.
  function envsBlock(rows) {
    const body = rows.map((h) => el("tr", { "data-env": h.env },
      el("td", {}, h.env), el("td", {}, h.split || "–"),
      el("td", {}, STAGE_NAMES[h.stage] || h.stage), el("td", {}, pct(h.avg)),
      el("td", {}, h.ci ? interval(h.ci) : "–"), el("td", {}, pct(h.best)),
      el("td", {}, num(h.tasks))));
    return el("section", { id: "heldout-envs" },
      el("h2", {}, "Held-out success per env"),
      table(["env", "split", "stage", "avg@k", "95% interval", "best@k", "tasks"], body,
        { id: "heldout-envs-table" }));
  }

  // Training tasks by origin (autodidact/task_origins.py): the same table as report and status.
  function originsBlock(t) {
    const share = t.synthetic_share || {};
    const configured = !isNum(share.configured) ? "–"
      : share.configured < 0 ? "auto (-1)" : num(share.configured);
    const counted = t.error ? t.error : `over ${num(t.groups_counted)} of the `
      + `${num(t.groups_stored)} groups stored${t.complete ? "" : " (still indexing)"}`
      + (t.damaged ? `; ${num(t.damaged)} damaged left out` : "");
    const rows = (t.origins || []).map((r) => el("tr", { "data-origin": r.source },
      el("td", {}, r.origin), el("td", {}, num(r.tasks)), el("td", {}, num(r.groups)),
      el("td", {}, `${pct(r.success)} (${num(r.successes)}/${num(r.rollouts)})`),
      el("td", {}, `${pct(r.informative_share)} (${num(r.informative)}/${num(r.groups)})`)));
    return el("section", { id: "origins" },
      el("h2", {}, "Tasks by origin"),
      table(["origin", "tasks", "groups drawn", "success", "informative groups"], rows,
        { id: "origin-table" }),
      el("p", { class: "muted small" }, `tasks.synthetic_share: configured ${configured}, `
        + `effective ${num(share.effective)}, drawn ${pct(share.drawn)} · ${counted}`));
  }

  function replayLine(replay) {
    const parts = Object.entries(replay).filter(([k, v]) => k !== "source" && isNum(v))
      .map(([k, v]) => `${k.replace(/_/g, " ")} ${/bytes$/.test(k) ? bytes(v) : num(v)}`);
    return `replay (${replay.source || "store"}): ${parts.join(" · ")}`;
  }

  function bytes(n) {
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
    return `${num(n)} ${units[i]}`;
  }

  function rolesTable(roles) {
    return table(["name", "state", "alive", "restarts", "pid"], roles.map((r) => el("tr",
      { class: r.alive ? "alive" : "down" },
      el("td", {}, r.name), el("td", {}, r.state || r.process || "–"),
      el("td", {}, yesNo(r.alive)), el("td", {}, num(r.restarts)), el("td", {}, num(r.pid)))),
    { id: "roles" });
  }

  // Held-out stages with intervals: /api/curves has them; /api/run's stage -> avg otherwise.
  function heldoutRows(info, curves) {
    if (curves && Array.isArray(curves.heldout) && curves.heldout.length) return curves.heldout;
    const summary = info.summary || {};
    return Object.entries(info.heldout || {}).map(([stage, avg]) => ({
      stage, avg, ...(summary[stage] || {}),
    }));
  }

  const STAGE_NAMES = { base: "base model", warm: "after warm-start", rl: "after RL" };

  function heldoutTable(rows, withRun) {
    const headers = [...(withRun ? ["run"] : []), "stage", "success", "95% interval", "tasks",
      "split"];
    const body = rows.map((h) => el("tr", {},
      withRun ? el("td", {}, h.run) : null,
      el("td", {}, STAGE_NAMES[h.stage] || h.stage), el("td", {}, pct(h.avg)),
      el("td", {}, interval(h.ci)), el("td", {}, num(h.tasks)), el("td", {}, h.split || "–")));
    if (!rows.length) {
      body.push(el("tr", {}, el("td", { colspan: headers.length, class: "muted" },
        "no held-out evaluation yet")));
    }
    return table(headers, body, { id: "heldout" });
  }

  // --- groups --------------------------------------------------------------------------------

  const GROUP_FILTERS = ["task", "origin", "outcome", "version", "guided", "judged"];

  function groupFilters(params) {
    const f = {};
    for (const name of GROUP_FILTERS) f[name] = (params.get(name) || "").trim();
    f.page = params.get("page") || "";
    return f;
  }

  async function renderGroups(route, gen) {
    const run = runIndex(route);
    const filters = groupFilters(route.params);
    const body = await api(`/api/groups${query({ run, per_page: PER_PAGE, ...filters })}`);
    if (stale(gen)) return;
    main().replaceChildren(
      el("h1", {}, `Groups · ${runLabel(run)}`),
      groupFilterBar(run, filters),
      el("p", {},
        el("span", { id: "group-total" }, String(body.total)),
        ` groups kept by the filters · ${body.stored} stored, ${body.indexed} indexed`),
      groupTable(run, body.groups || []),
      pager(body, (page) => link("groups", [run], { ...filters, page })));
  }

  function groupFilterBar(run, filters) {
    const go = () => {
      const next = {};
      for (const name of GROUP_FILTERS) next[name] = $(`#f-${name}`).value.trim();
      location.hash = link("groups", [run], next);
    };
    const anyYesNo = [["", "any"], ["yes", "yes"], ["no", "no"]];
    return el("form", { class: "filters", onsubmit: (e) => { e.preventDefault(); go(); } },
      el("label", {}, "task ", el("input", { id: "f-task", type: "search", value: filters.task,
        placeholder: "id or text", onchange: go })),
      el("label", {}, "origin ", select("f-origin", [["", "any"], ["original", "original"],
        ["synthetic", "synthetic"]], filters.origin, go)),
      el("label", {}, "outcome ", select("f-outcome", [["", "any"], ["all_success", "all success"],
        ["all_fail", "all fail"], ["mixed", "mixed"]], filters.outcome, go)),
      el("label", {}, "version ", el("input", { id: "f-version", type: "number", min: 0,
        value: filters.version, class: "narrow", onchange: go })),
      el("label", {}, "guided ", select("f-guided", anyYesNo, filters.guided, go)),
      el("label", {}, "judged ", select("f-judged", anyYesNo, filters.judged, go)),
      el("a", { href: link("groups", [run]) }, "clear"));
  }

  function groupTable(run, groups) {
    const rows = groups.map((g) => el("tr", { class: "group-row", "data-group-id": g.group_id,
      "data-outcome": g.outcome },
      el("td", { class: "nowrap" }, when(g.created)),
      el("td", {}, el("a", { href: link("group", [run, g.group_id]) }, g.group_id.slice(0, 12))),
      el("td", { class: "query" }, el("span", { class: "muted" }, g.task_id), " ", g.query),
      el("td", {}, g.source === "synthetic" ? "synthetic" : "original"),
      el("td", {}, versionSpan(g.min_version, g.max_version)),
      el("td", {}, `${g.successes}/${g.rollouts}`),
      el("td", {}, el("span", { class: `outcome ${g.outcome}` }, (g.outcome || "").replace("_", " "))),
      el("td", {}, g.guided ? `${g.guided}/${g.rollouts}` : "no"),
      el("td", {}, yesNo(g.judged)),
      el("td", {}, groupState(g))));
    if (!rows.length) {
      rows.push(el("tr", {}, el("td", { colspan: 10, class: "muted" }, "no group matches")));
    }
    return table(["finished", "group", "task", "origin", "version", "success", "outcome",
      "guided", "judged", "state"], rows, { id: "group-list" });
  }

  function versionSpan(lo, hi) {
    if (!isNum(lo) || lo < 0) return "–";
    return lo === hi ? String(lo) : `${lo}–${hi}`;
  }

  function groupState(g) {
    if (g.damaged) return `damaged: ${g.damaged}`;
    if (g.set_aside) return "set aside";
    if (g.consumed) return "trained on";
    if (g.delivered) return "delivered";
    return "stored";
  }

  function pager(body, hrefFor) {
    const pages = body.pages || Math.max(1, Math.ceil(body.total / body.per_page));
    return el("p", { class: "pager" },
      body.page > 0 ? el("a", { href: hrefFor(body.page - 1) }, "‹ newer") : null,
      ` page ${body.page + 1} of ${pages} `,
      body.page + 1 < pages ? el("a", { href: hrefFor(body.page + 1) }, "older ›") : null);
  }

  // --- one group -----------------------------------------------------------------------------

  async function renderGroup(route, gen) {
    const run = runIndex(route);
    const groupId = route.args[1];
    if (!groupId) throw new Error("which group? #/group/<run>/<group id>");
    const g = await api(`/api/group/${encodeURIComponent(groupId)}?run=${run}`);
    if (stale(gen)) return;
    main().replaceChildren(
      el("p", {}, el("a", { href: link("groups", [run]) }, "‹ groups")),
      el("h1", {}, `Group ${g.group_id}`),
      taskBlock(g.task || {}),
      groupFlags(g),
      el("div", { class: "rollouts" },
        (g.rollouts || []).map((r) => rolloutColumn(run, g.group_id, r))));
  }

  function taskBlock(task) {
    return el("section", { class: "task" },
      el("p", { class: "query-big" }, task.query),
      el("dl", { class: "facts" },
        el("dt", {}, "task"), el("dd", {}, task.task_id),
        el("dt", {}, "env / split"), el("dd", {}, `${task.env || "–"} / ${task.split || "–"}`),
        el("dt", {}, "source"), el("dd", {}, task.source),
        el("dt", {}, "origin"), el("dd", {}, task.origin || "–"),
        el("dt", {}, "kinds"), el("dd", {}, (task.kinds || []).join(", ") || "–"),
        el("dt", {}, "goal"), el("dd", {}, el("code", {}, JSON.stringify(task.goal))),
        el("dt", {}, "reference"), el("dd", {}, el("code", {},
          (task.reference || []).join(" ; ") || "–"))));
  }

  function groupFlags(g) {
    const rec = g.record || {};
    const flags = ["judged", "delivered", "consumed", "set_aside", "outcome_equal",
      "labels_equal"].map((k) => el("span", { class: `flag ${rec[k] ? "on" : "off"}` },
      `${k.replace("_", " ")}: ${yesNo(rec[k])}`));
    return el("section", { class: "group-flags" },
      el("p", {}, flags),
      el("p", { class: "muted" },
        `actor ${g.actor_id || "–"} · finished ${when(g.created)} · versions `
        + `${versionSpan(rec.min_version, rec.max_version)} · judge ${g.judge ? g.judge.name : "none"}`
        + ` · step advantage: ${g.advantage || "–"}`));
  }

  function rolloutColumn(run, groupId, r) {
    return el("article", { class: `rollout ${r.success ? "success" : "fail"}`,
      "data-traj": r.index },
    el("header", {},
      el("h3", {}, `rollout ${r.index}`, " ",
        el("a", { href: link("tokens", [run, groupId, r.index]), class: "tokens-link" }, "tokens ›")),
      el("p", {}, `reward ${num(r.reward)} · `,
        el("span", { class: r.success ? "ok" : "bad" }, r.success ? "success" : "failure"),
        " · outcome advantage ", advantageSpan(r.advantage)),
      el("p", { class: "muted" }, `${r.experience ? "guided (experience)" : "unguided"} · `
        + `${num(r.tokens)} tokens · versions ${versionSpan(...(r.versions || []))}`)),
    r.experience ? experienceBlock(r.experience) : null,
    (r.turns || []).map(turnBlock));
  }

  function experienceBlock(exp) {
    return el("div", { class: `experience${exp.stripped ? " stripped" : ""}` },
      el("strong", {}, "retrieved experience"),
      exp.stripped ? el("span", { class: "badge" }, "stripped for training") : null,
      el("pre", {}, exp.text || "(no text)"),
      (exp.ids || []).length ? el("p", { class: "muted" }, `ids ${exp.ids.join(", ")}`) : null);
  }

  function advantageSpan(x) {
    const sign = !isNum(x) ? "none" : x > 0 ? "pos" : x < 0 ? "neg" : "zero";
    return el("span", { class: `advantage ${sign}` }, signed(x));
  }

  function turnBlock(t) {
    const label = t.label === 1 ? "GOOD" : t.label === 0 ? "BAD" : "unlabelled";
    const obs = t.observation || "";
    return el("div", { class: `turn${t.valid === false ? " invalid" : ""}`, "data-turn": t.index },
      el("div", { class: "turn-head" },
        el("span", { class: "muted" }, `turn ${t.index}`),
        el("span", { class: `label ${label.toLowerCase()}` }, label),
        " advantage ", advantageSpan(t.advantage)),
      t.thought ? el("pre", { class: "thought" }, t.thought) : null,
      el("pre", { class: "action" }, t.action),
      t.valid === false ? el("p", { class: "bad" }, "invalid action") : null,
      obs.length > LONG_TEXT
        ? el("details", { class: "observation" }, el("summary", {},
          `observation (${obs.length} chars): ${obs.slice(0, 80)}…`), el("pre", {}, obs))
        : el("pre", { class: "observation" }, obs),
      el("p", { class: "reason" }, t.reason || ""));
  }

  // --- tokens --------------------------------------------------------------------------------

  const TOKEN_MODES = [["logprob", "sampler log-prob"], ["version", "policy version"],
    ["ratio", "learner / sampler ratio"]];

  async function renderTokens(route, gen) {
    const run = runIndex(route);
    const [groupId, traj] = [route.args[1], route.args[2]];
    if (!groupId || traj === undefined) throw new Error("which rollout? #/tokens/<run>/<group id>/<rollout>");
    const body = await api(`/api/tokens/${encodeURIComponent(groupId)}/${encodeURIComponent(traj)}?run=${run}`);
    if (stale(gen)) return;
    const mode = route.params.get("mode") || "logprob";
    const box = el("div", { id: "tokens", class: "tokens" });
    const legend = el("div", { id: "token-legend", class: "legend" });
    const draw = (m) => {
      const scale = tokenScale(m, body.tokens || []);
      box.replaceChildren(...tokenSpans(body, scale));
      legend.replaceChildren(...legendItems(scale));
    };
    const picker = select("token-mode", TOKEN_MODES, mode, () => {
      history.replaceState(null, "", link("tokens", [run, groupId, traj], { mode: picker.value }));
      draw(picker.value);
    });
    const learner = body.learner || {};
    main().replaceChildren(
      el("p", {}, el("a", { href: link("group", [run, groupId]) }, "‹ group")),
      el("h1", {}, `Rollout ${body.traj} of group ${body.group_id}`),
      el("p", {}, el("label", {}, "colour by ", picker), " ", legend),
      el("p", { class: "muted" }, `${(body.tokens || []).length} tokens, ${body.prompt_len} in the `
        + "prompt; dotted underline: injected experience. "
        + (learner.seen ? `learner log-probs from version ${learner.version}` : learner.note || "")),
      box);
    draw(picker.value);
  }

  // A colour scale of one mode: value(token) -> number or null; color(value) -> css colour.
  function tokenScale(mode, tokens) {
    if (mode === "version") {
      const vs = tokens.filter((t) => t.generated && t.version >= 0).map((t) => t.version);
      const lo = vs.length ? Math.min(...vs) : 0;
      const hi = vs.length ? Math.max(...vs) : 0;
      const color = (v) => {
        const f = hi > lo ? (v - lo) / (hi - lo) : 1;
        return `hsl(${Math.round(200 + 70 * (1 - f))}, 70%, ${Math.round(88 - 28 * f)}%)`;
      };
      return { mode, value: (t) => (t.version >= 0 ? t.version : null), color,
        stops: [[lo, `v${lo} (oldest)`], [hi, `v${hi} (newest)`]] };
    }
    if (mode === "ratio") {
      const color = (r) => {
        const f = Math.max(-1, Math.min(1, Math.log(r) / Math.LN2));
        return `hsl(${f < 0 ? 0 : 220}, 75%, ${Math.round(96 - 36 * Math.abs(f))}%)`;
      };
      return { mode, value: (t) => (isNum(t.ratio) && t.ratio > 0 ? t.ratio : null), color,
        stops: [[0.5, "≤ 0.5"], [1, "1"], [2, "≥ 2"]] };
    }
    // log-prob from -6 (p 0.0025, red) to 0 (p 1, green): a log scale keeps the unlikely
    // tokens apart, where a linear one in p paints them all red
    const color = (lp) => {
      const f = 1 + Math.max(-6, Math.min(0, lp)) / 6;
      return `hsl(${Math.round(120 * f)}, 70%, 75%)`;
    };
    return { mode, value: (t) => (isNum(t.logprob) ? t.logprob : null), color,
      stops: [[-6, "≤ -6"], [-3, "-3"], [Math.log(0.5), "-0.7 (p ½)"], [0, "0 (p 1)"]] };
  }

  function legendItems(scale) {
    return [...scale.stops.map(([v, label]) => el("span", { class: "swatch",
      style: { backgroundColor: scale.color(v) } }, label)),
    el("span", { class: "swatch", style: { backgroundColor: NO_VALUE } }, "no value"),
    el("span", { class: "swatch plain" }, "not generated")];
  }

  function tokenSpans(body, scale) {
    const [expLo, expHi] = body.experience_span || [0, 0];
    return (body.tokens || []).map((t, i) => {
      const value = t.generated ? scale.value(t) : null;
      const classes = ["tok", t.generated ? "gen" : "plain", i >= expLo && i < expHi ? "in-exp" : ""];
      const style = t.generated
        ? { backgroundColor: value === null ? NO_VALUE : scale.color(value) } : {};
      return el("span", { class: classes.join(" ").trim(), style, title: tokenTitle(i, t) },
        t.text);
    });
  }

  function tokenTitle(i, t) {
    return [`#${i} ${JSON.stringify(t.text)}`, t.generated ? "generated" : "not generated",
      `log-prob ${num(t.logprob, 4)}`, `version ${t.version >= 0 ? t.version : "–"}`,
      `learner log-prob ${num(t.learner_logprob, 4)}`, `ratio ${num(t.ratio, 4)}`].join("\n");
  }

  // --- tasks ---------------------------------------------------------------------------------

  async function renderTasks(route, gen) {
    const run = runIndex(route);
    const filters = { source: route.params.get("source") || "", q: route.params.get("q") || "",
      page: route.params.get("page") || "" };
    const body = await api(`/api/tasks${query({ run, per_page: PER_PAGE, ...filters })}`);
    if (stale(gen)) return;
    const go = () => {
      location.hash = link("tasks", [run], { source: $("#t-source").value,
        q: $("#t-q").value.trim() });
    };
    main().replaceChildren(
      el("h1", {}, `Tasks · ${runLabel(run)}`),
      body.origins ? originsBlock(body.origins) : null,
      el("form", { class: "filters", onsubmit: (e) => { e.preventDefault(); go(); } },
        el("label", {}, "source ", select("t-source", [["", "any"], ["original", "original"],
          ["synthetic", "synthetic"]], filters.source, go)),
        el("label", {}, "text ", el("input", { id: "t-q", type: "search", value: filters.q,
          placeholder: "id or text", onchange: go }))),
      el("p", {}, el("span", { id: "task-total" }, String(body.total)),
        ` tasks · curriculum ${body.curriculum || "–"} · success counted from `
        + `${body.outcomes_from || "–"}`),
      taskTable(body.tasks || []),
      pager(body, (page) => link("tasks", [run], { ...filters, page })),
      coverageBlock(body.coverage || {}));
  }

  function taskTable(tasks) {
    const rows = tasks.map((t) => el("tr", { class: "task-row", "data-task-id": t.task_id },
      el("td", {}, t.task_id), el("td", {}, t.source), el("td", {}, t.origin || "–"),
      el("td", { class: "query" }, t.query),
      el("td", {}, (t.kinds || []).join(", ") || "–"),
      el("td", {}, t.verified ? "verified" : "not verified"),
      el("td", {}, `${num(t.successes)}/${num(t.trials)}`),
      el("td", { class: "rate" }, bar(t.rate), ` ${pct(t.rate)}`),
      el("td", {}, num(t.frontier_weight))));
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 9, class: "muted" }, "no task matches")));
    return table(["task", "source", "origin", "query", "kinds", "verification", "successes/trials",
      "success rate", "frontier weight"], rows, { id: "task-list" });
  }

  function coverageBlock(cov) {
    const tools = Object.entries(cov.tools || {});
    const kinds = Object.entries(cov.kinds || {});
    const maxKind = Math.max(1, ...kinds.map(([, n]) => n));
    return el("section", { id: "coverage" },
      el("h2", {}, "Coverage"),
      el("p", { class: "muted" }, `${num(cov.synthetic_tasks)} self-made tasks in the pool`),
      el("div", { class: "two" },
        el("div", {}, el("h3", {}, "by tool"), tools.length
          ? table(["tool", "share of tasks", "ok calls in exploration"], tools.map(([name, v]) =>
            el("tr", {}, el("td", {}, name),
              el("td", {}, bar(v.task_share), ` ${pct(v.task_share)}`),
              el("td", {}, num(v.ok_calls)))), { class: "coverage-tools" })
          : el("p", { class: "muted" }, "no exploration coverage recorded (no explore stage)")),
        el("div", {}, el("h3", {}, "by kind"), kinds.length
          ? table(["kind", "self-made tasks"], kinds.map(([name, n]) => el("tr", {},
            el("td", {}, name), el("td", {}, bar(n / maxKind), ` ${num(n)}`))),
          { class: "coverage-kinds" })
          : el("p", { class: "muted" }, "no self-made tasks"))));
  }

  // --- compare -------------------------------------------------------------------------------

  async function renderCompare(route, gen) {
    const all = app.runs.map((r) => r.index);
    const asked = (route.params.get("runs") || "").split(",").filter((s) => s !== "").map(Number);
    const chosen = asked.length ? asked.filter((i) => all.includes(i)) : all;
    const boxes = el("form", { class: "filters", id: "compare-runs" }, app.runs.map((r) =>
      el("label", {}, el("input", { type: "checkbox", value: r.index,
        checked: chosen.includes(r.index), onchange: () => {
          const picked = [...document.querySelectorAll("#compare-runs input:checked")]
            .map((c) => c.value);
          location.hash = link("compare", [], { runs: picked.join(",") || "none" });
        } }), ` ${r.label}`)));
    if (!chosen.length) {
      main().replaceChildren(el("h1", {}, "Compare runs"), boxes,
        el("p", { class: "muted" }, "choose at least one run"));
      return;
    }
    // One request per run, so that a run without curves yet leaves the others drawn.
    const answers = await Promise.allSettled(chosen.map((i) => api(`/api/curves?runs=${i}`)));
    if (stale(gen)) return;
    const runs = answers.filter((a) => a.status === "fulfilled").map((a) => firstCurves(a.value));
    const failed = answers.map((a, k) => (a.status === "rejected"
      ? `${runLabel(chosen[k])}: ${a.reason.message}` : null)).filter(Boolean);
    if (failed.length) showError(failed.join("\n"));
    const charts = el("section", { id: "charts", class: "charts" });
    const heldout = runs.flatMap((c) => (c.heldout || []).map((h) => ({ ...h, run: c.label })));
    const causes = el("ul", { id: "why-lines" }, runs.map((c) => el("li", {},
      `${c.label}: `, el("strong", {}, (c.diagnosis || {}).cause || "unknown"),
      (c.diagnosis || {}).reason ? `: ${c.diagnosis.reason}` : "")));
    main().replaceChildren(el("h1", {}, "Compare runs"), boxes,
      el("h2", {}, "Held-out success"), heldoutTable(heldout, true),
      el("h2", {}, "Why RL moved or stalled"), causes,
      el("h2", {}, "Curves"), charts);
    drawCharts(charts, compareChartSpecs(runs));
  }

  // --- start ---------------------------------------------------------------------------------

  async function start() {
    window.addEventListener("error", (e) => showError(`page error: ${e.message}`));
    window.addEventListener("unhandledrejection", (e) => showError(`page error: ${e.reason}`));
    document.addEventListener("visibilitychange", schedulePoll);
    let resizing = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizing);
      resizing = setTimeout(resizeCharts, 150);
    });
    try {
      app.runs = (await api("/api/runs")).runs || [];
    } catch (err) {
      main().replaceChildren();
      showError(err.message);
      return;
    }
    fillRunPicker();
    window.addEventListener("hashchange", onRoute);
    if (!location.hash) history.replaceState(null, "", "#/run/0");
    await onRoute();
  }

  start();
})();
