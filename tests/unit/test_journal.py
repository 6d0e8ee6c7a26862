"""The placement journal (vgpu.adapters.journal) and the container store around
it: what is durable, what a power cut or a crash leaves, what start-up restores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vgpu.adapters import budget
from vgpu.adapters.fs import SPARE_PREFIX, ContainerStore, SparePool, placement_record
from vgpu.adapters.journal import FILE_NAME, HEADER, PlacementJournal, replay
from vgpu.core.model import CardUuid, DeviceId, Owner, Placement, Resource

UNIT = 256


def placement(key: str, core: int = 20, memory_mib: int = 1024) -> Placement:
    return Placement(
        key=key,
        cards=(CardUuid("GPU-a"),),
        ids={
            Resource.CORE: frozenset(DeviceId(f"0c{i}.abcd") for i in range(core)),
            Resource.MEMORY: frozenset(DeviceId(f"0m{i}.abcd") for i in range(memory_mib // UNIT)),
        },
        core_percent=core,
        memory_mib=memory_mib,
        owner=Owner("default", f"pod-{key}", "main", f"uid-{key}"),
        created_s=1000.0,
    )


def body(p: Placement) -> bytes:
    return json.dumps(placement_record(p, UNIT)).encode()


def started(tmp_path: Path, min_bytes: int = 1 << 20) -> PlacementJournal:
    journal = PlacementJournal(tmp_path / FILE_NAME, min_bytes=min_bytes)
    journal.start({})
    return journal


def test_replay_keeps_the_last_record_of_each_key_and_drops_forgotten_ones(
    tmp_path: Path,
) -> None:
    journal = started(tmp_path)
    journal.put("k1", body(placement("k1", core=10)))
    journal.put("k2", body(placement("k2")))
    journal.put("k1", body(placement("k1", core=30)), durable=False)
    journal.forget("k2")
    journal.close()
    live = PlacementJournal(tmp_path / FILE_NAME).load()
    assert set(live) == {"k1"}
    assert live["k1"]["core_units"] == 30


def test_a_torn_last_entry_ends_the_replay_and_keeps_what_came_before(tmp_path: Path) -> None:
    journal = started(tmp_path)
    journal.put("k1", body(placement("k1")))
    journal.put("k2", body(placement("k2")))
    journal.close()
    data = bytearray((tmp_path / FILE_NAME).read_bytes())
    end = data.index(b"\0" * 64, HEADER.size)  # the zero tail after the last entry
    data[end - 10 : end] = b"\xff" * 10  # the second entry's last bytes never reached the disk
    live, _, clean = replay(bytes(data))
    assert not clean
    assert set(live) == {"k1"}


@pytest.mark.parametrize("data", [b"", b"garbage" * 10, b"\0" * 4096])
def test_no_journal_or_a_foreign_file_replays_to_nothing(data: bytes) -> None:
    live, _, _ = replay(data)
    assert live == {}


def test_a_full_journal_is_rewritten_with_the_live_records_only(tmp_path: Path) -> None:
    journal = started(tmp_path, min_bytes=16 * 1024)
    for i in range(200):  # ~100 KiB of entries into a 16 KiB journal
        key = f"k{i % 5}"
        journal.put(key, body(placement(key, core=1 + i % 50)))
    assert journal.rewrites > 2
    journal.forget("k4")
    journal.close()
    live = PlacementJournal(tmp_path / FILE_NAME).load()
    assert set(live) == {"k0", "k1", "k2", "k3"}
    assert live["k3"]["core_units"] == 1 + 198 % 50
    # Sized by the live records (at least 4x their bytes), not by the history.
    assert (tmp_path / FILE_NAME).stat().st_size <= 64 * 1024


def test_the_journal_is_zero_filled_to_its_size_when_made(tmp_path: Path) -> None:
    """Written, not fallocate'd: an overwrite then needs no metadata commit."""
    started(tmp_path).close()
    path = tmp_path / FILE_NAME
    assert path.stat().st_size == 1 << 20
    assert path.stat().st_blocks * 512 >= 1 << 20  # allocated, not sparse
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)


def test_an_inactive_journal_refuses_writes(tmp_path: Path) -> None:
    journal = PlacementJournal(tmp_path / FILE_NAME)
    assert not journal.active
    with pytest.raises(RuntimeError):
        journal.put("k", b"{}")


# ---------------------------------------------------------------- the store


def store_at(state: Path) -> ContainerStore:
    """A store whose spare directories are made by the test itself, if any."""
    store = ContainerStore(state, UNIT)
    store.root.mkdir(parents=True, exist_ok=True)
    store.spares.start = lambda: None  # type: ignore[method-assign]
    return store


