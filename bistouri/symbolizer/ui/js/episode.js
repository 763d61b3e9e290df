/* The episode report of a session: victims' time by state (a stacked bar per thread), the
 * aggressor cgroups, and the state whose flamegraph is shown (episode.victims / aggressors of
 * GET /v1/sessions/{id}; ?state= of the profile reads). */
(function (global) {
  "use strict";
  const B = global.Bistouri;
  const el = B.el;

  // Bar segments, in order: the states of a thread's time, each with its share of the bar.
  B.EPISODE_STATES = [
    { key: "on_cpu", label: "On-CPU", get: (v) => v.on_cpu_ns },
    { key: "runqueue", label: "Run-queue", get: (v) => v.runqueue_ns },
    { key: "D", label: "Blocked D", get: (v) => (v.blocked_ns || {}).D || 0 },
    { key: "S", label: "Blocked S", get: (v) => (v.blocked_ns || {}).S || 0 },
  ];
  // Flamegraph states: the API's state= values (wire.WAIT_NAMES, plus "all" and "on_cpu").
  B.FLAME_STATES = [
    ["all", "All"], ["on_cpu", "On-CPU"], ["runqueue", "Run-queue wait"], ["D", "Blocked D"],
    ["S", "Blocked S"], ["reclaim", "Reclaim"],
  ];

  function victimRow(v, widest) {
    const total = B.EPISODE_STATES.reduce((n, s) => n + s.get(v), 0);
    const segs = B.EPISODE_STATES.map((s) => {
      const ns = s.get(v);
      if (!ns) return null;
      return el("div", { class: "ep-seg ep-" + s.key, "data-state": s.key,
        style: "width:" + (100 * ns / widest).toFixed(3) + "%", title: s.label + ": " + B.fmtNs(ns) });
    });
    return el("tr", { "data-tid": String(v.tid) },
      el("td", { class: "ep-thread" }, v.comm + " ", el("span", { class: "muted" }, "pid " + v.pid + " tid " + v.tid)),
      el("td", { class: "ep-bar-cell" }, el("div", { class: "ep-bar", role: "img",
        "aria-label": B.EPISODE_STATES.map((s) => s.label + " " + B.fmtNs(s.get(v))).join(", ") }, ...segs)),
      el("td", { class: "num" }, B.fmtNs(total)),
      el("td", { class: "num" }, B.fmtNs(v.runqueue_ns + ((v.blocked_ns || {}).D || 0) + v.reclaim_ns)),
      el("td", { class: "num" }, v.reclaim_ns ? B.fmtNs(v.reclaim_ns) : "–"));
  }

  function bytes(n) {
    if (!n) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }

  function aggressorRow(a, rank) {
    return el("tr", { "data-cgroup": a.cgroup },
      el("td", { class: "num" }, String(rank + 1)),
      el("td", { class: "ep-cgroup" }, a.cgroup),
      el("td", { class: "num" }, a.cpu_ns ? B.fmtNs(a.cpu_ns) : "–"),
      el("td", { class: "num" }, bytes(a.io_bytes)),
      el("td", { class: "num" }, a.io_ops ? B.fmtCount(a.io_ops) : "–"),
      el("td", { class: "num" }, bytes(a.memory_bytes)),
      el("td", { class: "num" }, bytes(a.reclaim_bytes)));
  }

  /* Fill `box` with the report of session `m`; `onState(state)` switches the flamegraph. */
  B.renderEpisodeReport = function (box, m, state, onState) {
    const ep = m.episode || {};
    const victims = ep.victims || [];
    const aggressors = ep.aggressors || [];
    if (!victims.length && !aggressors.length) {
      box.hidden = true;
      return;
    }
    const widest = Math.max(1, ...victims.map((v) => B.EPISODE_STATES.reduce((n, s) => n + s.get(v), 0)));
    const legend = el("div", { class: "ep-legend" }, ...B.EPISODE_STATES.map((s) =>
      el("span", null, el("i", { class: "ep-seg ep-" + s.key }), s.label)));
    const buttons = B.FLAME_STATES.map(([key, label]) => el("button", {
      type: "button", class: "seg-btn" + (key === state ? " active" : ""), id: "state-" + key, "data-state": key,
      "aria-selected": key === state ? "true" : "false", onclick: () => onState(key) }, label));
    box.replaceChildren(
      el("div", { class: "tl-head" }, el("h2", null, "Who waited, and who used the machine"),
        el("div", { class: "seg", role: "tablist", "aria-label": "Flamegraph of one state" }, ...buttons)),
      el("h3", null, "Victims: time by state"), legend,
      el("table", { class: "ep-table", id: "ep-victims" },
        el("thead", null, el("tr", null, el("th", null, "Thread"), el("th", null, "Time by state"),
          el("th", { class: "num" }, "Total"), el("th", { class: "num", title: "run-queue + D + reclaim" }, "Stalled"),
          el("th", { class: "num" }, "Reclaim"))),
        el("tbody", null, ...victims.map((v) => victimRow(v, widest)))),
      el("h3", null, "Aggressors: cgroups ranked by " + ((m.trigger || {}).resource || "cpu")),
      el("table", { class: "ep-table", id: "ep-aggressors" },
        el("thead", null, el("tr", null, el("th", { class: "num" }, "#"), el("th", null, "Cgroup"),
          el("th", { class: "num" }, "CPU"), el("th", { class: "num" }, "I/O"), el("th", { class: "num" }, "I/O ops"),
          el("th", { class: "num" }, "Memory growth"), el("th", { class: "num" }, "Reclaimed"))),
        el("tbody", null, ...aggressors.map(aggressorRow))));
    box.hidden = false;
  };

  B.markEpisodeState = function (box, state) {
    for (const b of box.querySelectorAll("[data-state].seg-btn")) {
      b.classList.toggle("active", b.dataset.state === state);
      b.setAttribute("aria-selected", b.dataset.state === state ? "true" : "false");
    }
  };
})(window);
