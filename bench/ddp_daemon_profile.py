"""Where one stormd serving DDP ranks spends its time: bench/ddp.py's offload run (W1, a 256 MiB
budget) through a daemon run under cProfile, once per rank count given, each with its own daemon.

    python bench/ddp_daemon_profile.py 1 2 > bench/results/ddp-daemon-cprofile-DATE.txt

Prints each run's per-rank step times (without / with offload, ms) and the daemon's functions by
own time and, of stormd's, by cumulative time.
"""

from __future__ import annotations

import argparse
import io
import pstats
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp  # noqa: E402
from daemon import start_daemon  # noqa: E402


def main() -> None:
    for n in [int(v) for v in sys.argv[1:]] or [1, 2]:
        a = argparse.Namespace(nproc=n, steps=12, warmup=3, batch=4, pool_size="4GiB", device="cuda", tiny=False,
                               wrapper="ddp", budget="256MiB", mode="daemon")
        with tempfile.TemporaryDirectory() as tmp:
            profile = Path(tmp) / "stormd.prof"
            daemon, endpoint = start_daemon(Path(tmp), a.pool_size, cprofile=profile)
            ranks = ddp.launch(a, n, endpoint, tmp)["ranks"]
            daemon.send_signal(signal.SIGTERM)  # cProfile writes its file as stormd exits
            daemon.wait(60)
            print(f"=== {n} ranks:", [(r["step_ms_no_offload"], r["step_ms_offload"]) for r in ranks])
            out = io.StringIO()
            stats = pstats.Stats(str(profile), stream=out)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(r"stormd", 30)
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
