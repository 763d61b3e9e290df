/* Merged flamegraph over a filter (service, host, resource, comm, since, until). */
(function () {
  "use strict";
  const B = window.Bistouri;
  const el = B.el;
  const q = B.query();
  const filters = B.filtersFrom(q);
  const metaBox = document.getElementById("meta");
  const flameBox = document.getElementById("flame");

  function downloads(view) {
    return el("div", { class: "downloads", id: "downloads" },
      el("span", { class: "k" }, "Download"),
      el("a", { class: "btn", href: B.apiUrl("/v1/profile/pprof", filters), download: "merged.pb.gz" }, "pprof"),
      el("a", { class: "btn", href: B.apiUrl("/v1/profile/folded", Object.assign({ value: view }, filters)),
        download: "merged." + view + ".folded" }, "folded (" + (B.VIEWS[view] || { label: view }).label + ")"),
      el("a", { class: "btn", href: B.apiUrl("/v1/profile/speedscope", filters), download: "merged.speedscope.json" },
        "speedscope"),
    );
  }

  async function main() {
    const view = q.get("view") || "on_cpu";
    metaBox.replaceChildren(
      el("div", { class: "meta-head" },
        el("h1", null, "Merged flamegraph", el("span", { class: "sub" }, " · " + B.describeFilters(filters))),
        el("span", { class: "pill", id: "session-count" }, "…"),
        el("a", { class: "btn", href: "./" + B.qs(filters) }, "Sessions of this filter")),
      el("p", { class: "lede" }, "Every session that matches the filter, merged into one profile."),
      downloads(view),
    );
    try {
      const res = await B.getJson("/v1/sessions", Object.assign({ limit: 1 }, filters));
      const n = res.total !== undefined ? res.total : (res.sessions || []).length;
      document.getElementById("session-count").textContent = B.fmtCount(n) + " session" + (n === 1 ? "" : "s");
    } catch (e) {
      B.showError(metaBox, e);
      return;
    }
    B.mountFlame(flameBox, {
      views: B.VIEW_ORDER,
      view: view,
      search: q.get("q") || "",
      load: (v) => B.getJson("/v1/profile/flamegraph", Object.assign({ value: v }, filters)),
      onState: (st) => {
        history.replaceState(null, "", B.qs(Object.assign({}, filters, { view: st.view, q: st.search })));
        document.getElementById("downloads").replaceWith(downloads(st.view));
      },
    });
  }
  main();
})();
