/* One session: metadata header, downloads and the interactive flamegraph. */
(function () {
  "use strict";
  const B = window.Bistouri;
  const el = B.el;
  const q = B.query();
  const id = q.get("id");
  const metaBox = document.getElementById("meta");
  const flameBox = document.getElementById("flame");

  function downloads(view) {
    const base = "/v1/sessions/" + encodeURIComponent(id);
    return el("div", { class: "downloads", id: "downloads" },
      el("span", { class: "k" }, "Download"),
      el("a", { class: "btn", id: "dl-pprof", href: B.apiUrl(base + "/pprof"), download: id + ".pb.gz" }, "pprof"),
      el("a", { class: "btn", id: "dl-folded", href: B.apiUrl(base + "/folded", { value: view }),
        download: id + "." + view + ".folded" }, "folded (" + (B.VIEWS[view] || { label: view }).label + ")"),
      el("a", { class: "btn", id: "dl-speedscope", href: B.apiUrl(base + "/speedscope"),
        download: id + ".speedscope.json" }, "speedscope"),
      el("a", { class: "btn", id: "dl-json", href: B.apiUrl(base + "/flamegraph", { value: view }),
        download: id + "." + view + ".json" }, "flamegraph JSON"),
    );
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
    const s = m.samples || {};
    const view = q.get("view") || (s.on_cpu ? "on_cpu" : s.off_cpu ? "off_cpu" : "on_cpu");
    renderMeta(m, view);
    linkPrevious(m);
    B.mountFlame(flameBox, {
      views: B.VIEW_ORDER,
      totals: { on_cpu: s.on_cpu || 0, off_cpu: s.off_cpu || 0, off_cpu_ns: s.off_cpu_ns || 0 },
      view: view,
      search: q.get("q") || "",
      periodNs: m.period_ns,
      load: (v) => B.getJson("/v1/sessions/" + encodeURIComponent(id) + "/flamegraph", { value: v }),
      onState: (st) => {
        history.replaceState(null, "", B.qs({ id: id, view: st.view, q: st.search }));
        document.getElementById("downloads").replaceWith(downloads(st.view));
      },
    });
  }
  main();
})();
