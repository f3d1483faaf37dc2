"""bench/saves.py on the CPU: what a tiny model's forward saves, by kind, and what codec auto's frames
would send of each."""

from __future__ import annotations

import dataclasses

import torch

from helpers import bench_module

hf = bench_module("hf")
bench_module("zoo_verdicts")  # saves.py imports its cells by name, as a script run from bench/ does, and zoo
bench_module("zoo")            # its verdicts so
saves = bench_module("saves")
MiB = 1 << 20


def test_a_save_of_each_kind_is_told_apart():
    bf16 = torch.randn(4096).to(torch.bfloat16)
    assert saves.kind(torch.rand(64) < 0.5) == "mask"
    assert saves.kind(torch.nn.functional.dropout(torch.ones(4096), 0.1)) == "mask"  # the CPU's scaled noise
    assert saves.kind(bf16.float()) == "upcast"
    assert saves.kind(bf16) == "bfloat16" and saves.kind(torch.randn(64)) == "float32"
    assert saves.kind(torch.arange(8)) == "other"


def test_codec_auto_sends_a_frame_where_it_holds_and_the_next_or_raw_where_not():
    """What a step after the first sends: a conversion's float32 output at half (an upcast frame), a
    softmax's in a float32 frame, a float16 widened (its upcast frame overflows) in a float32 frame
    too, and a tensor under the threshold raw."""
    n = (4 * MiB) // 4  # float32 words of 4 MiB
    wide = torch.randn(n).to(torch.bfloat16).float()
    assert saves.sent_by_auto(wide, "ToCopyBackward0", 1.0) == 16 + 2 * MiB
    probs = torch.randn(n // 512, 512).softmax(-1)
    framed = saves.sent_by_auto(probs, "SoftmaxBackward0", 1.0)
    assert framed < 0.9 * 4 * MiB
    assert saves.sent_by_auto(torch.randn(n).half().float(), "ToCopyBackward0", 1.0) == framed
    small = torch.randn(1024).softmax(-1)
    assert saves.sent_by_auto(small, "SoftmaxBackward0", 1.0) == 4096
    assert saves.sent_by_auto(small, "SoftmaxBackward0", 1024.0) < 4096  # at the cell's batch: framed


def test_a_cells_forward_is_counted_by_kind_once_per_storage():
    w = dataclasses.replace(hf.tiny("bert"), dtype="bfloat16")
    out = saves.saves(w, torch.device("cpu"))
    kinds = out["kinds"]
    assert abs(sum(k["share"] for k in kinds.values()) - 1) < 0.01
    assert "mask" in kinds  # dropout's, in train mode
    assert out["auto_x"] == 1.0  # a tiny model's saves are all under the frames' threshold
