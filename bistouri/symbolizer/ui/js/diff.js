/* Differential flamegraph: B's profile coloured by how it changed from A.
 * diff.html?a=<id>&b=<id>, or with filters prefixed a./b. (a.service=…&b.since=…). */
(function () {
  "use strict";
  const B = window.Bistouri;
  const el = B.el;
  const q = B.query();
  const metaBox = document.getElementById("meta");
  const flameBox = document.getElementById("flame");

  // A side's samples before or after the trigger only (a.part=before), or all of them.
  const PART_NAME = { before: "before the trigger", after: "after the trigger" };
  function sidePart(side) {
    const p = q.get(side + ".part");
    return PART_NAME[p] ? p : "";
  }

  function sideParams(side) {
    const id = q.get(side);
    const out = id ? { [side]: id } : {};
    if (!id) {
      const f = B.filtersFrom(q, side + ".");
      for (const k of Object.keys(f)) out[side + "." + k] = f[k];
    }
    if (sidePart(side)) out[side + ".part"] = sidePart(side);
    return out;
  }

  async function describe(side) {
    const id = q.get(side);
    const tag = el("span", { class: "side-tag side-" + side }, side.toUpperCase());
    if (!id) {
      const f = B.filtersFrom(q, side + ".");
      return el("div", { class: "side", id: "side-" + side },
        el("div", { class: "side-title" }, tag, "Merged: " + B.describeFilters(f)),
        el("a", { href: "merged.html" + B.qs(f) }, "open merged flamegraph"));
    }
    const m = await B.getJson("/v1/sessions/" + encodeURIComponent(id));
    const t = m.trigger || {};
    const part = sidePart(side);
    const s = (part && (m.episode || {})[part + "_trigger"]) || m.samples || {};
    return el("div", { class: "side", id: "side-" + side },
      el("div", { class: "side-title" }, tag,
        el("a", { href: "session.html" + B.qs({ id: id, part: part }) }, (m.comm || "?") + " on " + (m.host || "?")),
        part ? el("span", { class: "pill side-part" }, PART_NAME[part]) : null,
        B.resourceBadge(t.resource), B.manualBadge(t), B.psiBadges(t)),
      el("div", { class: "dim" }, B.fmtTime(m.start_ns) + " · " + B.fmtNs(m.duration_ns) + " · " +
        B.fmtCount(s.on_cpu || 0) + " on-CPU samples · " + B.fmtCount(s.off_cpu || 0) + " off-CPU waits"));
  }

  function swapUrl() {
    const out = new URLSearchParams();
    for (const [k, v] of q.entries()) {
      if (k === "a" || k.startsWith("a.")) out.set("b" + k.slice(1), v);
      else if (k === "b" || k.startsWith("b.")) out.set("a" + k.slice(1), v);
      else out.set(k, v);
    }
    return "?" + out.toString();
  }

  async function main() {
    const params = Object.assign(sideParams("a"), sideParams("b"));
    const hasA = Object.keys(params).some((k) => k === "a" || k.startsWith("a."));
    const hasB = Object.keys(params).some((k) => k === "b" || k.startsWith("b."));
    if (!hasA || !hasB) {
      metaBox.replaceChildren(el("h1", null, "Differential flamegraph"),
        el("p", { class: "lede" }, "Pick two sessions in the ", el("a", { href: "./" }, "sessions list"),
          " and press “Compare A ↔ B”, or pass filters: diff.html?a.service=api&a.until=…&b.since=…"));
      return;
    }
    let sides;
    try {
      sides = await Promise.all([describe("a"), describe("b")]);
    } catch (e) {
      B.showError(metaBox, e);
      return;
    }
    metaBox.replaceChildren(
      el("div", { class: "meta-head" }, el("h1", null, "Differential flamegraph"),
        el("a", { class: "btn", id: "swap", href: swapUrl(), title: "Swap A and B" }, "Swap A ↔ B")),
      el("p", { class: "lede" }, "Frame widths are B's profile. Red: B spends more there than A; blue: less. " +
        "Values are normalised by each side's total, so sessions of different lengths compare."),
      el("div", { class: "sides" }, ...sides),
    );
    B.mountFlame(flameBox, {
      views: B.VIEW_ORDER,
      view: q.get("view") || "on_cpu",
      search: q.get("q") || "",
      diff: true,
      load: (v) => B.getJson("/v1/diff/flamegraph", Object.assign({ value: v }, params)),
      onState: (st) => {
        const u = new URLSearchParams(q);
        u.set("view", st.view);
        if (st.search) u.set("q", st.search);
        else u.delete("q");
        history.replaceState(null, "", "?" + u.toString());
      },
    });
  }
  main();
})();
