/* Bistouri UI: the interactive flamegraph, on top of d3-flame-graph.
 *
 * Bistouri.mountFlame(element, options) builds a toolbar (view switch, search,
 * reset zoom, flame/icicle), a legend, a zoom breadcrumb, the chart and a
 * tooltip. Options:
 *   views:    view keys to offer, e.g. ["on_cpu", "off_cpu", "off_cpu_ns"]
 *   totals:   {view: total} — a view whose total is 0 is shown disabled
 *   view:     initial view
 *   load:     async function (view) -> flamegraph tree (the /flamegraph JSON)
 *   diff:     true for a differential tree (nodes carry delta and base)
 *   periodNs: on-CPU sampling period, to show samples as CPU time
 *   search:   initial search term
 *   onState:  function ({view, search}) called when the user changes either
 *
 * The returned object's reload(load, totals) shows another profile in the same
 * views (the session page: the samples before or after the trigger).
 *
 * The tree is d3-flame-graph's format: {name, value, children, kind, file,
 * line, inlined[, module][, delta, base]}, value inclusive of children.
 */
(function (global) {
  "use strict";
  const B = (global.Bistouri = global.Bistouri || {});
  const d3 = global.d3;

  const KIND_LABEL = {
    kernel: "kernel", user: "user", vdso: "vDSO", jit: "JIT", python: "Python", unknown: "unknown", root: "root",
  };

  // Stable small hash of a function name, in [0, 1).
  function hash01(name) {
    let h = 2166136261;
    // Hash the function's base name so that overloads and templates share a colour.
    const base = String(name || "").split("(")[0];
    for (let i = 0; i < base.length; i++) {
      h ^= base.charCodeAt(i);
      h = Math.imul(h, 16777619);
    }
    return ((h >>> 0) % 1000) / 1000;
  }

  // Kernel frames are cool (blue), user frames warm (red→yellow), vDSO violet, JIT
  // code (named by a perf map) green, Python functions teal (between the two), unknown
  // grey. Lightness stays high enough for black labels.
  B.frameColor = function (kind, name) {
    const v = hash01(name);
    switch (kind) {
      case "kernel":
        return "hsl(" + Math.round(195 + 25 * v) + ", 62%, " + Math.round(68 + 10 * v) + "%)";
      case "vdso":
        return "hsl(" + Math.round(268 + 20 * v) + ", 55%, " + Math.round(74 + 8 * v) + "%)";
      case "jit":
        return "hsl(" + Math.round(100 + 35 * v) + ", 52%, " + Math.round(62 + 10 * v) + "%)";
      case "python":
        return "hsl(" + Math.round(160 + 16 * v) + ", 58%, " + Math.round(56 + 10 * v) + "%)";
      case "unknown":
        return "hsl(30, 4%, " + Math.round(72 + 10 * v) + "%)";
      case "root":
        return "hsl(220, 10%, 82%)";
      default:
        return "hsl(" + Math.round(8 + 42 * v) + ", 88%, " + Math.round(60 + 8 * v) + "%)";
    }
  };
  const HIGHLIGHT = "#d81bd8";
  const CELL = 18; // frame height, px

  // Differential colour: red where B grew, blue where it shrank. `scale` is the largest
  // |delta| of the tree, so the biggest change is at full colour and the square root keeps
  // small changes visible.
  B.diffColor = function (delta, scale) {
    if (!delta || !scale) return "hsl(220, 8%, 86%)";
    const r = Math.sqrt(Math.min(1, Math.abs(delta) / scale));
    const light = Math.round(92 - 34 * r);
    const sat = Math.round(40 + 50 * r);
    return delta > 0 ? "hsl(2, " + sat + "%, " + light + "%)" : "hsl(214, " + sat + "%, " + light + "%)";
  };

  function treeDepth(tree) {
    let max = 0;
    const stack = [[tree, 0]];
    while (stack.length) {
      const [n, d] = stack.pop();
      if (d > max) max = d;
      if (n.children) for (const c of n.children) stack.push([c, d + 1]);
    }
    return max;
  }

  function maxAbsDelta(tree) {
    let m = 0;
    const stack = (tree.children || []).slice();
    while (stack.length) {
      const n = stack.pop();
      m = Math.max(m, Math.abs(n.delta || 0));
      if (n.children) for (const c of n.children) stack.push(c);
    }
    return m;
  }

  function stripFlags(node) {
    // d3-flame-graph keeps zoom state on the data objects: clear it before a re-render.
    const stack = [node];
    while (stack.length) {
      const n = stack.pop();
      delete n.fade;
      delete n.hide;
      if (n.children) for (const c of n.children) stack.push(c);
    }
  }

  function selfValue(data) {
    let s = data.value || 0;
    if (data.children) for (const c of data.children) s -= c.value || 0;
    return Math.max(s, 0);
  }

  // Search: a case-insensitive regex when the term is one, else a plain substring.
  function makeMatcher(term) {
    if (!term) return null;
    try {
      const re = new RegExp(term, "i");
      return (name) => re.test(name);
    } catch (e) {
      const t = term.toLowerCase();
      return (name) => name.toLowerCase().includes(t);
    }
  }

  function legendItem(cls, color, label, title) {
    return B.el("span", { class: "lg-item " + cls, title: title || label },
      B.el("span", { class: "lg-swatch", style: "background:" + color }), label);
  }

  function escapeRegExp(s) {
    return s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
  }

  // Functions by self value (pprof's "top"): self summed over every frame of the same name and
  // kind, total counted once per stack even when the function recurses. For a diff, the
  // self deltas too.
  B.topFunctions = function (tree) {
    const by = new Map();
    const onPath = new Map();
    function visit(n) {
      const key = (n.kind || "") + "\u0000" + n.name;
      let e = by.get(key);
      if (!e) {
        e = { name: n.name, kind: n.kind || "unknown", self: 0, total: 0, selfDelta: 0 };
        by.set(key, e);
      }
      let childValue = 0;
      let childDelta = 0;
      for (const c of n.children || []) {
        childValue += c.value || 0;
        childDelta += c.delta || 0;
      }
      e.self += Math.max(0, (n.value || 0) - childValue);
      e.selfDelta += (n.delta || 0) - childDelta;
      const depth = onPath.get(key) || 0;
      if (!depth) e.total += n.value || 0;
      onPath.set(key, depth + 1);
      for (const c of n.children || []) visit(c);
      onPath.set(key, depth);
    }
    for (const c of tree.children || []) visit(c);
    return [...by.values()];
  };

  B.mountFlame = function (root, opts) {
    const views = (opts.views || B.VIEW_ORDER).slice();
    const totals = opts.totals || {};
    const diff = !!opts.diff;
    const state = {
      view: views.includes(opts.view) ? opts.view : views.find((v) => totals[v] !== 0) || views[0],
      search: opts.search || "",
      inverted: true,
      tree: null,
      chart: null,
      focus: null,
      matchCount: 0,
    };
    const trees = {};

    // ---- DOM -------------------------------------------------------------
    const viewButtons = views.map((v) =>
      B.el("button", {
        type: "button", class: "seg-btn", "data-view": v, role: "tab",
        title: (B.VIEWS[v] || {}).help || v,
        disabled: totals[v] === 0 ? true : null,
        onclick: () => setView(v),
      }, (B.VIEWS[v] || { label: v }).label,
      totals[v] !== undefined ? B.el("span", { class: "seg-count" }, shortTotal(v, totals[v])) : null),
    );
    const search = B.el("input", {
      type: "search", class: "fg-search", placeholder: "Search functions (regex or text)…",
      "aria-label": "Search functions", value: state.search, spellcheck: "false",
    });
    const matches = B.el("span", { class: "fg-matches", "aria-live": "polite" });
    const reset = B.el("button", { type: "button", class: "btn fg-reset", title: "Show the whole profile (Esc)",
      onclick: () => resetZoom() }, "Reset zoom");
    const invert = B.el("input", { type: "checkbox", class: "fg-invert" });
    invert.checked = !state.inverted;
    invert.addEventListener("change", () => {
      state.inverted = !invert.checked;
      render();
    });
    const toolbar = B.el("div", { class: "fg-toolbar" },
      B.el("div", { class: "seg", role: "tablist", "aria-label": "Profile view" }, ...viewButtons),
      B.el("div", { class: "fg-searchbox" }, search, matches),
      reset,
      B.el("label", { class: "fg-flip", title: "Draw the root at the bottom (classic flame) instead of the top (icicle)" },
        invert, " root at bottom"),
    );

    let legend;
    if (diff) {
      legend = B.el("div", { class: "fg-legend" },
        legendItem("lg-grew", B.diffColor(1, 1), "grew in B"),
        legendItem("lg-shrank", B.diffColor(-1, 1), "shrank in B"),
        legendItem("lg-same", B.diffColor(0, 1), "unchanged"),
        B.el("span", { class: "lg-note" }, "width = B's profile; colour = change of share since A, the largest change at full colour"),
      );
    } else {
      legend = B.el("div", { class: "fg-legend" },
        legendItem("lg-user", B.frameColor("user", "main"), "user"),
        legendItem("lg-kernel", B.frameColor("kernel", "schedule"), "kernel"),
        legendItem("lg-vdso", B.frameColor("vdso", "clock_gettime"), "vDSO"),
        legendItem("lg-jit", B.frameColor("jit", "JS:*hotLoop"), "JIT (perf map)"),
        legendItem("lg-python", B.frameColor("python", "main"), "Python"),
        legendItem("lg-unknown", B.frameColor("unknown", "?"), "unknown"),
        B.el("span", { class: "lg-item lg-inlined", title: "Inlined into its caller (from DWARF)" },
          B.el("span", { class: "lg-swatch lg-swatch-inlined" }), B.el("i", null, "inlined")),
        legendItem("lg-match", HIGHLIGHT, "search match"),
      );
    }
    const crumbs = B.el("nav", { class: "fg-crumbs", "aria-label": "Zoom path" });
    const chartEl = B.el("div", { class: "fg-chart" });
    const details = B.el("div", { class: "fg-details" });
    const tip = B.el("div", { class: "fg-tip", role: "tooltip" });
    const topEl = B.el("div", { class: "fg-top" });
    root.replaceChildren(toolbar, legend, crumbs, chartEl, details, topEl);
    document.body.append(tip);

    function shortTotal(view, total) {
      if (total === null || total === undefined) return "";
      return view === "off_cpu_ns" ? B.fmtNs(total) : B.fmtCount(total);
    }

    // ---- formatting of values in the current view -------------------------
    function fmtV(v) {
      let s = B.fmtValue(state.view, v);
      if (state.view === "on_cpu" && opts.periodNs && v > 0) s += " ≈ " + B.fmtNs(v * opts.periodNs) + " CPU";
      return s;
    }

    // A Python function's place, as py-spy writes it: " (w.py:6)"; other frames say it in the tooltip.
    function where(data) {
      if (data.kind !== "python" || !data.file) return "";
      return " (" + data.file + (data.line ? ":" + data.line : "") + ")";
    }

    function tipHtml(d) {
      const data = d.data;
      const total = state.tree ? state.tree.value || 0 : 0;
      const esc = B.escapeHtml;
      const kind = data.kind || "unknown";
      let h = '<div class="tip-name">' + esc(data.name) + "</div>";
      h += '<div class="tip-tags"><span class="tag tag-' + esc(kind) + '">' + esc(KIND_LABEL[kind] || kind) + "</span>";
      if (data.inlined) h += '<span class="tag tag-inlined">inlined</span>';
      if (data.module) h += '<span class="tip-module">' + esc(data.module) + "</span>";
      h += "</div>";
      if (data.file) h += '<div class="tip-src">' + esc(data.file) + (data.line ? ":" + data.line : "") + "</div>";
      h += '<table class="tip-vals">';
      h += "<tr><th>total</th><td>" + esc(fmtV(data.value)) + "</td><td>" + B.fmtPct(total ? data.value / total : 0) + "</td></tr>";
      const self = selfValue(data);
      if (data.children && data.children.length) {
        h += "<tr><th>self</th><td>" + esc(fmtV(self)) + "</td><td>" + B.fmtPct(total ? self / total : 0) + "</td></tr>";
      }
      if (d.parent && d.parent.data.value) {
        h += '<tr><th>of caller</th><td colspan="2">' + B.fmtPct(data.value / d.parent.data.value) + "</td></tr>";
      }
      if (diff) {
        const delta = data.delta || 0;
        const before = data.value - delta;
        h += '<tr class="tip-diff"><th>A</th><td>' + esc(fmtV(data.base !== undefined ? data.base : before)) +
          '</td><td class="dim">' + esc("≈ " + fmtV(before) + " at B's total") + "</td></tr>";
        h += '<tr class="tip-diff"><th>Δ B − A</th><td class="' + (delta > 0 ? "up" : delta < 0 ? "down" : "") + '">' +
          (delta > 0 ? "+" : "") + esc(fmtV(delta)) + "</td><td>" +
          (before > 0 ? (delta > 0 ? "+" : "") + B.fmtPct(delta / before) : delta > 0 ? "new" : "") + "</td></tr>";
      }
      h += "</table>";
      h += '<div class="tip-hint">click to zoom</div>';
      return h;
    }

    const tooltip = function () {};
    tooltip.show = function (event, d) {
      tip.innerHTML = tipHtml(d);
      tip.style.display = "block";
      const r = tip.getBoundingClientRect();
      let x = event.clientX + 14;
      let y = event.clientY + 14;
      if (x + r.width > global.innerWidth - 8) x = Math.max(8, event.clientX - r.width - 14);
      if (y + r.height > global.innerHeight - 8) y = Math.max(8, event.clientY - r.height - 14);
      tip.style.left = x + "px";
      tip.style.top = y + "px";
      return tooltip;
    };
    tooltip.hide = function () {
      tip.style.display = "none";
      return tooltip;
    };

    // ---- chart ------------------------------------------------------------
    function decorate() {
      chartEl.classList.toggle("searching", !!state.search && state.matchCount > 0);
      // Per-frame classes: d3-flame-graph resets `class` on every update, so re-apply.
      d3.select(chartEl).selectAll("g.frame")
        .classed("k-kernel", (d) => d.data.kind === "kernel")
        .classed("k-user", (d) => d.data.kind === "user")
        .classed("inlined", (d) => !!d.data.inlined)
        .classed("match", (d) => !!d.highlight)
        .attr("data-kind", (d) => d.data.kind || "unknown");
    }

    function updateCrumbs() {
      crumbs.replaceChildren();
      const path = [];
      for (let n = state.focus; n; n = n.parent) path.unshift(n);
      if (!path.length && state.chart) {
        crumbs.append(B.el("span", { class: "crumb crumb-here" }, "all"));
        reset.disabled = true;
        return;
      }
      reset.disabled = path.length <= 1;
      path.forEach((n, i) => {
        if (i) crumbs.append(B.el("span", { class: "crumb-sep" }, "›"));
        const last = i === path.length - 1;
        crumbs.append(B.el(last ? "span" : "a", {
          class: "crumb" + (last ? " crumb-here" : ""), href: last ? null : "#", title: n.data.name,
          onclick: last ? null : (e) => {
            e.preventDefault();
            state.chart.zoomTo(n);
          },
        }, n.data.name));
      });
    }

    function runSearch() {
      if (!state.chart) return;
      const term = search.value.trim();
      state.search = term;
      if (!term) {
        state.matchCount = 0;
        state.chart.clear();
        matches.textContent = "";
        matches.classList.remove("active");
      } else {
        state.chart.search(term);
      }
      decorate();
    }

    let matcherTerm = null;
    let matcher = null;

    const TOP_ROWS = 12;

    function searchExact(name) {
      search.value = "^" + escapeRegExp(name) + "$";
      runSearch();
      if (opts.onState) opts.onState({ view: state.view, search: state.search });
    }

    function renderTop() {
      const tree = state.tree;
      if (!tree || !tree.value) {
        topEl.replaceChildren();
        return;
      }
      const total = tree.value;
      const rows = B.topFunctions(tree);
      const pct = (v) => B.fmtPct(v / total);
      let head;
      let picked;
      let cells;
      if (diff) {
        picked = rows.filter((r) => Math.abs(r.selfDelta) >= 0.5).sort((a, b) => Math.abs(b.selfDelta) - Math.abs(a.selfDelta));
        head = ["Biggest changes (self)", "Δ self", "Δ of total", "self in B"];
        cells = (r) => [
          B.el("td", { class: "num " + (r.selfDelta > 0 ? "up" : "down") }, (r.selfDelta > 0 ? "+" : "") + fmtV(r.selfDelta)),
          B.el("td", { class: "num " + (r.selfDelta > 0 ? "up" : "down") }, (r.selfDelta > 0 ? "+" : "") + pct(r.selfDelta)),
          B.el("td", { class: "num" }, fmtV(r.self)),
        ];
      } else {
        picked = rows.filter((r) => r.self > 0).sort((a, b) => b.self - a.self);
        head = ["Top functions (self)", "self", "self %", "total %"];
        cells = (r) => [
          B.el("td", { class: "num" }, fmtV(r.self)),
          B.el("td", { class: "num" }, B.el("span", { class: "bar", style: "width:" + Math.round(60 * r.self / total) + "px" }), pct(r.self)),
          B.el("td", { class: "num" }, pct(r.total)),
        ];
      }
      if (!picked.length) {
        topEl.replaceChildren();
        return;
      }
      const body = B.el("tbody");
      for (const r of picked.slice(0, TOP_ROWS)) {
        const swatch = diff ? B.diffColor(r.selfDelta, 1) : B.frameColor(r.kind, r.name);
        body.append(B.el("tr", { "data-name": r.name, title: "Search for " + r.name, onclick: () => searchExact(r.name) },
          B.el("td", { class: "fn" }, B.el("div", { class: "fn-wrap" },
            B.el("span", { class: "lg-swatch", style: "background:" + swatch }),
            B.el("span", { class: "fn-name" }, r.name), B.el("span", { class: "fn-kind" }, KIND_LABEL[r.kind] || r.kind))),
          ...cells(r)));
      }
      topEl.replaceChildren(B.el("table", { class: "top" },
        B.el("thead", null, B.el("tr", null, ...head.map((h, i) => B.el("th", { class: i ? "num" : "" }, h)))), body));
    }

    function render() {
      if (state.chart) {
        state.chart.destroy();
        state.chart = null;
      }
      chartEl.replaceChildren();
      tooltip.hide();
      state.focus = null;
      const tree = state.tree;
      renderTop();
      if (!tree || !tree.value) {
        const label = (B.VIEWS[state.view] || { label: state.view }).label;
        chartEl.append(B.el("div", { class: "empty" }, "No " + label + " samples here."));
        matches.textContent = "";
        updateCrumbs();
        return;
      }
      stripFlags(tree);
      const deltaScale = diff ? maxAbsDelta(tree) : 0;
      const width = Math.max(320, chartEl.clientWidth || root.clientWidth || 960);
      const chart = global.flamegraph.default()
        .width(width)
        .cellHeight(CELL)
        .height((treeDepth(tree) + 1) * CELL + 2)
        .transitionDuration(300)
        .minFrameSize(1)
        .inverted(state.inverted)
        .sort((a, b) => b.data.value - a.data.value || (a.data.name < b.data.name ? -1 : 1))
        .tooltip(tooltip)
        .setColorMapper((d) => {
          if (d.highlight) return HIGHLIGHT;
          if (diff) return B.diffColor(d.data.delta, deltaScale);
          return B.frameColor(d.data.kind, d.data.name);
        })
        .setSearchMatch((d, term) => {
          if (term !== matcherTerm) {
            matcherTerm = term;
            matcher = makeMatcher(term);
          }
          return !!matcher && matcher(d.data.name || "");
        })
        .setSearchHandler((results) => {
          // Sum the matches' own values, not counting a match nested in another.
          let sum = 0;
          for (const r of results) {
            let nested = false;
            for (let p = r.parent; p && !nested; p = p.parent) nested = !!p.highlight;
            if (!nested) sum += r.data.value || 0;
          }
          const total = state.tree.value || 0;
          state.matchCount = results.length;
          matches.classList.add("active");
          matches.textContent = results.length
            ? results.length + " frame" + (results.length > 1 ? "s" : "") + " · " + B.fmtPct(total ? sum / total : 0) + " of " +
              (B.VIEWS[state.view] || { label: "" }).label
            : "no match";
        })
        .setDetailsHandler((text) => {
          details.textContent = text || "";
        })
        .setLabelHandler((d) => d.data.name + where(d.data) + " — " + fmtV(d.data.value))
        .onClick((d) => {
          state.focus = d.depth === 0 ? null : d;
          updateCrumbs();
          decorate();
        });
      state.chart = chart;
      d3.select(chartEl).datum(tree).call(chart);
      if (state.search) runSearch();
      decorate();
      updateCrumbs();
    }

    function resetZoom() {
      if (state.chart) state.chart.resetZoom();
    }

    async function setView(v, initial) {
      if (!initial && v === state.view && state.tree) return;
      state.view = v;
      for (const b of viewButtons) {
        b.classList.toggle("active", b.dataset.view === v);
        b.setAttribute("aria-selected", b.dataset.view === v ? "true" : "false");
      }
      chartEl.replaceChildren(B.el("div", { class: "loading" }, "Loading…"));
      root.classList.add("is-loading");
      try {
        if (!trees[v]) trees[v] = await opts.load(v);
        state.tree = trees[v];
        render();
      } catch (e) {
        B.showError(chartEl, e);
      } finally {
        root.classList.remove("is-loading");
        root.dataset.view = v;
      }
      if (!initial && opts.onState) opts.onState({ view: state.view, search: state.search });
    }

    let searchTimer = null;
    search.addEventListener("input", () => {
      clearTimeout(searchTimer);
      searchTimer = setTimeout(() => {
        runSearch();
        if (opts.onState) opts.onState({ view: state.view, search: state.search });
      }, 150);
    });
    search.addEventListener("keydown", (e) => {
      if (e.key === "Escape") {
        search.value = "";
        runSearch();
      }
    });
    document.addEventListener("keydown", (e) => {
      if (e.target === search) return;
      if (e.key === "/") {
        e.preventDefault();
        search.focus();
        search.select();
      } else if (e.key === "Escape") {
        resetZoom();
      }
    });
    let resizeTimer = null;
    let lastWidth = chartEl.clientWidth;
    global.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => {
        if (Math.abs(chartEl.clientWidth - lastWidth) > 4) {
          lastWidth = chartEl.clientWidth;
          render();
        }
      }, 200);
    });

    // Another profile in the same views: forget the loaded trees, show the new totals, draw again.
    function reload(load, newTotals) {
      opts.load = load;
      for (const k of Object.keys(trees)) delete trees[k];
      Object.assign(totals, newTotals || {});
      for (const b of viewButtons) {
        const v = b.dataset.view;
        b.disabled = totals[v] === 0;
        const c = b.querySelector(".seg-count");
        if (c) c.textContent = shortTotal(v, totals[v]);
      }
      if (totals[state.view] === 0) state.view = views.find((v) => totals[v] !== 0) || state.view;
      return setView(state.view, true);
    }

    const ready = setView(state.view, true);
    const api = {
      ready: ready,
      setView: setView,
      reload: reload,
      search: (term) => {
        search.value = term;
        runSearch();
      },
      resetZoom: resetZoom,
      state: state,
    };
    root.bistouriFlame = api;
    return api;
  };
})(window);
