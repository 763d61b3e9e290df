"""Ingest as its own module: one kallsyms store per worker, session metadata built once."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.pressure import PressureFigures
from bistouri.symbolizer import model
from bistouri.symbolizer.kallsyms import KallsymsStore
from bistouri.symbolizer.resolve import Resolver
from bistouri.symbolizer.service.cli import resolver_factory
from bistouri.symbolizer.service.ingest import ResolverFactory
from bistouri.symbolizer.service.server import ServerConfig, SymbolizerApp
from testkit.wsgiclient import Client


def _app(tmp_path: Path, factory: ResolverFactory | None = None) -> SymbolizerApp:
    if factory is None:

        def factory(kernels: KallsymsStore) -> Resolver:
            return Resolver.from_options(
                tmp_path, kernels=kernels, debuginfod_urls=[], registry=CollectorRegistry(), use_llvm=False
            )

    app = SymbolizerApp(ServerConfig(state_dir=tmp_path), factory)
    app.store.migrate()
    return app


def _session(sid: str) -> wire.Session:
    frame = wire.UserFrame(wire.FRAME_RESOLVED, bytes.fromhex("ab" * 20), 0x1234)
    return wire.Session(
        session_id=sid,
        trigger=wire.Trigger(
            "cpu", "some", 100_000, 2_000_000, "/t.slice", 1, pressure=PressureFigures(1.0, 1.0, 1.0, 1)
        ),
        kernel=wire.KernelInfo("6.18.0-test", b"\x01" * 20, 0xFFFFFFFF81000000),
        start_ns=10**18,
        duration_ns=10**9,
        period_ns=10**7,
        service="svc",
        host="h",
        labels={},
        processes={7: "p"},
        threads={7: "p"},
        traces=[wire.Trace((0xFFFFFFFF81000100,), (frame,), 7, 7, on_cpu=3)],
    )


def test_the_resolver_reads_the_kallsyms_store_of_the_app(tmp_path: Path) -> None:
    args = argparse.Namespace(debug_dir=[], binary_dir=[], debuginfod_url=[], cache_dir=None)
    app = _app(tmp_path, resolver_factory(args, tmp_path))  # as the service builds it
    try:
        resolver = app.ingest.resolver
        assert resolver.kernels is app.kallsyms  # type: ignore[attr-defined]
    finally:
        app.close()


def test_session_meta_is_built_once_per_ingested_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[str] = []
    from_wire = model.SessionMeta.from_wire.__func__  # type: ignore[attr-defined]

    def counting(cls: type[model.SessionMeta], s: wire.Session) -> model.SessionMeta:
        built.append(s.session_id)
        return from_wire(cls, s)  # type: ignore[no-any-return]

    monkeypatch.setattr(model.SessionMeta, "from_wire", classmethod(counting))
    app = _app(tmp_path)
    try:
        body = wire.encode_batch([wire.encode_session(_session("s-1"))])
        r = Client(app).post("/v1/sessions", data=body, content_type="application/x-msgpack")
        assert r.status_code == 200, r.text
        assert r.json is not None and r.json["accepted"] == ["s-1"]
        assert built == ["s-1"]
        meta = app.store.get_meta("s-1")
        assert meta is not None and meta.on_cpu == 3 and meta.service == "svc"
    finally:
        app.close()
