"""Host time per call of what a save or fetch through stormd costs the client, on its CUDA path:
exporting a tensor's segment (cuMemGetAddressRange + cudaIpcGetMemHandle), an interprocess event
from the free list and its record, against a plain event, and querying each.

    python bench/ipc_cost.py --out bench/results/ipc-cost.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance  # noqa: E402
from storm.gpu import CopyEvent, export, ipc_event  # noqa: E402


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return round((time.perf_counter() - t0) / n * 1e6, 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    plain, ipc = CopyEvent().record(stream), ipc_event(0).record(stream)
    torch.cuda.synchronize()
    rows = {
        "export_us": per_call_us(lambda: export(t.data_ptr() + 4096, 0)),
        "ipc_event_take_and_record_us": per_call_us(lambda: ipc_event(0).record(stream)),
        "plain_event_create_and_record_us": per_call_us(lambda: CopyEvent().record(stream)),
        "ipc_event_query_us": per_call_us(ipc.query),
        "plain_event_query_us": per_call_us(plain.query),
    }
    print(rows)
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": provenance.commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)}
    Path(args.out).write_text(json.dumps({**rows, "meta": meta}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
