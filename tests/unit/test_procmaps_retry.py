"""A mapped file that could not be opened when first seen (its process exited between the maps and the
open) is opened again when another process maps it: the build id is not lost for the agent's life."""

from __future__ import annotations

from pathlib import Path

from bistouri.elf import read_build_id
from bistouri.host.procmaps import USER_FRAME, ProcMaps
from tests.unit.test_capture import burner_maps, fake_proc


def _build_id_at(maps: ProcMaps, pid: int, ip: int) -> bytes:
    return maps.file(USER_FRAME.unpack(maps.resolve(pid, (ip,)))[1]).build_id


def test_a_file_that_could_not_be_opened_is_named_once_another_process_maps_it(
    tmp_path: Path, workloads: Path
) -> None:
    (tmp_path / "gone").mkdir()
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "root").symlink_to(tmp_path / "gone")  # its files are no longer there to open
    fake_proc(tmp_path, 7, burner_maps(workloads))
    maps = ProcMaps(str(tmp_path))
    maps.track(7)
    assert _build_id_at(maps, 7, 0x400100) == b""
    # The next process of the same binary (same device, inode and path on its maps line).
    fake_proc(tmp_path, 8, burner_maps(workloads))
    maps.track(8)
    want = read_build_id(str(workloads / "burner"))
    assert want and _build_id_at(maps, 8, 0x400100) == want
