"""Start-up checks: what would fail later, refused before the pool is allocated.

A pool that does not fit shows up late and badly: a SIGBUS in a client when
the tmpfs runs out, the OOM killer when the host (or the container's cgroup)
runs out of RAM, a failed mmap when the process runs out of map slots, a spill
that fills a disk or lands in RAM again. Each check here reads the limit as
the kernel sees it and, when the configuration cannot work, says which limit,
its value, and how to fix it. ``check_host`` raises ``LimitError`` on the first
refusal; warnings (limits that only matter in some setups) are returned.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Callable

from .config import DaemonConfig
from .wire.pool import remove_stale_segments
from .wire.sizes import format_size

# RAM left to everything else on the host after the pool is reserved: the larger of the two.
MIN_HEADROOM_BYTES = 512 << 20
MIN_HEADROOM_FRACTION = 0.05
# Map slots stormd needs beyond those it uses at start: the pool, the spill file, sockets,
# threads' stacks, with room to spare.
MIN_FREE_MAPS = 1024
RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


class LimitError(RuntimeError):
    """A host limit the configuration does not fit; the message names the limit and the fix."""


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    for line in Path(path).read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup may still charge (tmpfs pages count), or None without a limit."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # cgroup v2
            limit_f, usage_f = Path(root, rel.lstrip("/"), "memory.max"), Path(root, rel.lstrip("/"), "memory.current")
        elif "memory" in controllers.split(","):
            base = Path(root, "memory", rel.lstrip("/"))
            limit_f, usage_f = base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"
        else:
            continue
        try:
            limit, usage = limit_f.read_text().strip(), int(usage_f.read_text())
        except (OSError, ValueError):
            continue
        if limit != "max" and int(limit) < (1 << 62):  # v1 says "no limit" with a huge number
            return int(limit) - usage
    return None


def host_room(read_meminfo: Callable[[], dict[str, int]] = meminfo,
              read_cgroup: Callable[[], int | None] = cgroup_room) -> tuple[int, str]:
    """The most a pool may take of this host now, and where that bound comes from: free RAM
    (MemAvailable) less the headroom everything else needs, or, when lower, what this process's
    memory cgroup may still charge less the same minimum headroom _check_ram keeps. The readers are
    parameters so that a test can stand in a host of its own."""
    info = read_meminfo()
    total, available = info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0))
    cap = max(available - _headroom(total), 0)
    source = f"MemAvailable {_mib(available)} less {_mib(_headroom(total))} headroom"
    room = read_cgroup()
    if room is not None and room - MIN_HEADROOM_BYTES < cap:
        cap = max(room - MIN_HEADROOM_BYTES, 0)
        source = f"the memory cgroup's {_mib(max(room, 0))} left under its limit, less " \
                 f"{_mib(MIN_HEADROOM_BYTES)} headroom"
    return cap, source


def _mib(n: int) -> str:
    return f"{n >> 20}MiB"


def _headroom(total: int) -> int:
    """RAM a pool leaves to everything else on a host of ``total`` bytes."""
    return max(MIN_HEADROOM_BYTES, int(MIN_HEADROOM_FRACTION * total))


def filesystem_type(path: str, mounts: str = "/proc/mounts") -> str:
    """The type of the file system holding ``path`` (the longest mount point that contains it)."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    for line in Path(mounts).read_text().splitlines():
        fields = line.split()
        if len(fields) >= 3:
            point = fields[1].replace("\\040", " ")
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


def check_host(config: DaemonConfig) -> list[str]:
    """Refuse (LimitError) what cannot work; return warnings for what might not."""
    size = config.pool_size
    _check_shm(config.pool_dir, size)
    _check_ram(size)
    _check_maps()
    if config.spill:
        _check_spill(config.spill_dir, config.spill_limit)
    return _memlock_warnings(size)


def _check_shm(directory: str, size: int) -> None:
    if not Path(directory).is_dir():
        return  # SharedPool.create says so, naming the setting
    remove_stale_segments(Path(directory))  # a killed daemon's segment is not in anyone's way
    st = os.statvfs(directory)
    avail = st.f_bavail * st.f_frsize
    if size > avail:
        raise LimitError(f"pool of {format_size(size)} does not fit in {directory} ({format_size(avail)} free); "
                         f"lower --pool-size or enlarge the tmpfs (mount -o remount,size=... {directory}; "
                         f"docker: --shm-size or --ipc=host)")


def _check_ram(size: int) -> None:
    info = meminfo()
    total, available = info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0))
    headroom = _headroom(total)
    if size + headroom > available:
        raise LimitError(
            f"pool of {format_size(size)} does not fit in free RAM: MemAvailable is {format_size(available)} and "
            f"{format_size(headroom)} must stay free for everything else, or the OOM killer steps in; "
            f"lower --pool-size (at most {format_size(max(available - headroom, 0))}) or free memory")
    room = cgroup_room()
    if room is not None and size + MIN_HEADROOM_BYTES > room:
        raise LimitError(
            f"pool of {format_size(size)} does not fit in this memory cgroup ({format_size(max(room, 0))} left under "
            f"its limit; tmpfs pages are charged to it): lower --pool-size or raise the limit "
            f"(docker: --memory; systemd: MemoryMax=)")


def _check_maps(max_map_count: str = "/proc/sys/vm/max_map_count") -> None:
    try:
        limit = int(Path(max_map_count).read_text())
    except OSError:
        return  # not Linux: no such limit
    used = len(Path("/proc/self/maps").read_text().splitlines())
    if limit - used < MIN_FREE_MAPS:
        raise LimitError(f"vm.max_map_count is {limit} and this process already uses {used} mappings; "
                         f"raise it: sysctl -w vm.max_map_count=262144 (persist in /etc/sysctl.d/)")


def _check_spill(directory: str, limit: int) -> None:
    if not Path(directory).is_dir() or not os.access(directory, os.W_OK):
        raise LimitError(f"spill_dir {directory} is not a writable directory; create it or set spill_dir")
    kind = filesystem_type(directory)
    if kind in RAM_FILESYSTEMS:
        raise LimitError(f"spill_dir {directory} is on {kind}: spilling there uses the RAM it is meant to free; "
                         f"set spill_dir to a directory on local disk")
    st = os.statvfs(directory)
    avail = st.f_bavail * st.f_frsize
    if limit > avail:
        raise LimitError(f"spill_limit {format_size(limit)} does not fit on the disk of {directory} "
                         f"({format_size(avail)} free); lower spill_limit or free disk space")


def _memlock_warnings(size: int) -> list[str]:
    """The daemon does not lock its pool; clients page-lock it with cudaHostRegister, which the
    NVIDIA driver pins itself, but RDMA or mlock-based pinning counts against RLIMIT_MEMLOCK."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < size:
        return [f"RLIMIT_MEMLOCK is {format_size(soft)}, below the pool ({format_size(size)}): pinning the pool "
                f"through mlock or RDMA registration will fail; raise it (ulimit -l unlimited; systemd: "
                f"LimitMEMLOCK=infinity; docker: --ulimit memlock=-1) if clients need that"]
    return []
