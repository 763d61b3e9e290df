"""The self-contained flamegraph.html that `bistouri record` writes.

One HTML file with everything inlined: d3, d3-flame-graph, the UI's own
scripts and stylesheet, the trees and the metadata. It opens from `file://`
with no network, and shows the same interactive flamegraph as the
symbolizer's session page (zoom, search, view switch, kernel/user colours).

The scripts and the stylesheet are read from `ui/`, the directory the
symbolizer serves, so the report and the service cannot drift apart.
"""

from __future__ import annotations

import json
import os
import re
from functools import cache
from typing import Any

from . import formats

# A str, not a pathlib.Path: pathlib imports urllib.parse and ipaddress (~3.5 ms of record's end).
UI_DIR = os.path.join(os.path.dirname(__file__), "ui")
# html.escape's five replacements, without importing html (its entities table: ~1 ms of record's end).
_HTML_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#x27;"})

# In page order: the libraries first, then ours.
_SCRIPTS = (
    "vendor/d3/d3.min.js",
    "vendor/d3-flame-graph/d3-flamegraph.umd.min.js",
    "js/common.js",
    "js/flame.js",
)
_PAGE_SCRIPT = "js/report.js"
_STYLES = ("css/bistouri.css",)

# Keys of `SessionMeta.to_json()` the page lays out itself; other scalar keys are listed as they are.
_KNOWN_META = frozenset(
    {
        "id", "tenant", "service", "host", "labels", "comm", "pid", "processes", "trigger",
        "start_ns", "duration_ns", "period_ns", "kernel_release", "samples", "unit", "container",
    }
)  # fmt: skip

_SCRIPT_END = re.compile(r"</(script)", re.IGNORECASE)
_STYLE_END = re.compile(r"</(style)", re.IGNORECASE)
_NON_ASCII = re.compile(r"[^\x00-\x7f]")


@cache
def _asset(rel: str) -> str:
    with open(os.path.join(UI_DIR, rel), encoding="utf-8") as f:
        return f.read()


# The page is pure ASCII whatever encoding the caller writes it with: each non-ASCII
# character is escaped the way its context reads it (JS `\uXXXX`, CSS `\XXXXXX`, HTML `&#N;`).
def _js_escape(m: re.Match[str]) -> str:
    cp = ord(m.group())
    if cp < 0x10000:
        return f"\\u{cp:04x}"
    cp -= 0x10000
    return f"\\u{0xD800 + (cp >> 10):04x}\\u{0xDC00 + (cp & 0x3FF):04x}"


def _css_escape(m: re.Match[str]) -> str:
    return f"\\{ord(m.group()):06x}"


def _markup(text: str) -> str:
    return text.encode("ascii", "xmlcharrefreplace").decode("ascii")


def _inline_script(source: str) -> str:
    # `<\/script` means the same inside a JS string, regex or comment, and cannot end the element.
    source = _NON_ASCII.sub(_js_escape, source)
    return "<script>\n" + _SCRIPT_END.sub(r"<\\/\1", source) + "\n</script>\n"


def _inline_style(source: str) -> str:
    source = _NON_ASCII.sub(_css_escape, source)
    return "<style>\n" + _STYLE_END.sub(r"<\\/\1", source) + "\n</style>\n"


def _json_block(element_id: str, text: str) -> str:
    # No `<` at all in the block (`<` only occurs inside JSON strings, where `\u003c` means the
    # same): neither `</script>` nor `<!--<script>` (which makes the parser skip the real end tag
    # and blank the page) can appear, whatever the frame or process names are.
    text = text.replace("<", "\\u003c")
    return f'<script type="application/json" id="{element_id}">{text}</script>\n'


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True)


def _trees_json(trees: dict[str, dict[str, Any]]) -> str:
    # Trees are as deep as their stacks: written without recursion (json.dumps fails past ~1000).
    return "{" + ",".join(f"{_compact(view)}:{formats.tree_json(tree)}" for view, tree in trees.items()) + "}"


def _page_meta(meta: dict[str, Any]) -> dict[str, Any]:
    page = dict(meta)
    extra = {
        k: v
        for k, v in meta.items()
        if k not in _KNOWN_META and k != "extra" and isinstance(v, (str, int, float, bool))
    }
    page["extra"] = {**extra, **meta.get("extra", {})}
    return page


_HEAD = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="bistouri">
<title>{title}</title>
"""

_BODY = """</head>
<body data-page="report">
<header class="topbar">
  <span class="brand"><span class="brand-mark" aria-hidden="true">✂</span>bistouri
    <small>record</small></span>
</header>
<main>
<section class="panel" id="meta"></section>
<section class="fg" id="flame"></section>
<p class="report-foot">{title} · written by <code>bistouri record</code>.
Click a frame to zoom, Esc to reset, / to search.</p>
</main>
"""


def flamegraph_html(trees: dict[str, dict[str, Any]], meta: dict[str, Any], title: str) -> str:
    """A self-contained HTML page showing `trees` as an interactive flamegraph.

    `trees` maps a view (`on_cpu`, `off_cpu`, `off_cpu_ns`) to its d3-flame-graph
    tree (`formats.flamegraph`); views missing from it are not offered, and a
    view whose tree is empty shows as disabled. `meta` is shaped like
    `SessionMeta.to_json()` (all keys optional); any other scalar key is shown
    as it is. The result references no URL, so it works offline from `file://`,
    and is pure ASCII, so any encoding writes it unchanged.
    """
    t = title.translate(_HTML_ESCAPES)
    parts = [_markup(_HEAD.format(title=t))]
    parts += [_inline_style(_asset(rel)) for rel in _STYLES]
    parts += [_inline_script(_asset(rel)) for rel in _SCRIPTS]
    parts.append(_markup(_BODY.format(title=t)))
    parts.append(_json_block("bistouri-trees", _trees_json(trees)))
    parts.append(_json_block("bistouri-meta", _compact(_page_meta(meta))))
    parts.append(_inline_script(_asset(_PAGE_SCRIPT)))
    parts.append("</body>\n</html>\n")
    return "".join(parts)
