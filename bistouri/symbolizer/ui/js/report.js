/* The self-contained flamegraph.html written by `bistouri record` (bistouri/symbolizer/report.py).
 * Reads the trees and the metadata from the JSON blocks report.py embeds; no network. */
(function () {
  "use strict";
  const B = window.Bistouri;
  const data = (id) => JSON.parse(document.getElementById(id).textContent);
  const trees = data("bistouri-trees");
  const meta = data("bistouri-meta");
  const views = B.VIEW_ORDER.filter((v) => trees[v]).concat(Object.keys(trees).filter((v) => !B.VIEW_ORDER.includes(v)));
  const totals = {};
  for (const v of views) totals[v] = trees[v].value || 0;

  const metaBox = document.getElementById("meta");
  const heading = B.sessionHeading(meta);
  const extra = Object.entries(meta.extra || {});
  metaBox.replaceChildren(heading, B.sessionGrid(meta));
  if (extra.length) {
    metaBox.append(B.el("div", { class: "meta-grid report-extra" }, ...extra.map(([k, v]) =>
      B.el("div", null, B.el("div", { class: "k" }, k), B.el("div", { class: "v mono" }, String(v))))));
  }
  const hashView = new URLSearchParams(location.hash.slice(1)).get("view");
  B.mountFlame(document.getElementById("flame"), {
    views: views,
    totals: totals,
    view: hashView || views.find((v) => totals[v] > 0) || views[0],
    periodNs: meta.period_ns,
    load: (v) => Promise.resolve(trees[v]),
    onState: (st) => history.replaceState(null, "", "#" + new URLSearchParams({ view: st.view }).toString()),
  });
})();
