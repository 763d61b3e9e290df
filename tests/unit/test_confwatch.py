"""The targets file's watcher (confwatch.py) against the ways files really change on disk.

Real inotify on a real directory, changed the way editors, Ansible and Kubernetes change
a config: write a temporary file and rename it over, rewrite in place (truncate, then
write), rename the old file away first (vim's backup), swap a ConfigMap's `..data`
symlink, delete and create again. Each test waits for the kernel's events on the
watcher's fd (they are queued before the syscall returns; the wait is only a bound) and
then passes the clock to the watcher, so the debounce is checked at exact instants and
no sleep decides a result.
"""

from __future__ import annotations

import errno
import logging
import os
import select
from collections.abc import Iterator
from pathlib import Path

import pytest

from bistouri.agent.confwatch import ConfigWatcher, file_digest

OLD = b"targets:\n  - comm: nginx\n"
NEW = b"targets:\n  - comm: postgres\n"
T0 = 1000.0  # a monotonic instant; the watcher is given the clock, it never reads it
DEBOUNCE = ConfigWatcher.DEBOUNCE_S


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "trigger.yaml"
    path.write_bytes(OLD)
    return path


@pytest.fixture
def watcher(config: Path) -> Iterator[ConfigWatcher]:
    w = ConfigWatcher(str(config))
    yield w
    w.close()


