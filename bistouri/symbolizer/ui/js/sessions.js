/* Sessions list: filters (kept in the URL), the table, picking two sessions for a diff. */
(function () {
  "use strict";
  const B = window.Bistouri;
  const el = B.el;
  const PAGE = 50;
  const RANGES = { "15m": 900, "1h": 3600, "6h": 21600, "24h": 86400, "7d": 604800 };
  const FORM_KEYS = ["service", "host", "comm", "resource", "kind", "unit", "container", "runtime"];

  const form = document.getElementById("filters");
  const list = document.getElementById("list");
  const count = document.getElementById("count");
  const pager = document.getElementById("pager");
  const diffLink = document.getElementById("diff-link");
  const mergedLink = document.getElementById("merged-link");
  const pickHint = document.getElementById("pick-hint");
  let picked = []; // [{id, start_ns}]
  let rows = [];

  // ---- URL <-> form ------------------------------------------------------
  function toLocalInput(v) {
    if (!v) return "";
    const d = /^\d+(\.\d+)?$/.test(v) ? new Date(Number(v) * 1000) : new Date(v);
    if (isNaN(d)) return "";
    const p = (n) => String(n).padStart(2, "0");
    return d.getFullYear() + "-" + p(d.getMonth() + 1) + "-" + p(d.getDate()) + "T" + p(d.getHours()) + ":" +
      p(d.getMinutes()) + ":" + p(d.getSeconds());
  }
  function fromLocalInput(v) {
    if (!v) return "";
    const d = new Date(v);
    return isNaN(d) ? "" : String(Math.floor(d.getTime() / 1000));
  }

  function readUrl() {
    const q = B.query();
    const f = B.filtersFrom(q);
    const range = q.get("range") || (f.since || f.until ? "custom" : "");
    return { filters: f, range: range, offset: Math.max(0, parseInt(q.get("offset") || "0", 10) || 0) };
  }

  function fillForm(s) {
    for (const k of FORM_KEYS) form.elements[k].value = s.filters[k] || "";
    form.elements.range.value = RANGES[s.range] || s.range === "custom" ? s.range : "";
    form.elements.since.value = s.range === "custom" ? toLocalInput(s.filters.since) : "";
    form.elements.until.value = s.range === "custom" ? toLocalInput(s.filters.until) : "";
    toggleCustom();
  }

  function toggleCustom() {
    const custom = form.elements.range.value === "custom";
    for (const n of form.querySelectorAll(".custom-range")) n.hidden = !custom;
  }

  // The URL keeps a relative range as `range=1h`; the API gets absolute seconds.
  function urlParamsFromForm() {
    const p = {};
    for (const k of FORM_KEYS) p[k] = form.elements[k].value.trim();
    const range = form.elements.range.value;
    if (range === "custom") {
      p.since = fromLocalInput(form.elements.since.value);
      p.until = fromLocalInput(form.elements.until.value);
    } else if (range) {
      p.range = range;
    }
    return p;
  }

  function apiFilters(s) {
    const f = Object.assign({}, s.filters);
    if (RANGES[s.range]) {
      f.since = String(Math.floor(Date.now() / 1000) - RANGES[s.range]);
      delete f.until;
    }
    return f;
  }

  // ---- table -------------------------------------------------------------
  function processCell(m) {
    const procs = m.processes || [];
    const main = el("span", { class: "comm" }, m.comm || (procs[0] && procs[0].comm) || "?");
    const cell = el("td", null, main, el("span", { class: "dim" }, " " + (m.pid || "")));
    if (procs.length > 1) {
      cell.append(el("span", { class: "pill", title: procs.map((p) => p.comm + " (" + p.pid + ")").join(", ") },
        "+" + (procs.length - 1)));
    }
    return cell;
  }

  // The service, and under it what the target's cgroup names: its unit, its container (a link that
  // filters the list by it).
  function serviceCell(m) {
    const cell = el("td", { class: "service" }, m.service || el("span", { class: "dim" }, "–"));
    if (m.unit) cell.append(el("div", { class: "dim mono unit", title: "systemd unit " + m.unit }, B.shortUnit(m.unit)));
    const c = B.containerText(m.container);
    if (c) {
      cell.append(el("div", null, el("a", { class: "pill container", title: B.containerTitle(m.container),
        href: B.qs({ container: m.container.id.slice(0, 12) }) }, c)));
    }
    return cell;
  }

  function samplesOff(m) {
    const s = m.samples || {};
    if (!s.off_cpu) return el("span", { class: "dim" }, "–");
    return el("span", null, B.fmtCount(s.off_cpu), el("span", { class: "dim" }, " · " + B.fmtNs(s.off_cpu_ns)));
  }

  // The seconds the flight recorder kept from before the trigger, when there are any.
  function onsetPill(m) {
    const pre = (m.episode || {}).pre_trigger_s || 0;
    if (!pre) return null;
    return el("span", { class: "pill onset", title: "of which " + B.fmtNs(pre * 1e9) +
      " before the trigger (flight recorder)" }, B.fmtNs(pre * 1e9) + " before");
  }

  function updatePicks() {
    picked.sort((a, b) => a.start_ns - b.start_ns);
    for (const tr of list.querySelectorAll("tbody tr")) {
      const i = picked.findIndex((p) => p.id === tr.dataset.id);
      tr.classList.toggle("picked", i >= 0);
      const tag = tr.querySelector(".pick-tag");
      tag.textContent = i === 0 ? "A" : i === 1 ? "B" : "";
      tag.className = "pick-tag" + (i === 0 ? " a" : i === 1 ? " b" : "");
      tag.hidden = i < 0;
      tr.querySelector("input.pick").checked = i >= 0;
    }
    if (picked.length === 2) {
      diffLink.href = "diff.html" + B.qs({ a: picked[0].id, b: picked[1].id });
      diffLink.removeAttribute("aria-disabled");
      diffLink.classList.add("btn-primary");
      pickHint.textContent = "A = older, B = newer.";
    } else {
      diffLink.removeAttribute("href");
      diffLink.setAttribute("aria-disabled", "true");
      diffLink.classList.remove("btn-primary");
      pickHint.textContent = picked.length ? "Tick one more session." : "Tick two sessions to compare them.";
    }
  }

  function onPick(m, checked) {
    picked = picked.filter((p) => p.id !== m.id);
    if (checked) {
      picked.push({ id: m.id, start_ns: m.start_ns || m.trigger.time_ns || 0 });
      if (picked.length > 2) picked.shift();
    }
    updatePicks();
  }

  function renderTable(sessions) {
    if (!sessions.length) {
      list.replaceChildren(el("div", { class: "panel empty" }, "No session matches these filters."));
      return;
    }
    const head = el("tr", null, ...["", "Time", "Host", "Service", "Process", "Trigger", "PSI avg10 / 60 / 300",
      "Duration", "On-CPU", "Off-CPU", ""].map((h) => el("th", null, h)));
    const body = el("tbody");
    for (const m of sessions) {
      const t = m.trigger || {};
      const href = "session.html" + B.qs({ id: m.id });
      const pick = el("input", { type: "checkbox", class: "pick", "aria-label": "Pick for comparison" });
      pick.addEventListener("change", () => onPick(m, pick.checked));
      const s = m.samples || {};
      const tr = el("tr", { "data-id": m.id },
        el("td", null, pick, el("span", { class: "pick-tag", hidden: true })),
        el("td", { class: "time", title: B.fmtIsoUtc(m.start_ns || t.time_ns) },
          el("a", { href: href, class: "session-link" }, B.fmtTime(m.start_ns || t.time_ns))),
        el("td", null, m.host || "–"),
        serviceCell(m),
        processCell(m),
        el("td", { class: "trigger", title: (t.cgroup ? "cgroup " + t.cgroup : "") }, B.resourceBadge(t.resource),
          " ", B.manualBadge(t), " ", el("span", { class: "dim" }, B.fmtTrigger(t).replace(/^\S+ /, ""))),
        el("td", null, B.psiBadges(t)),
        el("td", { class: "num" }, B.fmtNs(m.duration_ns), onsetPill(m)),
        el("td", { class: "num" }, s.on_cpu ? B.fmtCount(s.on_cpu) : el("span", { class: "dim" }, "–")),
        el("td", { class: "num" }, samplesOff(m)),
        el("td", { class: "num" }, el("a", { href: href, class: "btn" }, "Flamegraph")),
      );
      body.append(tr);
    }
    list.replaceChildren(el("table", { class: "sessions" }, el("thead", null, head), body));
    updatePicks();
  }

  function renderPager(s, total, shown) {
    pager.replaceChildren();
    if (total <= PAGE && s.offset === 0) return;
    const go = (off) => {
      const q = B.query();
      q.set("offset", String(off));
      history.pushState(null, "", "?" + q.toString());
      load();
    };
    const prev = el("button", { type: "button", class: "btn", disabled: s.offset === 0 ? true : null,
      onclick: () => go(Math.max(0, s.offset - PAGE)) }, "← Newer");
    const next = el("button", { type: "button", class: "btn", disabled: s.offset + shown >= total ? true : null,
      onclick: () => go(s.offset + PAGE) }, "Older →");
    pager.append(B.fmtCount(s.offset + 1) + "–" + B.fmtCount(s.offset + shown) + " of " + B.fmtCount(total), prev, next);
  }

  async function load() {
    const s = readUrl();
    fillForm(s);
    const f = apiFilters(s);
    mergedLink.href = "merged.html" + B.qs(f);
    list.classList.add("is-loading");
    try {
      const res = await B.getJson("/v1/sessions", Object.assign({ limit: PAGE, offset: s.offset }, f));
      rows = res.sessions || [];
      const total = res.total !== undefined ? res.total : rows.length;
      count.textContent = B.fmtCount(total) + " session" + (total === 1 ? "" : "s") + " · " + B.describeFilters(f);
      mergedLink.toggleAttribute("aria-disabled", total === 0);
      renderTable(rows);
      renderPager(s, total, rows.length);
    } catch (e) {
      count.textContent = "";
      B.showError(list, e);
    } finally {
      list.classList.remove("is-loading");
    }
  }

  form.elements.range.addEventListener("change", toggleCustom);
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    picked = [];
    history.pushState(null, "", B.qs(urlParamsFromForm()) || location.pathname);
    load();
  });
  document.getElementById("clear").addEventListener("click", () => {
    picked = [];
    history.pushState(null, "", location.pathname);
    load();
  });
  window.addEventListener("popstate", load);
  load();
})();
