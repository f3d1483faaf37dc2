"""One encode and one decode of each GPU codec's kernels on a 256 MiB bf16 N(0,1) tensor, for
Nsight Compute to profile (the kernels alone, no timing here):

    ncu --clock-control none -k 'regex:_lane_|_frame_|_build_code|_sample_hist' \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats \\
        python bench/ncu_codecs.py > bench/results/ncu-codecs.txt

(``--clock-control none``: the lent machines' clocks are left as they are.)
"""
from __future__ import annotations

import torch

from storm.kernels import decode, encode, frame


def main() -> None:
    torch.manual_seed(0)
    n = 128 << 20
    x = torch.randn(n, device="cuda").bfloat16()
    e = encode(x, "huff_exp")
    assert torch.equal(decode(e).view(torch.int16), x.view(torch.int16))
    f = torch.empty(frame.frame_nbytes(n), dtype=torch.uint8, device="cuda")
    frame.encode_frame(x, f)
    assert torch.equal(frame.decode_frame(f, n).view(torch.int16), x.view(torch.int16))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