def pending(w: ConfigWatcher) -> bool:
    """Whether the kernel has queued events the watcher has not read."""
    poller = select.poll()
    poller.register(w.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def read_events(w: ConfigWatcher, now: float) -> None:
    """Wait until the watcher's fd is readable, then let it read the events at `now`."""
    poller = select.poll()
    poller.register(w.fileno(), select.POLLIN)
    assert poller.poll(5000), "no inotify event within 5 s"
    w.read_events(now)
    assert not pending(w), "events left unread"


def settled(w: ConfigWatcher, now: float = T0) -> bool:
    """Read the events at `now` and ask at the end of the debounce whether to reload."""
    read_events(w, now)
    return w.changed(now + DEBOUNCE)


def replace_atomically(path: Path, content: bytes, temp_name: str) -> None:
    """What Ansible's copy and template modules and most editors do: a temporary file in the
    same directory, written, flushed and renamed over the config (rename(2) is atomic)."""
    temp = path.with_name(temp_name)
    with open(temp, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    os.rename(temp, path)


def test_a_file_renamed_over_the_config_is_a_change(config: Path, watcher: ConfigWatcher) -> None:
    replace_atomically(config, NEW, ".trigger.yaml.ansible_tmp1x2y3z")
    assert settled(watcher)
    watcher.accept()
    assert watcher.deadline() is None and not pending(watcher)
    assert not watcher.changed(T0 + 10 * DEBOUNCE), "an accepted change is reported once"


def test_an_editor_s_temporary_file_then_rename_is_one_change(config: Path, watcher: ConfigWatcher) -> None:
    replace_atomically(config, NEW, "trigger.yaml.swp")
    assert settled(watcher)


def test_a_rewrite_in_place_is_a_change(config: Path, watcher: ConfigWatcher) -> None:
    """`cat new > trigger.yaml`, or an editor that writes into the same inode."""
    with open(config, "r+b") as f:
        f.truncate(0)
        f.write(NEW)
    assert settled(watcher)


def test_a_slow_rewrite_in_place_is_seen_empty_then_whole(config: Path, watcher: ConfigWatcher) -> None:
    """The debounce lets a writer finish; one slower than it shows the truncated file first.
    The empty file is a change (the agent refuses it, keeps its config and accepts the
    digest), and the content written after it is another."""
    with open(config, "r+b") as f:
        f.truncate(0)
        assert settled(watcher, T0)
        assert file_digest(str(config)) == file_digest(os.devnull)
        watcher.accept()
        f.write(NEW)
    assert settled(watcher, T0 + 1)


def test_vim_s_backup_dance_is_a_change(config: Path, watcher: ConfigWatcher) -> None:
    """vim's default on Linux (backupcopy=auto): the file is renamed to `trigger.yaml~`, a new
    one is written under the name, then the backup is deleted."""
    backup = config.with_name("trigger.yaml~")
    os.rename(config, backup)
    config.write_bytes(NEW)
    backup.unlink()
    assert settled(watcher)


def test_a_configmap_symlink_swap_is_a_change(tmp_path: Path) -> None:
    """A Kubernetes ConfigMap volume: `trigger.yaml -> ..data/trigger.yaml`, `..data -> ..<ts>/`.
    An update writes a new `..<ts>/` directory, points `..data_tmp` at it, renames `..data_tmp`
    over `..data` and removes the old directory: the file the agent names never changes."""
    volume = tmp_path / "config"
    volume.mkdir()
    first = volume / "..2026_11_27_03_00_00.1"
    first.mkdir()
    (first / "trigger.yaml").write_bytes(OLD)
    (volume / "..data").symlink_to(first.name)
    (volume / "trigger.yaml").symlink_to("..data/trigger.yaml")
    w = ConfigWatcher(str(volume / "trigger.yaml"))
    try:
        second = volume / "..2026_11_27_03_05_00.2"
        second.mkdir()
        (second / "trigger.yaml").write_bytes(NEW)
        (volume / "..data_tmp").symlink_to(second.name)
        os.rename(volume / "..data_tmp", volume / "..data")
        (first / "trigger.yaml").unlink()
        first.rmdir()
        assert settled(w)
        assert file_digest(str(volume / "trigger.yaml")) == file_digest(str(second / "trigger.yaml"))
    finally:
        w.close()


def test_a_deleted_config_keeps_the_running_one_until_it_comes_back(
    config: Path, watcher: ConfigWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    config.unlink()
    with caplog.at_level(logging.WARNING, logger="bistouri.agent.confwatch"):
        assert not settled(watcher, T0)
    assert "Config file unreadable, keeping the running config" in caplog.text
    config.write_bytes(OLD)
    assert not settled(watcher, T0 + 1), "the same content came back: nothing to reload"
    config.unlink()
    config.write_bytes(NEW)
    assert settled(watcher, T0 + 2)


def test_a_config_absent_at_start_is_a_change_when_it_appears(tmp_path: Path) -> None:
    path = tmp_path / "trigger.yaml"
    w = ConfigWatcher(str(path))
    try:
        assert w.digest is None
        replace_atomically(path, NEW, ".trigger.yaml.tmp")
        assert settled(w)
    finally:
        w.close()


def test_the_same_content_rewritten_or_touched_is_not_a_change(config: Path, watcher: ConfigWatcher) -> None:
    replace_atomically(config, OLD, ".trigger.yaml.tmp")
    assert not settled(watcher, T0)
    os.utime(config, (0, 0))  # IN_ATTRIB, as `touch` or a chmod by configuration management
    assert not settled(watcher, T0 + 1)


def test_other_files_of_the_directory_arm_the_timer_but_change_nothing(
    config: Path, watcher: ConfigWatcher
) -> None:
    (config.parent / "other.yaml").write_bytes(NEW)
    read_events(watcher, T0)
    assert watcher.deadline() == T0 + DEBOUNCE
    assert not watcher.changed(T0 + DEBOUNCE)
    assert watcher.deadline() is None, "the timer is disarmed once it has looked"


def test_a_burst_of_writes_is_one_reload_after_the_last(config: Path, watcher: ConfigWatcher) -> None:
    """Each event restarts the debounce: the file is read once, DEBOUNCE_S after the last write."""
    for i, content in enumerate((b"targets:\n", b"targets:\n  - comm: a\n", NEW)):
        with open(config, "wb") as f:
            f.write(content)
        read_events(watcher, T0 + i * DEBOUNCE / 2)
    last = T0 + DEBOUNCE  # the third write's events were read at T0 + 2 * DEBOUNCE / 2
    assert watcher.deadline() == last + DEBOUNCE
    assert not watcher.changed(last + DEBOUNCE / 2), "inside the debounce"
    assert watcher.deadline() == last + DEBOUNCE, "asking early keeps the timer"
    assert watcher.changed(last + DEBOUNCE)
    assert not watcher.changed(last + 2 * DEBOUNCE), "reported once"


def test_a_change_not_accepted_is_reported_again_at_the_next_event(
    config: Path, watcher: ConfigWatcher
) -> None:
    """The agent does not accept a config its BPF maps refused: the next event retries it."""
    replace_atomically(config, NEW, ".trigger.yaml.tmp")
    assert settled(watcher, T0)
    (config.parent / "unrelated").touch()
    assert settled(watcher, T0 + 1)
    watcher.accept()
    (config.parent / "unrelated").touch()
    assert not settled(watcher, T0 + 2)


def test_a_missing_directory_is_an_error_at_start(tmp_path: Path) -> None:
    with pytest.raises(OSError) as e:
        ConfigWatcher(str(tmp_path / "absent" / "trigger.yaml"))
    assert e.value.errno == errno.ENOENT and "inotify_add_watch" in str(e.value)


def test_close_is_idempotent(config: Path) -> None:
    w = ConfigWatcher(str(config))
    fd = w.fileno()
    assert os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
    w.close()
    w.close()
    assert w.fileno() == -1
    assert not os.path.lexists(f"/proc/self/fd/{fd}")
