/* One session: metadata header, downloads and the interactive flamegraph. */
(function () {
  "use strict";
  const B = window.Bistouri;
  const el = B.el;
  const q = B.query();
  const id = q.get("id");
  const metaBox = document.getElementById("meta");
  const flameBox = document.getElementById("flame");

  const timelineBox = document.getElementById("timeline");
  const PART_LABEL = { all: "Whole session", before: "Before the trigger (onset)", after: "After the trigger" };
  // What the flamegraph and the downloads show: all samples, or those before or after the trigger.
  let part = ["before", "after"].includes(q.get("part")) ? q.get("part") : "all";
  let view = "on_cpu";
  // The state whose samples the flamegraph shows (the episode report's buttons; ?state= of the API).
  const reportBox = document.getElementById("episode-report");
  let state = B.FLAME_STATES.some(([k]) => k === q.get("state")) ? q.get("state") : "all";

  function downloads(view) {
    const base = "/v1/sessions/" + encodeURIComponent(id);
    const p = part === "all" ? "" : part;
    const tag = p ? "." + p : "";
    return el("div", { class: "downloads", id: "downloads" },
      el("span", { class: "k" }, "Download" + (p ? " (" + PART_LABEL[p].toLowerCase() + ")" : "")),
      el("a", { class: "btn", id: "dl-pprof", href: B.apiUrl(base + "/pprof", { part: p }),
        download: id + tag + ".pb.gz" }, "pprof"),
      el("a", { class: "btn", id: "dl-folded", href: B.apiUrl(base + "/folded", { value: view, part: p }),
        download: id + tag + "." + view + ".folded" }, "folded (" + (B.VIEWS[view] || { label: view }).label + ")"),
      el("a", { class: "btn", id: "dl-speedscope", href: B.apiUrl(base + "/speedscope", { part: p }),
        download: id + tag + ".speedscope.json" }, "speedscope"),
      el("a", { class: "btn", id: "dl-json", href: B.apiUrl(base + "/flamegraph", { value: view, part: p }),
        download: id + tag + "." + view + ".json" }, "flamegraph JSON"),
    );
  }

  // Sample totals of a part of the session (episode.before_trigger / after_trigger of the API).
  function partTotals(m, p) {
    const ep = m.episode || {};
    const s = p === "before" ? ep.before_trigger : p === "after" ? ep.after_trigger : m.samples;
    return { on_cpu: (s || {}).on_cpu || 0, off_cpu: (s || {}).off_cpu || 0, off_cpu_ns: (s || {}).off_cpu_ns || 0 };
  }

  function fmtTotals(t, seconds) {
    const rate = seconds > 0 && t.on_cpu ? " (" + B.fmtCount(t.on_cpu / seconds) + "/s)" : "";
    return B.fmtCount(t.on_cpu) + " on-CPU samples" + rate + " · " + B.fmtCount(t.off_cpu) + " off-CPU waits · " +
      B.fmtNs(t.off_cpu_ns) + " blocked";
  }

  // The timeline: the session's span, the trigger instant, the flight recorder's seconds before it
  // (shaded), and the samples on either side. The parts switch the flamegraph.
  function renderTimeline(m, flame) {
    const t = m.trigger || {};
    const manual = t.kind === "manual";
    const span = Math.max(m.duration_ns || 0, 1);
    const preNs = Math.min(Math.round(((m.episode || {}).pre_trigger_s || 0) * 1e9), span);
    const share = preNs / span;
    const before = partTotals(m, "before");
    const after = partTotals(m, "after");
    const hasBefore = preNs > 0 || before.on_cpu + before.off_cpu > 0;
    const trigAt = m.start_ns + preNs;
    const what = manual ? "capture asked" : "PSI trigger";
    const bar = el("div", { class: "tl-bar", id: "tl-bar", role: "img",
      "aria-label": B.fmtNs(preNs) + " before the " + what + ", " + B.fmtNs(span - preNs) + " after it" },
      hasBefore ? el("div", { class: "tl-before", id: "tl-before", style: "width:" + (100 * share).toFixed(3) + "%",
        title: "before the " + what + ": " + B.fmtNs(preNs) + " sampled by the flight recorder" },
        el("span", null, "before the trigger · " + B.fmtNs(preNs))) : null,
      el("div", { class: "tl-after", id: "tl-after", style: "width:" + (100 * (1 - share)).toFixed(3) + "%" },
        el("span", null, "after · " + B.fmtNs(span - preNs))),
      el("div", { class: "tl-trigger", id: "tl-trigger", style: "left:" + (100 * share).toFixed(3) + "%",
        title: what + " at " + B.fmtTime(trigAt) }, el("span", null, manual ? "capture now" : "trigger")));
    // Under the bar: the start, the trigger under its mark (the start itself when nothing came before), the end.
    const trigLabel = what + " " + B.fmtTime(t.time_ns || trigAt);
    const axis = el("div", { class: "tl-axis" },
      el("span", null, hasBefore ? B.fmtTime(m.start_ns) : trigLabel),
      hasBefore ? el("span", { class: "tl-axis-mid", style: "left:" + (100 * share).toFixed(3) + "%" }, trigLabel) : null,
      el("span", null, B.fmtTime(m.start_ns + span)));
    const buttons = ["all", "before", "after"].map((p) => {
      const tot = partTotals(m, p);
      const empty = p !== "all" && tot.on_cpu + tot.off_cpu === 0;
      return el("button", { type: "button", class: "seg-btn" + (p === part ? " active" : ""), id: "part-" + p,
        "data-part": p, disabled: empty ? true : null, "aria-selected": p === part ? "true" : "false",
        onclick: () => setPart(m, flame, p) }, PART_LABEL[p]);
    });
    const counts = el("div", { class: "tl-counts" },
      el("div", { id: "tl-count-before", class: "tl-count-before" }, el("span", { class: "k" }, "Before the trigger"),
        hasBefore ? fmtTotals(before, preNs / 1e9) : "no sample (the flight recorder was off or had nothing)"),
      el("div", { id: "tl-count-after" }, el("span", { class: "k" }, "After the trigger"),
        fmtTotals(after, (span - preNs) / 1e9)));
    const compare = hasBefore && after.on_cpu + after.off_cpu > 0
      ? el("a", { class: "btn", id: "diff-onset", href: "diff.html" + B.qs({ a: id, "a.part": "before", b: id,
        "b.part": "after" }), title: "A = the samples before the trigger, B = those after it" }, "Diff: onset → after")
      : null;
    timelineBox.replaceChildren(
      el("div", { class: "tl-head" }, el("h2", null, "Timeline"),
        el("div", { class: "seg", role: "tablist", "aria-label": "Samples shown" }, ...buttons), compare),
      bar, axis, counts);
    timelineBox.hidden = false;
  }

  function flameLoader(p) {
    return (v) => B.getJson("/v1/sessions/" + encodeURIComponent(id) + "/flamegraph",
      { value: v, part: p === "all" ? "" : p, state: state === "all" ? "" : state });
  }

  // Totals of the shown part in the shown state: the session's own, or the roots of that state's trees.
  async function shownTotals(m) {
    const t = partTotals(m, part);
    if (state === "all") return t;
    const load = flameLoader(part);
    const out = {};
    for (const v of B.VIEW_ORDER) out[v] = t[v] ? ((await load(v)) || {}).value || 0 : 0;
    return out;
  }

  async function setState(m, flame, st) {
    if (st === state) return;
    state = st;
    B.markEpisodeState(reportBox, st);
    saveState(flame.state);  // the URL says what was asked at once, not once the data arrived
    await flame.reload(flameLoader(part), await shownTotals(m));
    view = flame.state.view;
    saveState(flame.state);
  }

  async function setPart(m, flame, p) {
    if (p === part) return;
    part = p;
    for (const b of timelineBox.querySelectorAll("[data-part]")) {
      b.classList.toggle("active", b.dataset.part === p);
      b.setAttribute("aria-selected", b.dataset.part === p ? "true" : "false");
    }
    flame.root.dataset.part = p;
    saveState(flame.state);
    await flame.reload(flameLoader(p), await shownTotals(m));
    view = flame.state.view;
    saveState(flame.state);
  }

  function saveState(st) {
    history.replaceState(null, "", B.qs({ id: id, view: st.view, q: st.search, part: part === "all" ? "" : part,
      state: state === "all" ? "" : state }));
    document.getElementById("downloads").replaceWith(downloads(st.view));
  }

  function renderMeta(m, view) {
    const head = B.sessionHeading(m);
    head.append(
      el("a", { class: "btn", id: "merged-service", href: "merged.html" + B.qs({ service: m.service, host: m.service ? "" : m.host }) },
        "Merged: all " + (m.service ? "of " + m.service : "on " + m.host)),
      el("span", { id: "prev-diff" }));
    metaBox.replaceChildren(head, B.sessionGrid(m), downloads(view));
  }

  // A link to the diff against the previous session of the same service and host, when there is one.
  async function linkPrevious(m) {
    const start = m.start_ns || (m.trigger || {}).time_ns;
    if (!start) return;
    try {
      const res = await B.getJson("/v1/sessions", {
        service: m.service, host: m.host, comm: m.comm, until: String(Math.floor(start / 1e9) - 1), limit: 1,
      });
      const prev = (res.sessions || []).find((p) => p.id !== m.id);
      if (prev) {
        document.getElementById("prev-diff").replaceWith(el("a", {
          class: "btn", id: "prev-diff", href: "diff.html" + B.qs({ a: prev.id, b: m.id }),
          title: "A = " + B.fmtTime(prev.start_ns) + ", B = this session",
        }, "Diff vs previous (" + B.fmtTime(prev.start_ns) + ")"));
      }
    } catch (e) {
      /* optional link: the page works without it */
    }
  }

  async function main() {
    if (!id) {
      B.showError(metaBox, new Error("no session id in the URL (session.html?id=…)"));
      return;
    }
    let m;
    try {
      m = await B.getJson("/v1/sessions/" + encodeURIComponent(id));
    } catch (e) {
      B.showError(metaBox, e);
      return;
    }
    document.title = (m.comm || "session") + " on " + (m.host || "?") + " · bistouri";
    const totals = await shownTotals(m);
    view = q.get("view") || (totals.on_cpu ? "on_cpu" : totals.off_cpu ? "off_cpu" : "on_cpu");
    renderMeta(m, view);
    linkPrevious(m);
    flameBox.dataset.part = part;
    const flame = B.mountFlame(flameBox, {
      views: B.VIEW_ORDER,
      totals: totals,
      view: view,
      search: q.get("q") || "",
      periodNs: m.period_ns,
      load: flameLoader(part),
      onState: saveState,
    });
    flame.root = flameBox;
    renderTimeline(m, flame);
    B.renderEpisodeReport(reportBox, m, state, (st) => setState(m, flame, st));
  }
  main();
})();
