"""The layers contract: which package of bistouri may import which (docs/architecture.md, "Layers").

Low to high: the base modules (atomicfile, discard, errors, logtext, pressure, threads) -> elf, wire -> bpf,
host -> unwind, cpython -> capture -> agent, record. The symbolizer library sits on the base, elf and wire
only; its service on the library too. Only the command line (cli, __main__) sees everything. Every import
counts: module level, inside a function, under TYPE_CHECKING. Run by `make lint` and with the unit tests.
"""

from __future__ import annotations

import ast
import site
import subprocess
import sys
from pathlib import Path

import bistouri

PACKAGE = Path(__file__).resolve().parents[2] / "bistouri"

_LOW = {"base", "elf", "wire"}
# What each component may import besides itself. Siblings of a layer (bpf and host, agent and record)
# do not import each other.
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "elf": {"base"},
    "wire": {"base"},
    "bpf": _LOW,
    "host": _LOW,
    "unwind": _LOW | {"bpf", "host"},
    "cpython": _LOW | {"bpf", "host"},
    "capture": _LOW | {"bpf", "host", "unwind", "cpython"},
    "agent": _LOW | {"bpf", "host", "unwind", "cpython", "capture"},
    "record": _LOW | {"bpf", "host", "unwind", "cpython", "capture", "symbolizer"},
    "symbolizer": _LOW,
    "service": _LOW | {"symbolizer"},
}
ALLOWED["cli"] = set(ALLOWED)  # the command line dispatches to every component
_BASE = {
    "bistouri",
    "bistouri.atomicfile",
    "bistouri.compat",
    "bistouri.errors",
    "bistouri.discard",
    "bistouri.gckeep",
    "bistouri.logtext",
    "bistouri.pressure",
    "bistouri.sha",
    "bistouri.threads",
}
_CLI = {"bistouri.cli", "bistouri.__main__"}


def component(module: str) -> str:
    """The component a dotted module name of ours belongs to."""
    if module in _BASE:
        return "base"
    if module in _CLI:
        return "cli"
    parts = module.split(".")
    if parts[1] == "symbolizer" and len(parts) > 2 and parts[2] == "service":
        return "service"
    if parts[1] == "gopclntab":
        return "elf"  # Go's line table, read from an ELF file: the ELF reader's sibling
    if parts[1] in ALLOWED:
        return parts[1]
    raise AssertionError(f"{module}: in no layer; add it to tests/unit/test_layers.py")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path, module: str = "") -> list[tuple[int, str]]:
    """(line, absolute module) of every import of ours in a file, at any depth of its syntax tree.
    `module` is the file's dotted name, by default from its path under bistouri/."""
    module = module or module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "bistouri"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "bistouri":
                continue
            for a in node.names:  # `from . import wire` imports the module bistouri.wire
                sub = f"{target}.{a.name}"
                is_module = (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() or (
                    PACKAGE.parent / sub.replace(".", "/")
                ).is_dir()
                found.append((node.lineno, sub if is_module else target))
    return sorted(set(found))


def violations() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        mine = component(importer)
        for line, target in imports(path):
            theirs = component(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                where = path.relative_to(PACKAGE.parent)
                out.append(f"{where}:{line}: {importer} ({mine}) imports {target} ({theirs})")
    return out


def test_no_package_imports_a_layer_above_it_or_a_sibling() -> None:
    found = violations()
    assert not found, (
        "imports against the layers contract (tests/unit/test_layers.py, ALLOWED):\n" + "\n".join(found)
    )


def test_every_module_is_in_a_layer() -> None:
    for path in PACKAGE.rglob("*.py"):
        component(module_name(path))


def test_the_contract_sees_relative_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    src = tmp_path / "probe.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..agent import config\n"
        "def f():\n    from ..record.command import main\n"
    )
    found = imports(src, "bistouri.capture.probe")
    assert found == [(3, "bistouri.agent.config"), (5, "bistouri.record.command")]


def test_the_wire_format_pulls_in_neither_yaml_nor_the_agent() -> None:
    # The symbolizer decodes sessions with bistouri.wire: it must not need the agent's PyYAML.
    code = (
        "import sys, bistouri.wire\n"
        "bad = sorted(m for m in sys.modules if m == 'yaml' or m.startswith(('bistouri.agent', "
        "'bistouri.capture', 'bistouri.host', 'bistouri.bpf', 'bistouri.symbolizer')))\n"
        "print(' '.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "", f"import bistouri.wire also imports: {out.strip()}"


def test_records_capture_path_imports_neither_prometheus_nor_hashlib() -> None:
    # What `record` imports counts in its peak RSS: prometheus_client is ~75 modules and ~5.6 MB
    # (record keeps no metric: capture.metrics.Discarded), hashlib maps libcrypto (~3.9 MB; the
    # symbolization's few digests are bistouri.sha's), and the symbolization phase is a first run's
    # peak.
    code = (
        "import sys, bistouri.cli, bistouri.record.command, bistouri.capture.profiler, "
        "bistouri.capture.sessions, bistouri.capture.episode, bistouri.capture.metrics, bistouri.wire, "
        "bistouri.record.symcache, bistouri.record.dwarfpool, bistouri.symbolizer.resolve, "
        "bistouri.symbolizer.kallsyms, bistouri.symbolizer.formats\n"
        "bad = ('prometheus_client', 'hashlib', '_hashlib')\n"
        "print(' '.join(sorted(m for m in bad if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "", f"record imports: {out.strip()}"


def test_records_path_imports_no_module_it_does_not_use() -> None:
    # CPU of every record's start and end: pathlib imports urllib.parse and ipaddress (~3.5 ms),
    # socket is for a JVM's attach only, html for one escape (its entities table, ~1 ms); record
    # packs no session (the wire codecs and msgpack, ~4 ms), reads no cgroup without --on-pressure
    # (cgroupfs), and a binary without DWARF needs no DWARF reader (symbolizer.dwarf). Run as
    # /usr/bin/bistouri runs it (-S): the editable install's site hook imports pathlib itself.
    path = [str(Path(bistouri.__file__).parent.parent), *site.getsitepackages()]
    code = (
        f"import sys; sys.path[:0] = {path!r}\n"
        "import bistouri.cli, bistouri.record.command, bistouri.capture.profiler, "
        "bistouri.capture.sessions, bistouri.capture.episode, bistouri.wire, bistouri.host.debuginfo, "
        "bistouri.record.symcache, bistouri.record.dwarfpool, bistouri.record.linefile, "
        "bistouri.symbolizer.sources, bistouri.symbolizer.stacks, bistouri.symbolizer.demangle, "
        "bistouri.symbolizer.resolve, bistouri.symbolizer.kallsyms, bistouri.symbolizer.formats, "
        "bistouri.symbolizer.report\n"
        "bad = ('pathlib', 'socket', 'html', 'msgpack', 'bistouri.wire.decode', 'bistouri.wire.encode', "
        "'bistouri.wire.files', 'bistouri.host.cgroupfs', 'bistouri.symbolizer.dwarf')\n"
        "print(' '.join(sorted(m for m in bad if m in sys.modules)))\n"
    )
    run = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True)
    out = run.stdout
    assert out.strip() == "", f"record imports: {out.strip()}"


def test_the_sha256_without_openssl_gives_hashlibs_digests() -> None:
    import hashlib

    from bistouri.sha import sha256

    for data in (b"", b"abc", bytes(range(256)) * 1000):
        h = sha256(data[:7])
        h.update(data[7:])
        assert (
            h.hexdigest() == hashlib.sha256(data).hexdigest() and h.digest() == hashlib.sha256(data).digest()
        )
