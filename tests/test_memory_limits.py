"""Start-up checks: stormd refuses a configuration the host cannot hold, naming the limit and the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stormd import limits


def run_stormd(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stormd", "--socket", str(tmp_path / "run" / "s.sock"),
                           "--no-metrics", *args], capture_output=True, text=True, timeout=60)


def test_pool_larger_than_free_ram_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(limits, "meminfo", lambda: {"MemTotal": 8 << 30, "MemAvailable": 2 << 30})
    monkeypatch.setattr(limits, "cgroup_room", lambda: None)
    with pytest.raises(limits.LimitError, match="MemAvailable.*lower --pool-size"):
        limits._check_ram(2 << 30)
    limits._check_ram(1 << 30)  # 1 GiB leaves the headroom


def test_cgroup_limit_is_read_and_enforced(tmp_path, monkeypatch):
    (tmp_path / "cg" / "job").mkdir(parents=True)
    (tmp_path / "cg" / "job" / "memory.max").write_text(f"{1 << 30}\n")
    (tmp_path / "cg" / "job" / "memory.current").write_text(f"{256 << 20}\n")
    (tmp_path / "self").write_text("0::/job\n")
    assert limits.cgroup_room(str(tmp_path / "self"), str(tmp_path / "cg")) == (1 << 30) - (256 << 20)
    monkeypatch.setattr(limits, "meminfo", lambda: {"MemTotal": 64 << 30, "MemAvailable": 60 << 30})
    monkeypatch.setattr(limits, "cgroup_room", lambda: 768 << 20)
    with pytest.raises(limits.LimitError, match="memory cgroup.*MemoryMax"):
        limits._check_ram(512 << 20)


def test_spill_on_tmpfs_or_missing_dir_is_refused(tmp_path):
    r = run_stormd(tmp_path, "--pool-size", "1MiB", "--spill", "--spill-dir", "/dev/shm")
    assert r.returncode == 2 and "spill_dir /dev/shm is on tmpfs" in r.stderr, r.stderr
    r = run_stormd(tmp_path, "--pool-size", "1MiB", "--spill", "--spill-dir", str(tmp_path / "nope"))
    assert r.returncode == 2 and "not a writable directory" in r.stderr, r.stderr
    r = run_stormd(tmp_path, "--pool-size", "1MiB", "--spill", "--spill-dir", "/var/tmp", "--spill-limit", "1000TiB")
    assert r.returncode == 2 and "does not fit on the disk" in r.stderr, r.stderr


def test_map_count_and_memlock(monkeypatch, tmp_path):
    f = tmp_path / "max_map_count"
    f.write_text("100\n")
    with pytest.raises(limits.LimitError, match="vm.max_map_count is 100.*sysctl -w vm.max_map_count"):
        limits._check_maps(str(f))
    f.write_text("1000000\n")
    limits._check_maps(str(f))
    monkeypatch.setattr(limits.resource, "getrlimit", lambda _: (64 << 10, 64 << 10))
    assert "LimitMEMLOCK=infinity" in limits._memlock_warnings(1 << 30)[0]
    assert limits._memlock_warnings(32 << 10) == []


def test_filesystem_type_uses_the_longest_mount_point(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\ntmpfs /scratch tmpfs rw 0 0\n")
    assert limits.filesystem_type("/scratch/spill", str(mounts)) == "tmpfs"
    assert limits.filesystem_type("/scratchy", str(mounts)) == "ext4"
