"""DDP (or FSDP2) ranks of one node with no offload, an embedded store each, and one shared stormd.

In one run: bit-identical steps, step times against the link's floor, and what the daemon buys.

    python bench/ddp.py --ranks 1 2 4 --models W1 W3 \\
        --out bench/results/ddp-<device>-<date>-<commit>.json               # a node of 4 GPUs
    python bench/ddp.py --ranks 1 2 --wrapper fsdp2 --out bench/results/fsdp2-<device>-<date>-<commit>.json
    python bench/ddp.py --ranks 1 2 --tiny --device cpu --pool-size 64MiB --out /tmp/ddp.json  # gloo, a smoke run

Starts one stormd (pool: --daemon-pool-size, default --pool-size times the most ranks), then runs
torchrun once per rank count of --ranks (default: every power of two up to the CUDA devices; 1 and 2
on CPU). One process holds an embedded session and a daemon session side by side (storm keeps one
per mode and endpoint), so every rank runs all three rows in the same launch: for each model of
--models (bench/common.py's W1 and W3, --tiny their smoke sizes) it builds the model once, then runs
--rounds rounds; each round runs --steps steps of each row in turn ("none": no offload; "embedded":
storm.offload(mode="embedded", pool_size=--pool-size); "daemon": storm.offload(mode="daemon")), the
row order rotating by round, each row from the same initial parameters with the same inputs. The
JSON is rewritten after each rank count; --resume keeps those --out holds and runs the others.

Per rank count and model the JSON has, per row and rank: the median step (forward and backward, the
first --warmup steps of each row in each round left out) and each round's (round_ms),
identical_steps (steps whose loss and gradient hashes, after DDP's all-reduce, equal no offload's
same step in the same round; for "none", round 0's), and from the offload context's stats of its
last step: offloaded_bytes (what the step sent to the store), to_host_bytes and to_device_bytes
(what landed there and what backward fetched: less where backward took a save back before its copy
began: copies_dropped of dropped_bytes), and the link floor: offloaded_bytes out and back over the
rank's pinned link measured with all ranks copying at once (link_together_GBps, to host and to
device), floor_ms, and step_over_floor; pack_ms and fetch_wait_ms (the training thread's time
offloading saves, and waiting for fetched bytes); peak_bytes (CUDA: the most the GPU held above the
row's start, over its rounds); daemon_over_embedded (per rank, their median, and per round from the
ranks' round medians: its spread within the launch); and for the daemon row, daemon_loop: the share
of the rows' wall time its event loop, which answers every rank in turn, spent answering
(busy_fraction), the host time a request took there (us_per_request), and requests_per_step, every
rank's, from its STATUS.

What the daemon buys, per rank count:
  page_locked: host memory page-locked for CUDA copies (cudaHostRegister); nothing is on CPU.
    embedded: the bytes each rank's own registrations cover (its pool's cuda_ranges, read after the
    steps), summed over ranks; daemon: what the daemon registered of its pool, once at start (its
    STATUS says how many bytes, and the seconds it took), plus per rank what the rank registered of it
    itself (the same pages; nonzero only where a rank copies into the pool itself, e.g. frames). pool_bytes:
    the pools' sizes (the daemon's as its HELLO announced it); peak_bytes: their high-water marks
    (the daemon's node-wide, since it started: rank counts run in increasing order).
    proc_status_kB: VmLck and VmPin of each process, where the kernel counts the pins.
  startup_s: embedded, per rank: creating its store (pool mapping and session) and page-locking its
    pool, which the bench does up front, timed, as the first CUDA copy would; all ranks at once.
    daemon: from its process's start until it serves, as its STATUS says (interpreter and imports, pool
    reserved, CUDA contexts, page-lock), the page-lock alone, and per rank the connect (HELLO, the pool
    mapped).

--spill starts stormd with spill to disk: with a daemon pool smaller than what the ranks offload
(--daemon-pool-size), the daemon row still offloads it all, where each embedded store, its pool
--pool-size, keeps on the GPU what does not fit (kept "pool full", and its peak_bytes).

--switch-interval S sets each rank's sys.setswitchinterval (the JSON's switch_interval_s, per rank):
how long the thread taking stormd's replies may wait for the GIL while the training thread runs
Python, a launch against one with Python's default telling whether that wait costs the daemon row.

--profile DIR writes per rank, model and row a torch.profiler key_averages table and trace of two more steps
(read at the end by bench/trace_gaps.py into the JSON's "profile": where the compute stream idled)
and the training thread's cProfile of two after them, and runs stormd under cProfile (its stats in
DIR/stormd-cprofile.txt; start_s then includes it). That is many files: a lent GPU machine returns
few, so pack the folder into one (tar) before it comes back.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before torch initialises CUDA

import argparse  # noqa: E402
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Iterator  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import storm  # noqa: E402
import trace_gaps  # noqa: E402
from common import (  # noqa: E402
    Llama,
    Workload,
    method_context,
    start_daemon,
    step_digest,
    stop_daemon,
    synchronize,
    workloads,
    write,
)
from stormd.ctl import request  # noqa: E402
from stormd.wire.cuda import register_pool  # noqa: E402
from stormd.wire.sizes import format_size, parse_size  # noqa: E402

ROWS = ("none", "embedded", "daemon")
TINY_OF = {"W1": "tiny", "W2": "tiny", "W3": "W3-tiny", "W3L": "W3-tiny"}  # --tiny: each model's smoke size


# Pure helpers

def default_ranks(cuda_devices: int) -> list[int]:
    """Every power of two up to the CUDA devices; 1 and 2 without any (gloo ranks on CPU)."""
    return [1 << i for i in range(cuda_devices.bit_length())] if cuda_devices else [1, 2]


def floor_ms(to_host: int, to_device: int, link: list[float]) -> float:
    """The least time a step's offload takes on the link: ``to_host`` bytes at link[0] GB/s, then
    ``to_device`` at link[1] (forward sends, backward fetches: one after the other)."""
    return (to_host / link[0] + to_device / link[1]) / 1e6


def budget(text: str | None) -> str | float | None:
    """--budget: a fraction (0.25) or bytes (2GiB), as storm.offload takes it."""
    try:
        return float(text) if text is not None else None
    except ValueError:
        return text


def per_rank(rows: list[dict]) -> dict:
    """One dict of lists from one dict per rank (the same keys)."""
    return {k: [r[k] for r in rows] for k in rows[0]}


def ratio(a: float, b: float) -> float | None:
    """a / b to three places; None where b is 0."""
    return round(a / b, 3) if b else None


def locked_kib(pid: int | str = "self") -> dict[str, int]:
    """VmLck and VmPin (kB) of /proc/<pid>/status: mlock'd and long-term pinned pages, as far as the
    kernel counts them (a driver's pins need not show)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    fields = (line.split(":", 1) for line in lines if ":" in line)
    return {k: int(v.split()[0]) for k, v in fields if k in ("VmLck", "VmPin")}


def summarize_launch(ranks: list[dict], daemon: dict) -> dict:
    """One launch's JSON from its ranks' own (worker's) and the daemon's figures."""
    models = {}
    for name in ranks[0]["models"]:
        rows = {row: per_rank([r["models"][name]["rows"][row] for r in ranks]) for row in ROWS}
        for row in rows.values():
            row["steps"] = row["steps"][0]  # the same on every rank
            if "daemon_loop" in row:
                row["daemon_loop"] = row["daemon_loop"][0]  # node-wide, read by rank 0
            row["step_ms_median"] = round(statistics.median(row["step_ms"]), 2)
        each = [ratio(d, e) for d, e in zip(rows["daemon"]["step_ms"], rows["embedded"]["step_ms"])]
        # per round, the ranks' medians: how far the ratio moves within one launch
        by_round = [ratio(statistics.median(d), statistics.median(e)) for d, e in
                    zip(zip(*rows["daemon"]["round_ms"]), zip(*rows["embedded"]["round_ms"]))]
        models[name] = {"workload": ranks[0]["models"][name]["workload"], "rows": rows,
                        "daemon_over_embedded": {"median": round(statistics.median(each), 3), "per_rank": each,
                                                 "per_round": by_round}}
    emb, dae = per_rank([r["pools"]["embedded"] for r in ranks]), per_rank([r["pools"]["daemon"] for r in ranks])
    start = per_rank([r["startup_s"] for r in ranks])
    return {"ranks": len(ranks), "link_alone_GBps": [r["link_alone_GBps"] for r in ranks],
            "link_together_GBps": [r["link_together_GBps"] for r in ranks], "models": models,
            "page_locked": {
                "embedded": {"bytes": sum(emb["page_locked_bytes"]), "per_rank": emb["page_locked_bytes"],
                             "pool_bytes": sum(emb["pool_bytes"]), "peak_bytes": sum(emb["peak_bytes"])},
                "daemon": {"bytes": daemon["page_locked_bytes"], "ranks_own_bytes": dae["page_locked_bytes"],
                           "pool_bytes": dae["pool_bytes"][0], "peak_bytes": max(dae["peak_bytes"])}},
            "startup_s": {
                "embedded": {"per_rank": [round(c + p, 3) for c, p in zip(start["create"], start["page_lock"])],
                             "create": start["create"], "page_lock": start["page_lock"]},
                "daemon": {"start": daemon["start_s"], "page_lock": daemon["page_lock_s"],
                           "connect_per_rank": start["connect"]}},
            "proc_status_kB": [r["proc_status_kB"] for r in ranks],
            "switch_interval_s": [r["switch_interval_s"] for r in ranks]}


def passed(run: dict) -> bool:
    """Every step of every row identical, and the offload rows offloaded something."""
    return all(s == row["steps"] for m in run["models"].values() for row in m["rows"].values()
               for s in row["identical_steps"]) \
        and all(b > 0 for m in run["models"].values() for r in ("embedded", "daemon")
                for b in m["rows"][r]["offloaded_bytes"])


# One rank

def wrap(model: torch.nn.Module, w: Workload | Llama, wrapper: str, device: torch.device) -> torch.nn.Module:
    """DDP around the model, or FSDP2: each block sharded, then the rest (torch.distributed.fsdp.fully_shard)."""
    if wrapper == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard
    for block in w.blocks(model):
        fully_shard(block)
    return fully_shard(model)


def inputs(w: Workload | Llama, step: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Step ``step``'s input on this rank, the same for every row and round: tokens for a Llama, else
    activations of W1's shape."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    if isinstance(w, Llama):
        return torch.randint(0, w.vocab, (w.batch, w.seq), generator=g).to(device)
    return torch.randn(w.batch, w.seq, w.d, generator=g).to(device, dtype)


def start_together(device: torch.device) -> None:
    """Every rank starts the step at once. Hashing last step's gradients (outside the timer) takes
    ranks different times; without this, the first rank to finish waits for the others in DDP's
    all-reduce inside its timed step, and the skew counts as step time."""
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    synchronize(device)


def step(w: Workload | Llama, net: torch.nn.Module, model: torch.nn.Module, x: torch.Tensor, opts: dict | None,
         opt: torch.optim.Optimizer, device: torch.device) -> tuple[float, str, storm.OffloadStats | None]:
    """One training step: its seconds (forward and backward), a hash of its loss and of every
    gradient as the optimizer sees it, and the offload's stats (None without)."""
    start_together(device)
    t0 = time.perf_counter()
    with method_context("storm" if opts else "none", opts or {}) as ctx:
        y = w.forward(net, x)
    loss = w.objective(y)
    loss.backward()
    synchronize(device)
    seconds = time.perf_counter() - t0
    if opts:
        ctx.synchronize()  # its counters settled
    digest = step_digest(loss, model)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return seconds, digest, ctx.stats if opts else None


def run_model(w: Workload | Llama, a: argparse.Namespace, opts: dict[str, dict | None], device: torch.device,
              link: list[float]) -> dict:
    """--rounds rounds of --steps steps of each row on ``w``, built once: each row's figures on this rank."""
    model, _ = w.build(device)
    net = wrap(model, w, a.wrapper, device)
    state = [*model.parameters(), *model.buffers()]
    initial = [t.detach().clone() for t in state]
    xs = [inputs(w, s, device, next(model.parameters()).dtype) for s in range(a.steps)]
    # DDP lays its gradient buckets out again after the first backward, in the order gradients came;
    # with more than two ranks the all-reduce's order of addition follows the buckets, so every row's
    # steps would differ from those of the row that ran first. One backward before the rows settles them
    w.objective(w.forward(net, xs[0])).backward()
    model.zero_grad(set_to_none=True)
    times: dict[str, list[float]] = {r: [] for r in opts}
    round_medians: dict[str, list[float]] = {r: [] for r in opts}
    hashes: dict[str, list[list[str]]] = {r: [] for r in opts}
    last: dict[str, storm.OffloadStats] = {}
    loop = {"requests": 0, "busy_s": 0.0, "wall_s": 0.0}  # the daemon's event loop over its rows (rank 0 reads it)

    peaks: dict[str, int] = {}  # per row: the most the GPU held above the row's start, over its rounds

    def row_steps(name: str, steps: int = a.steps) -> list[tuple[float, str, storm.OffloadStats | None]]:
        with torch.no_grad():  # each row from the same parameters; SGD keeps no state to reset
            for t, t0 in zip(state, initial):
                t.copy_(t0)
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            at_start = torch.cuda.memory_allocated(device)
        done = [step(w, net, model, x, opts[name], opt, device) for x in xs[:steps]]
        if device.type == "cuda":
            peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated(device) - at_start)
        return done

    for r in range(a.rounds):
        # rotated each round (the same order on every rank: DDP's collectives must match), so that
        # no row always runs after the same one
        for name in ROWS[r % len(ROWS):] + ROWS[:r % len(ROWS)]:
            if name == "daemon" and dist.get_rank() == 0:
                with daemon_load(a.socket, loop):
                    done = row_steps(name)
            else:
                done = row_steps(name)
            times[name] += [s for s, _, _ in done[a.warmup:]]
            round_medians[name].append(statistics.median(s for s, _, _ in done[a.warmup:]))
            hashes[name].append([h for _, h, _ in done])
            if done[-1][2] is not None:
                last[name] = done[-1][2]
    measured = dict(peaks)  # the rounds' (the profiled steps below are not rows' steps)
    if a.profile:
        profile_rows(w, a.profile, row_steps, device)
    rows = {}
    for name in ROWS:
        ref = hashes["none"] if name != "none" else [hashes["none"][0]] * a.rounds
        row = {"step_ms": round(statistics.median(times[name]) * 1e3, 2),
               "round_ms": [round(m * 1e3, 2) for m in round_medians[name]], "steps": a.rounds * a.steps,
               "identical_steps": sum(h == g for hs, gs in zip(hashes[name], ref) for h, g in zip(hs, gs))}
        if name in measured:
            row["peak_bytes"] = measured[name]
        if name == "daemon":
            row["daemon_loop"] = loop_figures(loop, a.rounds * a.steps) if dist.get_rank() == 0 else None
        if name in last:
            st = last[name]
            # the floor moves every offloaded byte out and back (raw, the rows' codec); what did move can
            # be less: a save that backward takes back before its copy began never crosses (copies_dropped,
            # dropped_bytes)
            floor = floor_ms(st.offloaded_bytes, st.offloaded_bytes, link)
            row.update(offloaded_bytes=st.offloaded_bytes, to_host_bytes=st.stored_bytes,
                       to_device_bytes=st.fetched_bytes, offloaded_tensors=st.offloaded,
                       copies_dropped=st.copies_dropped, dropped_bytes=st.dropped_bytes, kept=dict(st.kept),
                       pack_ms=round(st.pack_s * 1e3, 2), fetch_wait_ms=round(st.fetch_wait_s * 1e3, 2),
                       floor_ms=round(floor, 3), step_over_floor=ratio(row["step_ms"], floor))
        rows[name] = row
    return {"workload": dataclasses.asdict(w), "rows": rows}


@contextlib.contextmanager
def daemon_load(socket: str, into: dict) -> Iterator[None]:
    """Add to ``into`` what the daemon's event loop answered, and the seconds it spent at it, while
    the block ran (its STATUS before and after; every rank's requests count, the loop serves them all)."""
    before, t0 = request(socket, "STATUS", timeout=30)["traffic"], time.perf_counter()
    yield
    wall, after = time.perf_counter() - t0, request(socket, "STATUS", timeout=30)["traffic"]
    into["requests"] += after["requests"] - before["requests"] - 1  # the first STATUS itself
    into["busy_s"] += after["busy_s"] - before["busy_s"]
    into["wall_s"] += wall


def loop_figures(loop: dict, steps: int) -> dict:
    """The daemon's load over its rows, node-wide: the share of the rows' wall time its loop spent
    answering, the host time a request took there, and requests per step (all ranks')."""
    return {"busy_fraction": round(loop["busy_s"] / loop["wall_s"], 3) if loop["wall_s"] else None,
            "us_per_request": round(1e6 * loop["busy_s"] / loop["requests"], 1) if loop["requests"] else None,
            "requests_per_step": round(loop["requests"] / steps, 1)}


def profile_rows(w: Workload | Llama, folder: str, row_steps: Callable[[str, int], object],
                 device: torch.device) -> None:
    """Into ``folder`` (--profile), per rank and row: a torch.profiler table and trace of two steps, and where
    the training thread's host time went in two more (cProfile: STORM's functions by cumulative
    time, then the most time of their own)."""
    activities = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for name in ROWS:
        out = Path(folder) / f"ranks{dist.get_world_size()}-{w.name}-{name}-rank{dist.get_rank()}"
        with torch.profiler.profile(activities=activities) as prof:
            row_steps(name, 2)
        out.with_suffix(".txt").write_text(prof.key_averages().table(sort_by=key, row_limit=40))
        prof.export_chrome_trace(f"{out}.trace.json.gz")  # the timeline: where the compute stream waited
        host = cProfile.Profile()
        host.enable()
        row_steps(name, 2)
        host.disable()
        with out.with_suffix(".cprofile.txt").open("w") as f:
            stats = pstats.Stats(host, stream=f)
            stats.sort_stats("cumulative").print_stats("storm", 30)
            stats.sort_stats("tottime").print_stats(20)


def read_traces(folder: Path) -> dict[str, dict]:
    """Per trace --profile wrote, bench/trace_gaps.py's reading of it: where each step's compute stream
    idled (DDP's forward opens a step) and the host time of backward's nodes. In the JSON, so that
    a lent machine, which returns few files, need not send the traces back."""
    return {path.name: {"steps": trace_gaps.steps(events, "DistributedDataParallel.forward"),
                        "backward_host": trace_gaps.backward_host(events)}
            for path in sorted(folder.glob("*.trace.json.gz")) for events in [trace_gaps.load(path)]}


def link_alone_and_together(device: torch.device) -> dict[str, list[float]]:
    """This rank's pinned GB/s (to host, to device): alone (ranks take turns), then all at once."""
    alone = None
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if turn == dist.get_rank():
            alone = storm.planner.link_bandwidth(device)
    dist.barrier()
    together = storm.planner.link_bandwidth(device)
    return {"link_alone_GBps": [round(v, 1) for v in alone], "link_together_GBps": [round(v, 1) for v in together]}


def open_sessions(a: argparse.Namespace, device: torch.device) -> tuple[dict, dict]:
    """This rank's embedded and daemon sessions, which every storm.offload of the row then reuses,
    all ranks at once: the seconds each took to open (the embedded pool page-locked here, as its
    first CUDA copy would do it)."""
    dist.barrier()
    t0 = time.perf_counter()
    embedded = storm.registry.session_for("embedded", None, a.pool_size)
    t1 = time.perf_counter()
    if device.type == "cuda":
        register_pool(embedded.backend.pool)
    t2 = time.perf_counter()
    dist.barrier()
    t3 = time.perf_counter()
    daemon = storm.registry.session_for("daemon", a.socket, None)
    t4 = time.perf_counter()
    return ({"create": round(t1 - t0, 3), "page_lock": round(t2 - t1, 3), "connect": round(t4 - t3, 3)},
            {"embedded": embedded, "daemon": daemon})


def pool_stats(session: object) -> dict[str, int]:
    """A session's pool: its size, its store's high-water mark, and what this process page-locked of it."""
    session.synchronize()
    node = session.mover.request("STATS").result(timeout=10)["node"]
    pool = session.backend.pool
    return {"pool_bytes": pool.size, "peak_bytes": node["peak"], "page_locked_bytes": pool.page_locked_bytes}


def worker(a: argparse.Namespace) -> None:
    torch.use_deterministic_algorithms(True)
    if a.switch_interval:  # how soon the thread taking stormd's replies gets the GIL from the one training
        sys.setswitchinterval(a.switch_interval)
    cuda = a.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    a.socket = a.sockets[local % len(a.sockets)]  # --daemons
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    link = link_alone_and_together(device)
    startup, sessions = open_sessions(a, device)
    common = {"min_bytes": 0 if a.tiny else 1 << 20, "budget": budget(a.budget)}
    opts = {"none": None, "embedded": {"mode": "embedded", "pool_size": a.pool_size, **common},
            "daemon": {"mode": "daemon", "socket": a.socket, **common}}
    models = {}
    for w in chosen(a):
        models[w.name] = run_model(w, a, opts, device, link["link_together_GBps"])
        if cuda:  # the model's memory, gone with run_model's frame, back before the next one's
            torch.cuda.empty_cache()
    row = {"rank": rank, **link, "startup_s": startup, "models": models, "switch_interval_s": sys.getswitchinterval(),
           "pools": {mode: pool_stats(s) for mode, s in sessions.items()}, "proc_status_kB": locked_kib()}
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(a.result).write_text(json.dumps(rows))
    dist.destroy_process_group()


def chosen(a: argparse.Namespace) -> list[Workload | Llama]:
    """--models, at their smoke sizes with --tiny, else at --batch where given."""
    return workloads([TINY_OF.get(m, m) for m in a.models] if a.tiny else a.models, None if a.tiny else a.batch)


# The node: its stormd (one, or --daemons), a torchrun per rank count

def start(workdir: Path, pool_size: str, profile: Path | None, spill: bool = False, spill_limit: str | None = None
          ) -> tuple[subprocess.Popen, str, dict]:
    """A stormd logging to workdir/stormd.log, under cProfile with --profile, spilling to
    workdir/spill with --spill (at most ``spill_limit``, None: stormd's default, which the disk must
    have free as it starts): the process, its endpoint, and what its STATUS says of its start:
    the seconds from its process start to serving, the bytes it page-locked and the seconds that
    took (None where it locked none)."""
    profiler = ["-m", "cProfile", "-o", str(profile / "stormd.prof")] if profile is not None else []
    flags: tuple[str, ...] = ()
    if spill:
        (workdir / "spill").mkdir()
        flags = ("--spill", "--spill-dir", str(workdir / "spill"))
        if spill_limit is not None:
            flags += ("--spill-limit", spill_limit)
    proc, endpoint = start_daemon(workdir, pool_size, *flags, log=workdir / "stormd.log", python_args=profiler)
    status = request(endpoint, "STATUS", timeout=30)
    return proc, endpoint, {"start_s": status["startup_s"], "page_lock_s": status["page_lock_s"],
                            "page_locked_bytes": status["node"]["page_locked_bytes"]}


def start_all(workdir: Path, pool_size: str, count: int, profile: Path | None, spill: bool = False,
              spill_limit: str | None = None) -> tuple[list[subprocess.Popen], list[str], dict]:
    """``count`` stormd (--daemons), each with its share of ``pool_size``, the first under cProfile with
    --profile: the processes, their endpoints and their start's figures together (the bytes
    page-locked summed, the longest start and page-lock)."""
    share = format_size(parse_size(pool_size) // count)
    started = []
    for i in range(count):
        (workdir / f"d{i}").mkdir()
        started.append(start(workdir / f"d{i}", share, profile if i == 0 else None, spill, spill_limit))
    figures = [f for _, _, f in started]
    return [p for p, _, _ in started], [e for _, e, _ in started], {
        "start_s": max(f["start_s"] for f in figures),
        "page_lock_s": None if figures[0]["page_lock_s"] is None else max(f["page_lock_s"] for f in figures),
        "page_locked_bytes": sum(f["page_locked_bytes"] for f in figures)}


def launch(a: argparse.Namespace, nproc: int, endpoints: list[str], tmp: str) -> list[dict]:
    """torchrun with ``nproc`` ranks of this script: each rank's figures. Rank r uses endpoints[r % len]."""
    args, result = Path(tmp) / f"args-{nproc}.json", Path(tmp) / f"ranks-{nproc}.json"
    args.write_text(json.dumps({**vars(a), "sockets": endpoints, "result": str(result)}))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                    __file__, "--worker", str(args)], check=True)
    return json.loads(result.read_text())


