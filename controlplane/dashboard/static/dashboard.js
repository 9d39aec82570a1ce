// specctl dashboard: every page's behaviour, chosen by <body data-page="...">.
//
// The API key lives in sessionStorage (this tab only, gone when it closes) and travels only in the
// Authorization header of same-origin requests: never in a URL, never in a cookie. Pages poll
// their JSON every POLL_MS; every panel says "none yet" instead of breaking when there is no data.
// Text from the API is always set with textContent, never parsed as HTML.
"use strict";

(() => {
  const POLL_MS = 2500;
  const STORE = "specctl.dashboard";
  const NEXT = "specctl.dashboard.next";
  const READ_ROLES = ["admin", "viewer"];
  const page = document.body.dataset.page;
  const statusLine = document.getElementById("status");
  const content = document.getElementById("content");
  const PLOT_CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
  const MARKER_STYLE = {
    drift: { symbol: "triangle-down", color: "#c0392b", name: "drift event" },
    job: { symbol: "square", color: "#2f6fde", name: "realign job" },
    canary: { symbol: "diamond", color: "#c27c0e", name: "canary window" },
    promotion: { symbol: "star", color: "#1f8a4c", name: "promotion" },
    rollback: { symbol: "x", color: "#8e44ad", name: "rollback" },
  };

  // plotly.js is the next deferred script: it has run by DOMContentLoaded. Pages fetch their data
  // before that and wait for it only to draw.
  const plotlyReady = new Promise((resolve, reject) => {
    const check = () => (window.Plotly ? resolve(window.Plotly) : reject(new Error("the chart library did not load")));
    // A deferred script runs while readyState is already "interactive", before DOMContentLoaded.
    if (window.Plotly || document.readyState === "complete") check();
    else document.addEventListener("DOMContentLoaded", check, { once: true });
  });

  // ---- helpers -------------------------------------------------------------------------------

  function session() {
    try {
      return JSON.parse(sessionStorage.getItem(STORE) || "null");
    } catch {
      return null;
    }
  }

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs)) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  // replaceChildren with nested arrays of nodes flattened and null/undefined skipped.
  function fill(node, ...children) {
    node.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined));
    return node;
  }

  const isNum = (x) => typeof x === "number" && Number.isFinite(x);
  const fmt = (x, digits = 3) => (isNum(x) ? x.toFixed(digits) : "—");
  const pct = (x) => (isNum(x) ? `${(100 * x).toFixed(1)}%` : "—");
  const int = (x) => (isNum(x) ? Math.round(x).toLocaleString("en-US") : "—");
  // Plotly reads "YYYY-MM-DD HH:MM:SS" as wall-clock time; axes are labelled UTC.
  const utc = (iso) => (iso ? new Date(iso).toISOString().replace("T", " ").slice(0, 19) : null);
  const when = (iso) => (iso ? `${utc(iso)} UTC` : "—");
  const badge = (text) => el("span", { class: `badge ${String(text).toLowerCase()}`, text });
  const noneYet = (what) => el("p", { class: "none-yet", text: `${what}: none yet` });

  function setStatus(text, isError = false) {
    statusLine.textContent = text;
    statusLine.classList.toggle("error", isError);
  }

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function api(path, options = {}) {
    const me = session();
    const headers = { Accept: "application/json", ...(options.headers || {}) };
    if (me) headers.Authorization = `Bearer ${me.key}`;
    const response = await fetch(path, { ...options, headers, credentials: "omit", cache: "no-store" });
    if (response.status === 401 && page !== "login") {
      sessionStorage.removeItem(STORE);
      location.assign("/dashboard/login");
    }
    const body = await response.json().catch(() => ({}));
    if (!response.ok) throw new ApiError(response.status, (body.error && body.error.message) || response.statusText);
    return body;
  }

  const accountPath = (suffix) => `/v1/accounts/${encodeURIComponent(session().account)}${suffix}`;
  const deploymentPath = (name, suffix = "") =>
    accountPath(`/deployments/${encodeURIComponent(name)}${suffix}`);

  function poll(refresh) {
    const tick = async () => {
      try {
        await refresh();
        setStatus(`Updated ${new Date().toLocaleTimeString()} · refreshes every ${POLL_MS / 1000} s`);
      } catch (error) {
        setStatus(`Could not refresh: ${error.message}`, true);
      } finally {
        window.setTimeout(tick, POLL_MS);
      }
    };
    tick();
  }

  function panel(title, id, wide = false) {
    return el("section", { class: `panel${wide ? " wide" : ""}`, id: `${id}-panel` },
      el("h2", { text: title }),
      el("div", { class: "chart", id: `${id}-chart` }),
      el("div", { id: `${id}-none`, hidden: true }),
      el("div", { id: `${id}-notes` }));
  }

  // Draws a chart, or shows "<what>: none yet" in its place when there is nothing to draw.
  function chart(id, what, traces, layout, hasData) {
    const div = document.getElementById(`${id}-chart`);
    const none = document.getElementById(`${id}-none`);
    if (!hasData) {
      if (div.dataset.drawn) window.Plotly.purge(div);
      delete div.dataset.drawn;
      div.hidden = true;
      fill(none, noneYet(what));
      none.hidden = false;
      return div;
    }
    none.hidden = true;
    div.hidden = false;
    const base = { margin: { l: 56, r: 56, t: 16, b: 44 }, legend: { orientation: "h", y: -0.18 }, hovermode: "closest" };
    window.Plotly.react(div, traces, { ...base, ...layout }, PLOT_CONFIG);
    div.dataset.drawn = "1";
    return div;
  }

  function progressBar(fraction) {
    const value = Math.max(0, Math.min(1, isNum(fraction) ? fraction : 0));
    return el("div", { class: "progress", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": 100,
      "aria-valuenow": Math.round(value * 100) },
    el("div", { class: "bar", style: `width: ${(value * 100).toFixed(1)}%` }),
    el("span", { class: "pct", text: `${Math.round(value * 100)}%` }));
  }

  // ---- shell ---------------------------------------------------------------------------------

  function shell() {
    for (const link of document.querySelectorAll("[data-nav]")) {
      link.classList.toggle("active", link.dataset.nav === page);
    }
    const me = session();
    if (!me) return;
    document.getElementById("who").textContent = `${me.account} · ${me.role}`;
    const logout = document.getElementById("logout");
    logout.hidden = false;
    logout.addEventListener("click", () => {
      sessionStorage.removeItem(STORE);
      location.assign("/dashboard/login");
    });
  }

  // ---- login ---------------------------------------------------------------------------------

  function loginPage() {
    setStatus("Sign in with an API key of role viewer or admin. It is kept in this tab only.");
    const input = el("input", { id: "api-key", type: "password", name: "api-key", autocomplete: "off", required: true });
    const error = el("p", { class: "error", id: "login-error", role: "alert" });
    // method=post: should the script fail, the browser never puts the key in the address bar.
    const form = el("form", { class: "login", method: "post", action: "/dashboard/login" },
      el("label", { for: "api-key", text: "API key" }), input,
      el("button", { type: "submit", id: "sign-in", text: "Sign in" }), error);
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      error.textContent = "";
      const key = input.value.trim();
      try {
        const response = await fetch("/v1/whoami", { headers: { Authorization: `Bearer ${key}` }, credentials: "omit" });
        const who = await response.json().catch(() => ({}));
        if (!response.ok) throw new Error((who.error && who.error.message) || "the key was refused");
        if (!READ_ROLES.includes(who.role)) throw new Error(`a key of role ${who.role} cannot read the dashboard`);
        sessionStorage.setItem(STORE, JSON.stringify({ key, account: who.account, role: who.role }));
        const next = sessionStorage.getItem(NEXT);
        sessionStorage.removeItem(NEXT);
        location.assign(next && next.startsWith("/dashboard") ? next : "/dashboard");
      } catch (failure) {
        error.textContent = `Sign-in failed: ${failure.message}`;
      }
    });
    fill(content, form);
    input.focus();
  }

  // ---- overview ------------------------------------------------------------------------------

  function overviewPage() {
    poll(async () => {
      const data = await api(accountPath("/dashboard/overview"));
      if (!data.deployments.length) {
        fill(content, noneYet("Deployments"));
        return;
      }
      const head = ["Deployment", "Target model", "Mode", "Active drafter", "k", "Requests (1 h)",
        "Hit rate", "Accepted length", "Speed-up (est.)", "Open drift", "Active jobs", ""];
      const rows = data.deployments.map((d) => el("tr", { "data-deployment": d.deployment_id },
        el("td", {}, el("a", { href: `/dashboard/deployments/${encodeURIComponent(d.deployment_id)}`, text: d.deployment_id })),
        el("td", { text: d.target_model }),
        el("td", {}, badge(d.speculation_mode)),
        el("td", { text: d.active_drafter_version === null ? "none yet" : `v${d.active_drafter_version}` }),
        el("td", { class: "num", text: d.k ?? "—" }),
        el("td", { class: "num", text: int(d.requests_last_hour) }),
        el("td", { class: "num hit-rate", text: pct(d.hit_rate) }),
        el("td", { class: "num", text: fmt(d.mean_accepted_length, 2) }),
        el("td", { class: "num", title: `c = ${d.draft_cost_ratio} (${d.draft_cost_source})`, text: isNum(d.speedup_estimate) ? `${d.speedup_estimate.toFixed(2)}x` : "—" }),
        el("td", { class: "num" }, d.open_drift_events ? badge(`${d.open_drift_events} open`) : "0"),
        el("td", { class: "num", text: d.running_jobs }),
        el("td", {}, el("a", { href: `/dashboard/deployments/${encodeURIComponent(d.deployment_id)}/canary`, text: "canary" }))));
      fill(content,
        el("section", { class: "panel" },
          el("table", { id: "deployments" }, el("thead", {}, el("tr", {}, head.map((h) => el("th", { text: h })))),
            el("tbody", {}, rows))),
        el("p", { class: "status", text: `Hit rate and accepted length over the last ${data.current_window_s / 60} minutes. `
          + `Speed-up estimate: Leviathan et al. with the drafter/target step-cost ratio a shadow replay measured, else an assumed ${data.assumed_draft_cost_ratio}.` }));
    });
  }

  // ---- deployment ----------------------------------------------------------------------------

  const RANGE_NAMES = ["1h", "6h", "24h", "7d", "30d"];

  function deploymentName() {
    const parts = location.pathname.split("/");
    return decodeURIComponent(parts[3] || "");
  }

  function spanShapes(markers) {
    const shapes = [];
    for (const m of markers) {
      const style = MARKER_STYLE[m.kind] || MARKER_STYLE.job;
      if (m.end) {
        shapes.push({ type: "rect", xref: "x", yref: "paper", x0: utc(m.at), x1: utc(m.end), y0: 0, y1: 1,
          fillcolor: style.color, opacity: 0.08, line: { width: 0 }, layer: "below" });
      } else {
        shapes.push({ type: "line", xref: "x", yref: "paper", x0: utc(m.at), x1: utc(m.at), y0: 0, y1: 1,
          line: { color: style.color, width: 1.5, dash: "dot" } });
      }
    }
    return shapes;
  }

  function markerTraces(markers, y) {
    const traces = [];
    for (const [kind, style] of Object.entries(MARKER_STYLE)) {
      const mine = markers.filter((m) => m.kind === kind);
      if (!mine.length) continue;
      traces.push({ type: "scatter", mode: "markers", name: style.name, x: mine.map((m) => utc(m.at)),
        y: mine.map(() => y), text: mine.map((m) => m.label), hovertemplate: "%{text}<br>%{x} UTC<extra></extra>",
        marker: { symbol: style.symbol, color: style.color, size: 12, line: { width: 1, color: "#fff" } } });
    }
    return traces;
  }

  function deploymentPage() {
    const name = deploymentName();
    const params = new URLSearchParams(location.search);
    let rangeName = RANGE_NAMES.includes(params.get("range")) ? params.get("range") : "24h";
    const end = params.get("end");
    document.getElementById("page-title").textContent = `Deployment ${name}`;
    document.title = `${name} · specctl`;
    const rangeButtons = RANGE_NAMES.map((r) => el("button", { type: "button", "data-range": r,
      "aria-pressed": String(r === rangeName), text: r,
      onclick: () => {
        rangeName = r;
        params.set("range", r);
        history.replaceState(null, "", `${location.pathname}?${params}`);
        for (const b of rangeButtons) b.setAttribute("aria-pressed", String(b.dataset.range === r));
        refresh().catch((error) => setStatus(error.message, true));
      } }));
    const cards = el("div", { class: "cards", id: "cards" });
    const jobsBox = el("div", { id: "deployment-jobs" });
    const paysBox = el("div", { id: "speculation-pays" });
    const categoriesBox = el("div", { id: "categories" });
    fill(content,
      el("div", { class: "links" },
        el("a", { href: `/dashboard/deployments/${encodeURIComponent(name)}/canary`, text: "Canary" }),
        el("a", { href: `/dashboard/audit?deployment=${encodeURIComponent(name)}`, text: "Promotion history" }),
        el("a", { href: "/dashboard/jobs", text: "All jobs" })),
      cards,
      el("div", { class: "ranges", role: "group", "aria-label": "time range" }, rangeButtons),
      el("div", { class: "grid" },
        panel("Hit rate over time", "hit-rate", true),
        panel("Acceptance by draft position (conditional)", "positions"),
        panel("Latency and throughput", "latency"),
        el("section", { class: "panel", id: "categories-panel" }, el("h2", { text: "Per request category" }), categoriesBox),
        el("section", { class: "panel", id: "speculation-pays-panel" }, el("h2", { text: "Does speculation pay?" }), paysBox),
        panel("Drift detector: statistic vs threshold", "detector"),
        el("section", { class: "panel" }, el("h2", { text: "Jobs" }), jobsBox)));

    async function refresh() {
      const query = new URLSearchParams({ range: rangeName });
      if (end) query.set("end", end);
      // The page's own data first, alone, so that the chart does not wait behind the detector's
      // status (which rebuilds the detector on the server); the rest follows in parallel.
      const view = await api(accountPath(`/dashboard/deployments/${encodeURIComponent(name)}?${query}`));
      await plotlyReady;
      renderCards(cards, view);
      renderHitRate(view);
      renderLatency(view);
      renderCategories(categoriesBox, view);
      const [drift, jobs] = await Promise.all([
        api(deploymentPath(name, "/drift-status")).catch(() => null),
        api(deploymentPath(name, "/jobs?limit=10")).catch(() => ({ jobs: [] })),
      ]);
      api(deploymentPath(name, "/speculation-check"))
        .then((check) => renderSpeculationPays(paysBox, check))
        .catch(() => fill(paysBox, noneYet("Speculation check")));
      renderPositions(view, drift);
      renderDetector(drift);
      renderJobs(jobsBox, jobs.jobs.map((job) => ({ ...job, deployment: name })), { showDeployment: false });
    }
    poll(refresh);
  }

  function renderCards(box, view) {
    const d = view.deployment;
    const card = (label, value) => el("div", { class: "card" }, el("div", { class: "label", text: label }),
      el("div", { class: "value", text: value }));
    fill(box,
      card("Mode", d.speculation_mode),
      card("Active drafter", d.active_drafter_version === null ? "none yet" : `v${d.active_drafter_version}`),
      card("k", d.effective_draft_token_count ?? "—"),
      card(`Hit rate (${view.range.name})`, pct(view.total.hit_rate)),
      card("Accepted length", fmt(view.total.mean_accepted_length, 2)),
      card(`Requests (${view.range.name})`, int(view.total.requests)));
  }

  function renderHitRate(view) {
    const points = view.series.filter((b) => isNum(b.hit_rate));
    const markers = view.markers;
    const traces = [
      { type: "scatter", mode: "lines+markers", name: "hit rate", x: points.map((b) => utc(b.start)),
        y: points.map((b) => b.hit_rate), line: { color: "#2f6fde", width: 2 }, marker: { size: 4 },
        hovertemplate: "%{y:.1%} at %{x} UTC<extra>hit rate</extra>" },
      { type: "scatter", mode: "lines", name: "accepted length", yaxis: "y2",
        x: points.map((b) => utc(b.start)), y: points.map((b) => b.mean_accepted_length),
        line: { color: "#7f8c8d", width: 1, dash: "dot" } },
      ...markerTraces(markers, 1.04),
    ];
    const div = chart("hit-rate", "Acceptance data in this range", traces, {
      xaxis: { title: { text: "UTC" }, type: "date", range: [utc(view.range.start), utc(view.range.end)] },
      yaxis: { title: { text: "hit rate" }, range: [0, 1.08], tickformat: ".0%" },
      yaxis2: { title: { text: "tokens / verify step" }, overlaying: "y", side: "right", rangemode: "tozero", showgrid: false },
      shapes: spanShapes(markers),
      height: 360,
    }, points.length > 0 || markers.length > 0);
    // For people and tests alike: how many buckets and events the chart shows.
    div.dataset.points = String(points.length);
    div.dataset.markers = String(markers.length);
    if (!performance.getEntriesByName("specctl:hit-rate-drawn").length) performance.mark("specctl:hit-rate-drawn");
    const notes = document.getElementById("hit-rate-notes");
    fill(notes,
      points.length || !markers.length ? null : noneYet("Acceptance data in this range"),
      markers.length ? null : noneYet("Drift events, jobs, canaries and promotions in this range"));
  }

  // ---- per request category -----------------------------------------------------------------

  // One row per request category over the page's range. The speed-up is measured against the
  // standing no-speculation share of the same category when it has records; else estimated.
  function renderCategories(box, view) {
    const rows = view.categories || [];
    if (!rows.length) {
      fill(box, noneYet(`Requests in ${view.range.name}`));
      return;
    }
    const speedup = (row) => {
      if (isNum(row.speedup_vs_no_speculation)) return `${row.speedup_vs_no_speculation.toFixed(2)}x`;
      return isNum(row.speedup_estimate) ? `≈${row.speedup_estimate.toFixed(2)}x (est.)` : "—";
    };
    const head = ["Category", "Requests", "Hit rate", "Accepted length", "Speed-up vs no speculation"];
    fill(box,
      el("table", { id: "category-table" },
        el("thead", {}, el("tr", {}, head.map((h, i) => el("th", { class: i ? "num" : "", text: h })))),
        el("tbody", {}, rows.map((row) => el("tr", { "data-category": row.category },
          el("td", { text: row.category === "" ? "(none given)" : row.category }),
          el("td", { class: "num", text: int(row.requests) }),
          el("td", { class: "num hit-rate", text: pct(row.hit_rate) }),
          el("td", { class: "num", text: fmt(row.mean_accepted_length, 2) }),
          el("td", { class: "num speedup", text: speedup(row) }))))),
      el("p", { class: "status", text: `Over ${view.range.name}. Measured speed-ups compare ms per token with `
        + "the no-speculation requests of the same category; (est.) marks Leviathan et al.'s estimate from the hit rate." }));
  }

  function renderPositions(view, drift) {
    const current = view.positions.current || [];
    const detector = drift && drift.detector;
    let baseline = null;
    let baselineName = "";
    if (detector && Array.isArray(detector.baseline_per_position) && detector.baseline_per_position.length) {
      baseline = detector.baseline_per_position;
      baselineName = "baseline (drift detector reference)";
    } else if (view.positions.last_drift_event_baseline) {
      baseline = view.positions.last_drift_event_baseline;
      baselineName = "baseline (last drift event)";
    } else if ((view.positions.range || []).length) {
      baseline = view.positions.range;
      baselineName = `average over ${view.range.name}`;
    }
    const label = (values) => values.map((_, i) => `pos ${i + 1}`);
    const traces = [];
    if (current.length) {
      traces.push({ type: "bar", name: `current (last ${view.positions.current_window_s / 60} min)`, x: label(current),
        y: current, marker: { color: "#2f6fde" } });
    }
    if (baseline && baseline.length) {
      traces.push({ type: "bar", name: baselineName, x: label(baseline), y: baseline, marker: { color: "#b8c4d9" } });
    }
    chart("positions", "Per-position acceptance", traces, {
      barmode: "group", yaxis: { range: [0, 1], tickformat: ".0%", title: { text: "accepted | reached" } }, height: 300,
    }, traces.length > 0);
  }

  function renderLatency(view) {
    const rows = view.series;
    const x = rows.map((b) => utc(b.start));
    const traces = [
      { type: "scatter", mode: "lines", name: "inter-token p50 (ms)", x, y: rows.map((b) => b.inter_token_latency_ms_p50), line: { color: "#2f6fde" } },
      { type: "scatter", mode: "lines", name: "inter-token p95 (ms)", x, y: rows.map((b) => b.inter_token_latency_ms_p95), line: { color: "#c0392b" } },
      { type: "bar", name: "throughput (tokens/s)", x, y: rows.map((b) => b.throughput_tokens_per_s), yaxis: "y2", marker: { color: "rgba(31,138,76,0.25)" } },
    ];
    const hasLatency = rows.some((b) => isNum(b.inter_token_latency_ms_p50) || isNum(b.throughput_tokens_per_s));
    chart("latency", "Latency and throughput in this range", traces, {
      xaxis: { type: "date", range: [utc(view.range.start), utc(view.range.end)] },
      yaxis: { title: { text: "ms per token" }, rangemode: "tozero" },
      yaxis2: { title: { text: "tokens / s" }, overlaying: "y", side: "right", rangemode: "tozero", showgrid: false },
      height: 300,
    }, hasLatency);
  }

  function renderDetector(drift) {
    const detector = drift && drift.detector;
    const ok = detector && isNum(detector.statistic) && isNum(detector.threshold);
    const traces = ok ? [{ type: "bar", orientation: "h", name: "statistic", y: ["detector"], x: [detector.statistic],
      marker: { color: detector.statistic >= detector.threshold ? "#c0392b" : "#2f6fde" },
      hovertemplate: "statistic %{x:.3f}<extra></extra>" }] : [];
    chart("detector", "Detector state (it calibrates on the first requests)", traces, ok ? {
      xaxis: { title: { text: "log scale" }, range: [Math.min(0, detector.statistic), Math.max(detector.threshold, detector.statistic) * 1.15] },
      shapes: [{ type: "line", x0: detector.threshold, x1: detector.threshold, yref: "paper", y0: 0, y1: 1, line: { color: "#c0392b", width: 2, dash: "dash" } }],
      annotations: [{ x: detector.threshold, yref: "paper", y: 1, text: `threshold ${fmt(detector.threshold, 2)}`, showarrow: false, yanchor: "bottom" }],
      height: 160, showlegend: false,
    } : {}, ok);
    const notes = document.getElementById("detector-notes");
    if (!drift) {
      fill(notes, noneYet("Drift status"));
      return;
    }
    const kv = [["open drift events", drift.open_events], ["records examined", int(drift.records_examined)],
      ["updated", when(drift.updated_at)]];
    if (detector) {
      kv.push(["baseline hit rate", pct(detector.baseline_rate)], ["current estimate", pct(detector.current_estimate)],
        ["drop", fmt(detector.drop, 3)], ["in reference window", detector.in_reference_window ? "yes" : "no"],
        ["drift detected", detector.drift_detected ? "yes" : "no"],
        ["armed", detector.armed ? "yes" : "no (an event is open)"],
        ["next alarm not before", detector.next_alarm_not_before ? when(detector.next_alarm_not_before) : "—"]);
    }
    fill(notes, el("dl", { class: "kv" }, kv.map(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })])));
  }

  // ---- does speculation pay -------------------------------------------------------------------

  // The standing test of the live arm against the no-speculation share of the traffic: its
  // verdict, why, per-arm latency, and the last action taken when speculation did not pay.
  function renderSpeculationPays(box, check) {
    const words = { pays: "pays", not_paying: "does not pay", unknown: "not known yet" };
    const arm = (name) => check.arms[name] || {};
    const ms = (x) => (isNum(x) ? `${x.toFixed(2)} ms` : "—");
    const bounds = isNum(check.ratio_low) || isNum(check.ratio_high)
      ? ` (${fmt(check.ratio_low, 3)}–${fmt(check.ratio_high, 3)})` : "";
    const kv = [
      ["verdict", words[check.verdict] || check.verdict],
      ["live / no speculation, ms per token", isNum(check.ratio) ? `${check.ratio.toFixed(3)}x${bounds}` : "—"],
      ["live", `${int(arm("live").requests)} requests · ${ms(arm("live").ms_per_token)}`],
      ["no speculation", `${int(arm("baseline").requests)} requests · ${ms(arm("baseline").ms_per_token)}`],
      ["no-speculation share", pct(check.standing_baseline_share)],
      ["last action", check.action ? `${check.action} at ${when(check.acted_at)}` : "none"],
      ["checked", when(check.checked_at)],
    ];
    fill(box,
      el("p", { class: `pays-verdict ${check.verdict}`, "data-verdict": check.verdict },
        badge(words[check.verdict] || check.verdict)),
      el("p", { class: "status", text: check.reason || "" }),
      el("dl", { class: "kv" }, kv.map(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })])));
  }

  // ---- jobs ----------------------------------------------------------------------------------

  const openLogs = new Set();

  function renderJobs(box, jobs, { showDeployment }) {
    if (!jobs.length) {
      fill(box, noneYet("Jobs"));
      return;
    }
    const admin = session().role === "admin";
    const head = ["Job", ...(showDeployment ? ["Deployment"] : []), "Kind", "State", "Progress", "Message", "Created", ""];
    const rows = jobs.map((job) => {
      const active = job.state === "queued" || job.state === "running";
      const deployment = job.deployment || null;
      let action = null;
      if (admin && active && deployment) {
        action = el("button", { type: "button", class: "danger cancel-job", "data-job-id": job.id, text: "Cancel",
          onclick: async (event) => {
            if (!window.confirm(`Cancel ${job.kind} job #${job.id} of ${deployment}?`)) return;
            event.target.disabled = true;
            try {
              await api(deploymentPath(deployment, `/jobs/${job.id}:cancel`), { method: "POST" });
              setStatus(`Job #${job.id} cancelled`);
            } catch (error) {
              setStatus(`Cancel failed: ${error.message}`, true);
              event.target.disabled = false;
            }
          } });
      }
      const message = el("td", { text: job.progress_message || job.error || "" });
      if (job.log) {
        const details = el("details", { "data-job-id": job.id }, el("summary", { text: "log" }),
          el("pre", { class: "job-log", text: job.log.join("\n") }));
        details.open = openLogs.has(job.id);
        details.addEventListener("toggle", () => (details.open ? openLogs.add(job.id) : openLogs.delete(job.id)));
        message.append(details);
      }
      return el("tr", { "data-job-id": job.id, "data-state": job.state },
        el("td", { text: `#${job.id}` }),
        showDeployment ? el("td", {}, el("a", { href: `/dashboard/deployments/${encodeURIComponent(deployment)}`, text: deployment })) : null,
        el("td", { text: job.kind }),
        el("td", {}, badge(job.state)),
        el("td", {}, progressBar(job.progress)),
        message,
        el("td", { text: when(job.created_at) }),
        el("td", {}, action));
    });
    fill(box, el("table", { class: "jobs" },
      el("thead", {}, el("tr", {}, head.map((h) => el("th", { text: h })))), el("tbody", {}, rows)));
  }

  function jobsPage() {
    const box = el("section", { class: "panel", id: "jobs" });
    fill(content, box);
    poll(async () => {
      const data = await api(accountPath("/dashboard/jobs"));
      renderJobs(box, data.jobs, { showDeployment: true });
    });
  }

  // ---- canary --------------------------------------------------------------------------------

  // A confidence interval in whatever shape the canary service stored: [lo, hi] or {lo, hi}-like.
  function interval(value) {
    if (Array.isArray(value) && value.length === 2 && value.every(isNum)) return value;
    if (value && typeof value === "object") {
      for (const [lo, hi] of [["lo", "hi"], ["low", "high"], ["lower", "upper"], ["ci_low", "ci_high"]]) {
        if (isNum(value[lo]) && isNum(value[hi])) return [value[lo], value[hi]];
      }
      if (value.ci) return interval(value.ci);
    }
    return null;
  }

  function estimate(value) {
    if (isNum(value)) return value;
    if (value && typeof value === "object") {
      for (const key of ["estimate", "mean", "value", "point"]) if (isNum(value[key])) return value[key];
    }
    return null;
  }

  function describeValue(value) {
    const ci = interval(value);
    const est = estimate(value);
    if (ci) return `${est === null ? "" : `${fmt(est, 4)} `}[${fmt(ci[0], 4)}, ${fmt(ci[1], 4)}]`;
    if (est !== null) return Number.isInteger(est) ? est.toLocaleString("en-US") : fmt(est, 4);
    if (value === null || value === undefined) return "—";
    if (typeof value === "object") return JSON.stringify(value);
    return String(value);
  }

  // Every object in the canary's JSON that maps arm names to per-arm figures, with its path.
  function armTables(node, path = "arms", out = []) {
    if (!node || typeof node !== "object" || Array.isArray(node)) return out;
    const values = Object.values(node);
    const perArm = values.length >= 2 && values.every((v) => v && typeof v === "object" && !Array.isArray(v));
    if (perArm && /arms$/.test(path)) out.push({ path, arms: node });
    for (const [key, value] of Object.entries(node)) armTables(value, `${path}.${key}`, out);
    return out;
  }

  // One arm's figures as {"metrics.tokens_per_step": {mean, ci_low, ci_high}, "n": 53, ...}: nested
  // objects are opened until a number, a list or an estimate with its interval.
  function flatten(node, prefix = "", out = {}) {
    for (const [key, value] of Object.entries(node)) {
      const name = prefix ? `${prefix}.${key}` : key;
      const leaf = value === null || typeof value !== "object" || Array.isArray(value) || interval(value) || estimate(value) !== null;
      if (leaf) out[name] = value;
      else flatten(value, name, out);
    }
    return out;
  }

  function armTable({ path, arms: nested }) {
    const arms = Object.fromEntries(Object.entries(nested).map(([arm, figures]) => [arm, flatten(figures)]));
    const names = Object.keys(arms);
    const metrics = [...new Set(names.flatMap((n) => Object.keys(arms[n])))];
    return el("div", { class: "arm-table" }, el("h3", { text: path }),
      el("table", {}, el("thead", {}, el("tr", {}, el("th", { text: "figure" }), names.map((n) => el("th", { class: "num", text: n })))),
        el("tbody", {}, metrics.map((m) => el("tr", {}, el("td", { text: m }),
          names.map((n) => el("td", { class: "num", text: describeValue(arms[n][m]) })))))));
  }

  function ciTraces(tables) {
    // Error bars for every figure that carries an interval, arms side by side.
    const traces = [];
    for (const { path, arms: nested } of tables) {
      const arms = Object.fromEntries(Object.entries(nested).map(([arm, figures]) => [arm, flatten(figures)]));
      const metrics = [...new Set(Object.values(arms).flatMap((a) => Object.keys(a).filter((k) => interval(a[k]))))];
      for (const metric of metrics) {
        const names = Object.keys(arms).filter((n) => interval(arms[n][metric]));
        const ests = names.map((n) => estimate(arms[n][metric]) ?? (interval(arms[n][metric])[0] + interval(arms[n][metric])[1]) / 2);
        traces.push({ type: "scatter", mode: "markers", name: `${path.split(".").slice(-2, -1)[0] || "arms"}: ${metric}`,
          x: names.map((n) => `${n} · ${metric}`), y: ests,
          error_y: { type: "data", symmetric: false, array: names.map((n, i) => interval(arms[n][metric])[1] - ests[i]),
            arrayminus: names.map((n, i) => ests[i] - interval(arms[n][metric])[0]) } });
      }
    }
    return traces;
  }

  function canaryPage() {
    const name = deploymentName();
    document.getElementById("page-title").textContent = `Canary · ${name}`;
    const summary = el("section", { class: "panel wide", id: "canary-summary" });
    const tables = el("section", { class: "panel wide", id: "canary-arms" });
    const history = el("section", { class: "panel wide", id: "canary-history" });
    fill(content,
      el("div", { class: "links" }, el("a", { href: `/dashboard/deployments/${encodeURIComponent(name)}`, text: `Deployment ${name}` })),
      summary, tables,
      el("div", { class: "grid" },
        panel("Hit rate by arm", "arm-hit-rate"), panel("Accepted length by arm", "arm-length"),
        panel("Decode tokens/s by arm", "arm-speed"), panel("Inter-token latency p50 by arm (ms)", "arm-latency"),
        panel("Confidence intervals behind the decision", "arm-ci", true)),
      history);

    poll(async () => {
      const data = await api(accountPath(`/dashboard/deployments/${encodeURIComponent(name)}/canaries`));
      await plotlyReady;
      const newest = data.canaries[0];
      if (!newest) {
        fill(summary, el("h2", { text: "Newest canary" }), noneYet("Canaries"));
        fill(tables, el("h2", { text: "Arms side by side" }), noneYet("Arm figures"));
      } else {
        const kv = [["canary", `#${newest.canary_id}`], ["phase", newest.phase], ["decision", newest.decision || "undecided"],
          ["reason", newest.reason || "—"], ["candidate", newest.candidate_version === null ? "—" : `v${newest.candidate_version}`],
          ["incumbent", newest.incumbent_version === null ? "none" : `v${newest.incumbent_version}`],
          ["routing weights", Object.keys(newest.routing_weights || {}).length ? JSON.stringify(newest.routing_weights) : "none yet"],
          ["started", when(newest.started_at)], ["decided", when(newest.decided_at)]];
        fill(summary, el("h2", {}, "Newest canary ", badge(newest.decision || newest.phase)),
          el("dl", { class: "kv", id: "canary-facts" }, kv.map(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })])));
        const found = armTables(newest.arms || {});
        const scalars = Object.entries(newest.arms || {}).filter(([, v]) => v === null || typeof v !== "object");
        fill(tables, el("h2", { text: "Arms side by side" }),
          found.length ? found.map(armTable) : noneYet("Per-arm figures"),
          scalars.length ? el("dl", { class: "kv" }, scalars.map(([k, v]) => [el("dt", { text: k }), el("dd", { text: describeValue(v) })])) : null,
          el("details", {}, el("summary", { text: "stored JSON" }), el("pre", { text: JSON.stringify(newest.arms, null, 2) })));
        const ci = ciTraces(found);
        chart("arm-ci", "Confidence intervals", ci, { yaxis: { title: { text: "estimate" } }, height: 320 }, ci.length > 0);
      }
      if (!newest) chart("arm-ci", "Confidence intervals", [], {}, false);
      const arms = Object.entries(data.arm_series || {});
      const byArm = (field) => arms.map(([arm, buckets]) => ({ type: "scatter", mode: "lines+markers", name: arm,
        x: buckets.map((b) => utc(b.start)), y: buckets.map((b) => b[field]), marker: { size: 4 } }));
      const xaxis = { type: "date" };  // UTC, like every time on these pages
      chart("arm-hit-rate", "Per-arm traffic in the canary window", byArm("hit_rate"), { xaxis, yaxis: { tickformat: ".0%" }, height: 280 }, arms.length > 0);
      chart("arm-length", "Per-arm traffic in the canary window", byArm("mean_accepted_length"), { xaxis, height: 280 }, arms.length > 0);
      chart("arm-speed", "Per-arm traffic in the canary window", byArm("decode_tokens_per_s"), { xaxis, height: 280 }, arms.length > 0);
      chart("arm-latency", "Per-arm traffic in the canary window", byArm("inter_token_latency_ms_p50"), { xaxis, height: 280 }, arms.length > 0);
      fill(history, el("h2", { text: "All canaries" }), data.canaries.length
        ? el("table", { id: "canaries" }, el("thead", {}, el("tr", {}, ["#", "Candidate", "Incumbent", "Phase", "Decision", "Reason", "Started", "Decided"].map((h) => el("th", { text: h })))),
          el("tbody", {}, data.canaries.map((c) => el("tr", {}, el("td", { text: `#${c.canary_id}` }),
            el("td", { text: c.candidate_version === null ? "—" : `v${c.candidate_version}` }),
            el("td", { text: c.incumbent_version === null ? "none" : `v${c.incumbent_version}` }),
            el("td", {}, badge(c.phase)), el("td", {}, c.decision ? badge(c.decision) : "undecided"),
            el("td", { text: c.reason || "" }), el("td", { text: when(c.started_at) }), el("td", { text: when(c.decided_at) })))))
        : noneYet("Canaries"));
    });
  }

  // ---- audit / promotion history -------------------------------------------------------------

  const DRAFTER_MOVE = /promote|activate|rollback/i;

  function auditTable(entries, id) {
    return el("table", { id }, el("thead", {}, el("tr", {}, ["When", "Actor", "Action", "Resource", "Before → after"].map((h) => el("th", { text: h })))),
      el("tbody", {}, entries.map((e) => el("tr", { "data-action": e.action },
        el("td", { text: when(e.created_at) }), el("td", { text: e.actor }), el("td", {}, badge(e.action)),
        el("td", { text: e.resource }),
        el("td", { text: `${e.before ? JSON.stringify(e.before) : "—"} → ${e.after ? JSON.stringify(e.after) : "—"}` })))));
  }

  function auditPage() {
    const params = new URLSearchParams(location.search);
    const chosen = params.get("deployment") || "";
    const picker = el("select", { id: "deployment-picker", "aria-label": "deployment",
      onchange: (event) => {
        const value = event.target.value;
        location.assign(value ? `/dashboard/audit?deployment=${encodeURIComponent(value)}` : "/dashboard/audit");
      } }, el("option", { value: "", text: "all deployments" }));
    const moves = el("section", { class: "panel", id: "promotions" });
    const versions = el("section", { class: "panel", id: "versions" });
    const all = el("section", { class: "panel", id: "audit" });
    fill(content, el("p", {}, "Deployment: ", picker), moves, chosen ? versions : null, all);
    api(accountPath("/deployments")).then((data) => {
      for (const d of data.deployments) {
        picker.append(el("option", { value: d.deployment_id, text: d.deployment_id, selected: d.deployment_id === chosen }));
      }
    }).catch(() => {});
    poll(async () => {
      const query = new URLSearchParams({ limit: "200" });
      if (chosen) query.set("deployment", chosen);
      const [audit, history] = await Promise.all([
        api(accountPath(`/audit?${query}`)),
        chosen ? api(accountPath(`/dashboard/deployments/${encodeURIComponent(chosen)}/promotions`)) : null,
      ]);
      const drafterMoves = history ? history.moves : audit.entries.filter((e) => DRAFTER_MOVE.test(e.action));
      fill(moves, el("h2", { text: "Promotions and rollbacks" }),
        drafterMoves.length ? auditTable(drafterMoves, "promotion-history") : noneYet("Promotions and rollbacks"));
      if (history) {
        fill(versions, el("h2", { text: "Drafter versions" }), history.versions.length
          ? el("table", {}, el("thead", {}, el("tr", {}, ["Version", "State", "Created", "Activated", "Training job"].map((h) => el("th", { text: h })))),
            el("tbody", {}, history.versions.map((v) => el("tr", {}, el("td", { text: `v${v.version}` }), el("td", {}, badge(v.state)),
              el("td", { text: when(v.created_at) }), el("td", { text: when(v.activated_at) }),
              el("td", { text: v.training_job_id === null ? "—" : `#${v.training_job_id}` })))))
          : noneYet("Drafter versions"));
      }
      fill(all, el("h2", { text: "Every change" }), audit.entries.length ? auditTable(audit.entries, "audit-log") : noneYet("Audit entries"));
    });
  }

  // ---- start ---------------------------------------------------------------------------------

  const PAGES = { login: loginPage, overview: overviewPage, deployment: deploymentPage, canary: canaryPage, jobs: jobsPage, audit: auditPage };

  function start() {
    if (page !== "login" && !session()) {
      sessionStorage.setItem(NEXT, location.pathname + location.search);
      location.assign("/dashboard/login");
      return;
    }
    shell();
    plotlyReady.catch((error) => setStatus(`${error.message}`, true));
    PAGES[page]();
  }

  start();
})();
