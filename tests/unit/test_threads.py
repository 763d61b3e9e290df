"""Threads carry their role in the kernel too, so `top -H` and `ps -L` tell them apart."""

from __future__ import annotations

import threading
from pathlib import Path

from bistouri import threads


def test_a_started_thread_is_named_in_python_and_in_the_kernel():
    seen: dict[str, str] = {}
    done = threading.Event()

    def work() -> None:
        tid = threading.get_native_id()
        seen["comm"] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        done.set()

    t = threads.start("exporter", work)
    assert done.wait(5)
    t.join(5)
    assert t.name == "bistouri-exporter" and t.daemon
    assert seen["comm"] == "exporter"


def test_long_names_are_cut_to_what_the_kernel_keeps():
    seen: dict[str, str] = {}

    def work() -> None:
        threads.set_os_name("a-role-name-longer-than-fifteen")
        seen["comm"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    t = threading.Thread(target=work)
    t.start()
    t.join(5)
    assert seen["comm"] == "a-role-name-lon"
