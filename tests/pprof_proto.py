"""pprof's profile.proto (and Pyroscope's push messages) compiled at test time, to parse what the
symbolizer writes."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def compile_profile_proto(out: Path) -> ModuleType:
    """Compile the vendored profile.proto with grpcio-tools' protoc, or the system `protoc`."""
    return _compile(FIXTURES / "pprof", "profile", out)


def compile_push_proto(out: Path) -> ModuleType:
    """Pyroscope's push API messages (tests/fixtures/pyroscope/push.proto), compiled the same way."""
    return _compile(FIXTURES / "pyroscope", "push", out)


def _compile(proto_dir: Path, name: str, out: Path) -> ModuleType:
    args = [f"-I{proto_dir}", f"--python_out={out}", str(proto_dir / f"{name}.proto")]
    try:
        from grpc_tools import protoc

        assert protoc.main(["protoc", *args]) == 0, f"protoc failed on {proto_dir / name}.proto"
    except ImportError:
        exe = shutil.which("protoc")
        if exe is None:
            pytest.skip(
                "no protobuf compiler: pip install grpcio-tools (or apt-get install protobuf-compiler)"
            )
        subprocess.run([exe, *args], check=True)
    pytest.importorskip("google.protobuf", reason="the protobuf package parses pprof output")
    spec = importlib.util.spec_from_file_location(f"{name}_pb2", out / f"{name}_pb2.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"{name}_pb2"] = mod
    spec.loader.exec_module(mod)
    return mod