def test_with_the_journal_only_its_entry_is_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_at(tmp_path)
    store.recover()
    assert store.journal.active
    synced: list[str] = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append("fsync"))
    monkeypatch.setattr(os, "fdatasync", lambda fd: synced.append("fdatasync"))
    p = placement("k1")
    paths = store.write(p, durable=False, complete=False)  # a container's first resource
    assert synced == []
    assert paths.budget_file.is_file()
    assert json.loads(paths.config_file.read_text()) == placement_record(p, UNIT)
    q = placement("k1", core=30)
    store.write(q)  # its last: durable
    assert synced == ["fdatasync"]
    assert json.loads(paths.config_file.read_text()) == placement_record(q, UNIT)
    assert PlacementJournal(store.journal.path).load()["k1"] == placement_record(q, UNIT)


def test_start_up_restores_a_directory_the_disk_lost(tmp_path: Path) -> None:
    """A power cut after Allocate: the journal's entry was synced, the directory
    (written without an fsync) was not committed."""
    store = store_at(tmp_path)
    store.recover()
    p = placement("k1")
    paths = store.write(p)
    store.close()
    os.unlink(paths.config_file)
    os.unlink(paths.budget_file)
    os.rmdir(paths.shared_dir)
    os.rmdir(paths.config_dir)

    again = store_at(tmp_path)
    placements, bad = again.recover()
    assert placements == [p]
    assert bad == []
    assert json.loads(paths.config_file.read_text()) == placement_record(p, UNIT)
    assert paths.budget_file.stat().st_size == budget.FILE_BYTES


def test_start_up_prefers_the_journal_over_an_older_or_torn_config(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.recover()
    old, new = placement("k1", core=10), placement("k1", core=40)
    paths = store.write(old)
    store.journal.put("k1", body(new))  # a crash before config.json was replaced
    paths.config_file.write_text('{"version": 1, "key": "k1", "car')  # or torn
    store.close()
    placements, bad = store_at(tmp_path).recover()
    assert placements == [new]
    assert bad == []


def test_records_of_a_version_without_the_journal_are_kept_and_journaled(tmp_path: Path) -> None:
    before = store_at(tmp_path)
    p = placement("k1")
    before.write(p)  # no journal started: config.json fsync'ed, as before it
    assert not (tmp_path / FILE_NAME).exists()
    placements, _ = store_at(tmp_path).recover()
    assert placements == [p]
    assert set(PlacementJournal(tmp_path / FILE_NAME).load()) == {"k1"}


def test_a_released_record_is_not_restored(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.recover()
    store.write(placement("k1"))
    store.write(placement("k2"))
    assert store.discard("k1") is None
    store.close()
    placements, _ = store_at(tmp_path).recover()
    assert [p.key for p in placements] == ["k2"]


def test_status_reading_the_store_never_starts_the_journal(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.write(placement("k1"))
    store.load_all()
    assert not (tmp_path / FILE_NAME).exists()
    assert not store.journal.active


# ----------------------------------------------------------------- spares


def test_a_spare_directory_becomes_a_placement_with_a_fresh_budget_file(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.recover()
    store.spares._make()
    assert store.spares.ready() == 1
    p = placement("k1")
    paths = store.write(p, durable=False, complete=False)
    assert store.spares.ready() == 0
    assert not list(store.root.glob(f"{SPARE_PREFIX}*"))
    assert paths.budget_file.stat().st_size == budget.FILE_BYTES
    assert oct(paths.budget_file.stat().st_mode & 0o777) == oct(0o666)
    assert json.loads(paths.config_file.read_text()) == placement_record(p, UNIT)
    store.write(p)
    assert json.loads(paths.config_file.read_text()) == placement_record(p, UNIT)
    assert store.record_keys() == ["k1"]


def test_spares_left_by_an_earlier_run_are_taken_again_or_trashed(tmp_path: Path) -> None:
    root = tmp_path / "containers"
    root.mkdir()
    trashed: list[Path] = []
    pool = SparePool(root, trashed.append)
    pool._make()
    pool._make()
    good, bad = sorted(root.iterdir())
    (bad / "config.json").unlink()  # a crash while it was being made
    again = SparePool(root, trashed.append)
    again._adopt_leftovers()
    assert again.ready() == 1
    assert trashed == [bad]
    assert again.take(root / "key")
    assert (root / "key" / "shared" / budget.FILE_NAME).is_file()
    assert not good.exists()


def test_spares_keep_off_a_nearly_full_disk_and_give_their_space_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "containers"
    root.mkdir()
    trashed: list[Path] = []
    pool = SparePool(root, trashed.append)
    pool._make()
    assert pool.ready() == 1
    real = os.statvfs(root)

    class Nearly:  # 60 MiB free: under the 64 MiB kept for records
        f_frsize = real.f_frsize
        f_blocks = real.f_blocks
        f_bavail = (60 << 20) // real.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda path: Nearly)
    with pytest.raises(OSError):
        pool._make()
    pool.drain()
    assert pool.ready() == 0
    assert len(trashed) == 1
