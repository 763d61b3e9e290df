/* Bistouri UI: helpers shared by every page (formatting, DOM, API calls).
 * Plain ES2020, no build step: the files are served as they are, and report.py
 * inlines them into the self-contained flamegraph.html. */
(function (global) {
  "use strict";
  const B = (global.Bistouri = global.Bistouri || {});

  // Profile views: the three values a sample carries (model.Sample).
  B.VIEWS = {
    on_cpu: { label: "On-CPU", unit: "samples", help: "where the CPU time went (cpu-clock samples)" },
    off_cpu: { label: "Off-CPU", unit: "waits", help: "where threads blocked (sched_switch count)" },
    off_cpu_ns: { label: "Off-CPU time", unit: "ns", help: "where threads blocked, weighted by blocked time" },
  };
  B.VIEW_ORDER = ["on_cpu", "off_cpu", "off_cpu_ns"];

  B.escapeHtml = function (s) {
    return String(s).replace(/[&<>"']/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c];
    });
  };

  // el("a", {href: "x", class: "y"}, "text", childNode, ...)
  B.el = function (tag, attrs) {
    const node = document.createElement(tag);
    if (attrs) {
      for (const k of Object.keys(attrs)) {
        const v = attrs[k];
        if (v === null || v === undefined || v === false) continue;
        if (k === "text") node.textContent = v;
        else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
        else node.setAttribute(k, v === true ? "" : v);
      }
    }
    for (let i = 2; i < arguments.length; i++) {
      const c = arguments[i];
      if (c === null || c === undefined || c === false) continue;
      node.append(c instanceof Node ? c : String(c));
    }
    return node;
  };

  const intFmt = new Intl.NumberFormat("en-US");
  B.fmtCount = function (n) {
    if (n === null || n === undefined || isNaN(n)) return "–";
    return Math.abs(n) >= 100 || Number.isInteger(n) ? intFmt.format(Math.round(n)) : n.toFixed(1);
  };

  // Nanoseconds to a short human duration: 950 ns, 12.3 µs, 4.56 ms, 1.23 s, 2m05s.
  B.fmtNs = function (ns) {
    if (ns === null || ns === undefined || isNaN(ns)) return "–";
    const a = Math.abs(ns);
    const sign = ns < 0 ? "−" : "";
    // Three significant digits, without trailing zeros: 1 s, 1.5 s, 6.45 s, 150 ms.
    const p3 = (x) => String(Number(x.toPrecision(3)));
    if (a < 1e3) return sign + Math.round(a) + " ns";
    if (a < 1e6) return sign + p3(a / 1e3) + " µs";
    if (a < 1e9) return sign + p3(a / 1e6) + " ms";
    if (a < 60e9) return sign + p3(a / 1e9) + " s";
    const s = Math.round(a / 1e9);
    const m = Math.floor(s / 60);
    if (m < 60) return sign + m + "m" + String(s % 60).padStart(2, "0") + "s";
    return sign + Math.floor(m / 60) + "h" + String(m % 60).padStart(2, "0") + "m";
  };

  // A value of a view, with its unit: "1,234 samples", "56 waits", "1.23 s".
  B.fmtValue = function (view, v) {
    if (view === "off_cpu_ns") return B.fmtNs(v);
    const unit = (B.VIEWS[view] || { unit: "" }).unit;
    return B.fmtCount(v) + (unit ? " " + unit : "");
  };

  B.fmtPct = function (x) {
    if (!isFinite(x)) return "–";
    const p = 100 * x;
    if (p === 0) return "0%";
    if (Math.abs(p) < 0.01) return (p < 0 ? "−" : "") + "<0.01%";
    return (p < 0 ? "−" : "") + Math.abs(p).toFixed(Math.abs(p) < 10 ? 2 : 1) + "%";
  };

  function pad(n) {
    return String(n).padStart(2, "0");
  }
  // Wall-clock nanoseconds to local "YYYY-MM-DD HH:MM:SS".
  B.fmtTime = function (ns) {
    if (!ns) return "–";
    const d = new Date(ns / 1e6);
    return (
      d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " +
      pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds())
    );
  };
  B.fmtIsoUtc = function (ns) {
    return ns ? new Date(ns / 1e6).toISOString().replace(".000Z", "Z") : "";
  };

  B.RESOURCE_LABEL = { cpu: "CPU", memory: "memory", io: "I/O" };

  // "memory some ≥ 150 ms / 1 s"
  B.fmtTrigger = function (t) {
    if (!t || !t.resource) return "–";
    let s = (B.RESOURCE_LABEL[t.resource] || t.resource) + " " + (t.stall || "some");
    if (t.threshold_us && t.window_us) s += " ≥ " + B.fmtNs(t.threshold_us * 1e3) + " / " + B.fmtNs(t.window_us * 1e3);
    return s;
  };

  // Badge for a PSI average (percent of wall time stalled).
  B.psiBadge = function (label, v) {
    const level = v >= 40 ? "hot" : v >= 10 ? "warm" : "cool";
    return B.el("span", { class: "psi psi-" + level, title: "PSI avg" + label + ": " + v.toFixed(2) + "% stalled" },
      B.el("small", null, label), (v || 0).toFixed(1) + "%");
  };
  B.psiBadges = function (t) {
    const wrap = B.el("span", { class: "psis" });
    wrap.append(B.psiBadge("10", t.avg10 || 0), B.psiBadge("60", t.avg60 || 0), B.psiBadge("300", t.avg300 || 0));
    return wrap;
  };

  B.resourceBadge = function (resource) {
    return B.el("span", { class: "res res-" + (resource || "none") }, B.RESOURCE_LABEL[resource] || resource || "–");
  };

  // A capture asked of the agent ("capture now"), not fired by PSI.
  B.manualBadge = function (t) {
    if (!t || t.kind !== "manual") return null;
    return B.el("span", { class: "badge-manual", title: "captured on demand (capture now), not by a PSI event" },
      "manual");
  };

  B.query = function () {
    return new URLSearchParams(global.location.search);
  };

  // Build a query string from an object, dropping empty values.
  B.qs = function (obj) {
    const p = new URLSearchParams();
    for (const k of Object.keys(obj)) {
      const v = obj[k];
      if (v !== null && v !== undefined && v !== "") p.set(k, v);
    }
    const s = p.toString();
    return s ? "?" + s : "";
  };

  // The symbolizer serves the UI at /ui/ and the API at /v1/: resolve from the page.
  B.apiUrl = function (path, params) {
    const base = new URL("../", global.location.href);
    return new URL(path.replace(/^\//, ""), base).pathname + B.qs(params || {});
  };

  // A service run with --read-token wants its token on reads too. The UI asks for it once (on the
  // first 401) and keeps it in sessionStorage: this tab only, gone when it closes, never in a URL.
  const TOKEN_KEY = "bistouri-token";
  B.token = function () {
    try {
      return global.sessionStorage.getItem(TOKEN_KEY) || "";
    } catch (e) {
      return ""; // storage disabled (or a file:// report): no token
    }
  };
  B.setToken = function (token) {
    if (token) global.sessionStorage.setItem(TOKEN_KEY, token);
    else global.sessionStorage.removeItem(TOKEN_KEY);
  };
  B.authHeaders = function (headers) {
    const out = Object.assign({}, headers || {});
    const token = B.token();
    if (token) out.Authorization = "Bearer " + token;
    return out;
  };

  B.getJson = async function (path, params) {
    const url = B.apiUrl(path, params);
    let resp;
    try {
      resp = await fetch(url, { headers: B.authHeaders({ Accept: "application/json" }) });
    } catch (e) {
      throw new Error("cannot reach the symbolizer (" + e.message + ")");
    }
    if (!resp.ok) {
      let detail = "";
      try {
        const body = await resp.json();
        detail = body.detail ? body.error + ": " + body.detail : body.error || JSON.stringify(body);
      } catch (e) {
        detail = resp.statusText;
      }
      const err = new Error(resp.status + " " + detail);
      err.status = resp.status;
      throw err;
    }
    return resp.json();
  };

  B.showError = function (container, err) {
    container.replaceChildren(
      B.el("div", { class: "error", role: "alert" }, B.el("strong", null, "Error: "), err.message || String(err)),
    );
    if (err && err.status === 401 && !global.document.getElementById("token-form")) container.append(tokenForm());
  };

  // Asked on a 401: the token is kept for this tab, and the page loads again with it.
  function tokenForm() {
    const input = B.el("input", { type: "password", id: "token-input", autocomplete: "off",
      placeholder: "bearer token", "aria-label": "Bearer token" });
    return B.el("form", { class: "token-form", id: "token-form", onsubmit: function (ev) {
      ev.preventDefault();
      B.setToken(input.value.trim());
      global.location.reload();
    } },
      B.el("span", null, B.token() ? "This token was refused. Another one: " : "This symbolizer asks for a token: "),
      input,
      B.el("button", { class: "btn btn-primary", type: "submit", id: "token-submit" }, "Use token"));
  }

  // Download links are plain <a href download>, which send no header: with a token, fetch the
  // file with it and hand the browser the bytes.
  if (global.document) {
    global.document.addEventListener("click", async function (ev) {
      const a = ev.target && ev.target.closest ? ev.target.closest("a[download]") : null;
      if (!a || !B.token() || !new URL(a.href, global.location.href).pathname.includes("/v1/")) return;
      ev.preventDefault();
      const resp = await fetch(a.href, { headers: B.authHeaders() });
      if (!resp.ok) return B.showError(a.parentNode, Object.assign(new Error(resp.status + " " + resp.statusText),
        { status: resp.status }));
      const blobUrl = URL.createObjectURL(await resp.blob());
      const tmp = B.el("a", { href: blobUrl, download: a.getAttribute("download") });
      global.document.body.append(tmp);
      tmp.click();
      tmp.remove();
      setTimeout(function () { URL.revokeObjectURL(blobUrl); }, 10000);
    });
  }

  // Filters the list, merged and diff pages share.
  B.FILTER_KEYS = ["service", "host", "resource", "comm", "kind", "unit", "container", "runtime", "since", "until"];

  B.filtersFrom = function (params, prefix) {
    const out = {};
    for (const k of B.FILTER_KEYS) {
      const v = params.get((prefix || "") + k);
      if (v) out[k] = v;
    }
    return out;
  };

  // "since"/"until" are unix seconds or ISO 8601: render either readably.
  B.fmtBound = function (v) {
    if (!v) return "";
    if (/^\d+(\.\d+)?$/.test(v)) return B.fmtTime(Number(v) * 1e9);
    return v;
  };

  B.describeFilters = function (f) {
    const parts = [];
    for (const k of ["service", "host", "comm", "resource", "kind", "unit", "container", "runtime"]) {
      if (f[k]) parts.push(k + "=" + f[k]);
    }
    if (f.since) parts.push("since " + B.fmtBound(f.since));
    if (f.until) parts.push("until " + B.fmtBound(f.until));
    return parts.length ? parts.join(", ") : "all sessions";
  };

  // What the target's cgroup names (docs/api.md): "docker 4f1b9c2e7a6d" (the short id `docker ps` shows),
  // the whole id and the pod in its title; null without a container.
  B.RUNTIME_LABEL = { docker: "docker", containerd: "containerd", podman: "podman", crio: "CRI-O" };
  B.containerText = function (c) {
    if (!c || !c.id) return null;
    return (B.RUNTIME_LABEL[c.runtime] || c.runtime || "container") + " " + c.id.slice(0, 12);
  };
  // A unit as a list shows it: a runtime's 64-digit id cut to the 12 `docker ps` shows
  // ("docker-4f1b9c2e7a6d….scope"), any other long name cut in the middle; the whole name in a title.
  B.shortUnit = function (u) {
    const s = (u || "").replace(/[0-9a-f]{64}/, (id) => id.slice(0, 12) + "…");
    return s.length > 48 ? s.slice(0, 32) + "…" + s.slice(-15) : s;
  };
  B.containerTitle = function (c) {
    return "container " + c.id + (c.runtime ? " (" + c.runtime + ")" : "") + (c.pod ? " · pod " + c.pod : "");
  };

  // ---- a session's metadata (session page and the self-contained report) ----
  function metaItem(k, v, cls) {
    return B.el("div", null, B.el("div", { class: "k" }, k), B.el("div", { class: "v " + (cls || "") }, v));
  }

  B.sessionHeading = function (m) {
    const t = m.trigger || {};
    const title = B.el("h1", null, m.comm || "session",
      B.el("span", { class: "sub" }, " on " + (m.host || "?") + (m.service ? " · " + m.service : "")));
    return B.el("div", { class: "meta-head" }, title, t.resource ? B.resourceBadge(t.resource) : null,
      B.manualBadge(t), t.resource ? B.psiBadges(t) : null);
  };

  // The data-quality note: how user stacks were walked (tables vs frame pointers) and why
  // walks ended, e.g. "98% whole (to the entry) · frames: 91% .eh_frame, 9% frame pointer".
  B.unwindNote = function (u) {
    const frames = (u && u.frames) || {};
    const walks = (u && u.walks) || {};
    const nWalks = Object.values(walks).reduce((a, b) => a + b, 0);
    const nFrames = (frames.table || 0) + (frames.frame_pointer || 0);
    const python = (u && u.python) || {};
    const nPython = Object.values(python).reduce((a, b) => a + b, 0);
    const kernel = B.kernelNotes(u && u.kernel);
    if (!nWalks && !nFrames && !nPython && !kernel.length && !B.jitNotes(u && u.jit).length) return "";
    const pct = (n, of) => Math.round((100 * n) / of) + "%";
    const parts = [];
    if (nWalks) {
      const why = { no_frame_pointer: "no frame pointer", read_failed: "stack unreadable",
        max_depth: "127 frames", bad_frame: "bad frame" };
      const cut = Object.entries(walks).filter(([k, n]) => k !== "entry" && n)
        .sort((a, b) => b[1] - a[1]).map(([k, n]) => pct(n, nWalks) + " " + (why[k] || k));
      parts.push(pct(walks.entry || 0, nWalks) + " whole (to the entry)" +
        (cut.length ? ", cut short: " + cut.join(", ") : ""));
    }
    if (nFrames) {
      parts.push("frames: " + pct(frames.table || 0, nFrames) + " .eh_frame, " +
        pct(frames.frame_pointer || 0, nFrames) + " frame pointer");
    }
    if (nPython) {
      // CPython samples: with Python frames ("named"), or why not (the process's or the walk's reason).
      const not = Object.entries(python).filter(([k, n]) => k !== "named" && n)
        .sort((a, b) => b[1] - a[1]).map(([k, n]) => pct(n, nPython) + " " + k.replace(/_/g, " "));
      parts.push("Python: " + pct(python.named || 0, nPython) + " named" + (not.length ? ", not: " + not.join(", ") : ""));
    }
    parts.push(...B.jitNotes(u && u.jit), ...kernel);
    return parts.join(" · ");
  };

  // What the agent's kernel lacked (bpf/features.py DEGRADATIONS: `bistouri check` says the same).
  B.kernelNotes = function (kernel) {
    const words = {
      no_bpf_loop: "kernel before 5.17: user and Python stacks walked to a bounded depth",
      no_task_pt_regs: "kernel before 5.15: user registers of threads in the kernel read from its stack",
      no_global_func_args: "kernel before 5.12: user stacks by frame pointers only, no Python frames",
      bounded_refused: "the kernel refused the bounded walk: user stacks by frame pointers only",
    };
    return Object.keys(kernel || {}).map((k) => words[k] || "kernel: " + k.replace(/_/g, " "));
  };

  // What a session's JIT frames lack and how to get it (capture/jitnote.py says the same for `record`).
  B.jitNotes = function (jit) {
    const words = {
      jvm_old_jvm: "a JVM before JDK 17: JIT frames unnamed (no Compiler.perfmap)",
      jvm_no_sigquit_handler: "a JVM without attach listener running with -Xrs: not asked for its perf map",
      jvm_attach_timeout: "a JVM did not answer the attach request: JIT frames unnamed",
      jvm_refused: "a JVM's attach socket was not its own: not asked for its perf map",
      jvm_failed: "a JVM's perf-map request failed: JIT frames may be unnamed",
      jvm_not_asked: "a JVM's JIT frames unnamed: run jcmd PID Compiler.perfmap during the capture",
      jvm_cut_in_jit: "Java stacks stop at JIT code the agent could not size: -XX:+PreserveFramePointer walks every JIT frame",
      node_unnamed: "node's JIT frames unnamed: start it with --perf-basic-prof",
    };
    return Object.keys(words).filter((k) => jit && jit[k]).map((k) => words[k]);
  };

  B.sessionGrid = function (m) {
    const t = m.trigger || {};
    const s = m.samples || {};
    const procs = (m.processes || []).map((p) => p.comm + " (" + p.pid + ")").join(", ");
    const labels = Object.entries(m.labels || {}).map(([k, v]) => k + "=" + v).join(", ");
    const period = m.period_ns ? B.fmtNs(m.period_ns) + " (" + Math.round(1e9 / m.period_ns) + " Hz)" : "–";
    return B.el("div", { class: "meta-grid" },
      t.resource ? metaItem("Trigger", t.kind === "manual" ? "manual (capture now) · " +
        (B.RESOURCE_LABEL[t.resource] || t.resource) : B.fmtTrigger(t)) : null,
      t.resource ? metaItem("Cgroup", t.cgroup || "/", "mono") : null,
      m.unit ? metaItem("Unit", m.unit, "mono unit") : null,
      m.container && m.container.id ? metaItem("Container", B.el("span", { title: B.containerTitle(m.container) },
        B.containerText(m.container) + (m.container.pod ? " · pod " + m.container.pod : "")), "mono container") : null,
      metaItem(t.kind === "manual" ? "Asked at" : t.resource ? "Triggered at" : "Started at",
        B.fmtTime(t.time_ns || m.start_ns)),
      metaItem("Duration", B.fmtNs(m.duration_ns)),
      metaItem("Sampling period", period),
      metaItem("Processes", procs || "–", "mono"),
      metaItem("Kernel", m.kernel_release || "–", "mono"),
      metaItem("On-CPU samples", B.fmtCount(s.on_cpu || 0) +
        (m.period_ns && s.on_cpu ? " ≈ " + B.fmtNs(s.on_cpu * m.period_ns) : "")),
      metaItem("Off-CPU", B.fmtCount(s.off_cpu || 0) + " waits · " + B.fmtNs(s.off_cpu_ns || 0)),
      t.total_us ? metaItem("PSI total stall", B.fmtNs(t.total_us * 1e3)) : null,
      B.unwindNote(m.unwind) ? metaItem("User stacks", B.unwindNote(m.unwind)) : null,
      labels ? metaItem("Labels", labels, "mono") : null,
      m.id ? metaItem("Session", m.id, "mono") : null,
    );
  };
})(window);