def table(results: dict) -> str:
    """The runs in a few lines: per rank count, model and row, medians over ranks."""
    lines = [f"{'ranks':>5} {'model':<8} {'row':<9} {'step_ms':>9} {'identical':>9} {'floor_ms':>9} "
             f"{'step/floor':>10} {'daemon/emb':>10} {'pack_ms':>8} {'wait_ms':>8} {'loop busy':>9} {'us/req':>7}"]
    for n, run in results["runs"].items():
        for name, m in run["models"].items():
            for row, r in m["rows"].items():
                floor = f"{statistics.median(r['floor_ms']):9.2f} {statistics.median(r['step_over_floor']):10.2f}" \
                    if "floor_ms" in r else " " * 20
                extra = f" {m['daemon_over_embedded']['median']:10.3f}" if row == "daemon" else " " * 11
                if "pack_ms" in r:
                    extra += f" {statistics.median(r['pack_ms']):8.2f} {statistics.median(r['fetch_wait_ms']):8.2f}"
                if "peak_bytes" in r:
                    extra += f" peak GiB {max(r['peak_bytes']) / 2**30:.2f}"
                if r.get("daemon_loop"):
                    extra += f" {r['daemon_loop']['busy_fraction']:9.3f} {r['daemon_loop']['us_per_request']:7.1f}"
                lines.append(f"{n:>5} {name:<8} {row:<9} {r['step_ms_median']:9.2f} "
                             f"{min(r['identical_steps']):>4}/{r['steps']:<4} {floor}{extra}")
            by_round = m["daemon_over_embedded"].get("per_round")  # absent from a JSON before it was kept
            if by_round:
                lines.append(f"{n:>5} {name:<8} daemon/emb by round: {', '.join(f'{x:.3f}' for x in by_round)}")
        pl, su = run["page_locked"], run["startup_s"]
        lines.append(f"{n:>5} page-locked GiB: embedded {pl['embedded']['bytes'] / 2**30:.2f}, daemon "
                     f"{pl['daemon']['bytes'] / 2**30:.2f}; start-up s: embedded per rank (max) "
                     f"{max(su['embedded']['per_rank']):.2f}, daemon {su['daemon']['start']:.2f} + connect (max) "
                     f"{max(su['daemon']['connect_per_rank']):.3f}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", help="rank counts, one torchrun each (default: every power "
                   "of two up to the CUDA devices; 1 2 on CPU)")
    p.add_argument("--models", nargs="+", default=["W1", "W3"], help="bench/common.py's workloads (W1, W3, ...)")
    p.add_argument("--tiny", action="store_true", help="each model's smoke size (tiny, W3-tiny): CPU runs")
    p.add_argument("--steps", type=int, default=6, help="steps per row per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="steps of each row in each round left out of its median")
    p.add_argument("--batch", type=int, help="batch per rank (default: the workload's)")
    p.add_argument("--pool-size", default="16GiB", help="each rank's embedded pool (page-locked: about 1 s per GiB)")
    p.add_argument("--daemon-pool-size", help="the daemon's pool (default: --pool-size times the most ranks)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--wrapper", choices=["ddp", "fsdp2"], default="ddp",
                   help="DistributedDataParallel, or FSDP2 (fully_shard per block, then the model)")
    p.add_argument("--budget", default=None, help="storm.offload(budget=...): a fraction (0.25) or bytes (2GiB); "
                   "default: offload all")
    p.add_argument("--daemons", type=int, default=1,
                   help="stormd processes, each with its share of the pool; rank r uses daemon r %% N (more than "
                        "one: what a daemon loop per GPU would buy; daemon_loop is then the first daemon's)")
    p.add_argument("--spill", action="store_true",
                   help="stormd spills to disk when its pool is full (the embedded stores have no spill: what does "
                        "not fit their pools stays on the GPU, rows' kept and peak_bytes say how much)")
    p.add_argument("--spill-limit", metavar="SIZE",
                   help="with --spill, each stormd's spill_limit (default stormd's: the disk must have it free)")
    p.add_argument("--switch-interval", type=float, metavar="SECONDS",
                   help="each rank's sys.setswitchinterval (Python's default 0.005): a thread waiting for the GIL "
                        "(the one taking stormd's replies) gets it from the busy one after at most this long")
    p.add_argument("--profile", help="a folder for torch.profiler tables per rank and stormd's cProfile stats")
    p.add_argument("--out")
    p.add_argument("--resume", action="store_true",
                   help="keep the rank counts --out holds already and run the others (a run across time limits)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(argparse.Namespace(**json.loads(Path(a.worker).read_text())))
        return 0
    a.ranks = sorted(set(a.ranks or default_ranks(torch.cuda.device_count() if a.device == "cuda" else 0)))
    pool = a.daemon_pool_size or format_size(parse_size(a.pool_size) * a.ranks[-1])
    profile = Path(a.profile).resolve() if a.profile else None
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        a.profile = str(profile)
    results = {"wrapper": a.wrapper, "rows": list(ROWS), "models": a.models, "tiny": a.tiny, "steps": a.steps,
               "rounds": a.rounds, "warmup": a.warmup, "pool_size": a.pool_size, "daemon_pool_size": pool,
               # without peer access NCCL's all-reduce goes through host memory, over the links offload uses
               "peer_access": a.device == "cuda" and torch.cuda.device_count() > 1
               and torch.cuda.can_device_access_peer(0, 1), "runs": {}}
    prior = json.loads(Path(a.out).read_text()) if a.resume and a.out and Path(a.out).exists() else {}
    if prior:
        # rank counts measured by that run are kept as they were; each call starts its own stormd
        results["runs"], results["resumed_from"] = prior["runs"], prior["meta"]
    with tempfile.TemporaryDirectory() as tmp:
        procs, endpoints, daemon = start_all(Path(tmp), pool, a.daemons, profile, a.spill, a.spill_limit)
        try:
            for n in (n for n in a.ranks if str(n) not in results["runs"]):
                results["runs"][str(n)] = summarize_launch(launch(a, n, endpoints, tmp), daemon)
                results["runs"] = dict(sorted(results["runs"].items(), key=lambda kv: int(kv[0])))
                results["daemon"] = {**daemon, "daemons": a.daemons}
                if a.out:
                    write(a.out, results, a.device)  # what is done survives a time limit: --resume goes on
            daemon_locked = locked_kib(procs[0].pid)
            nodes = [request(e, "STATUS", timeout=30)["node"] for e in endpoints]
            spill = {"on": all(n["spill"] for n in nodes), "written_bytes": sum(n["spilled_total"] for n in nodes)}
        finally:
            for proc in procs:
                stop_daemon(proc)
        if profile is not None:
            (profile / "stormd.log").write_text((Path(tmp) / "d0" / "stormd.log").read_text())
            with (profile / "stormd-cprofile.txt").open("w") as f:
                stats = pstats.Stats(str(profile / "stormd.prof"), stream=f)
                stats.sort_stats("tottime").print_stats(40)
                stats.sort_stats("cumulative").print_stats("stormd", 40)  # where a request's time goes
            results["profile"] = read_traces(profile)
    results["daemon"] = {**daemon, "daemons": a.daemons, "spill": spill, "proc_status_kB": daemon_locked}
    ok = all(passed(run) for run in results["runs"].values())
    print(table(results))
    if a.out:
        write(a.out, results, a.device)
    print("OK" if ok else "FAILED: a step differed between rows, or an offload row offloaded nothing")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
