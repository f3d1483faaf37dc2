"""The GPU paths: Triton kernels and torch-on-CUDA, bit-identical to the CPU format.

Skipped without CUDA. On the device: every codec round-trips on the GPU, GPU
encodings decode on the CPU and CPU encodings on the GPU, both GPU paths (Triton
and plain torch ops) write the same bytes as the CPU, and the scan kernel matches
torch.cumsum.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import storm.kernels.gpu as gpu
from kernels_strategies import DTYPES, SPECIAL_BITS, bits_equal, from_bits, tensors
from storm.kernels import CODECS, CodecNotApplicable, CorruptEncodedError, Encoded, associative_scan, decode, encode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# every named codec writes the same bytes on both devices (dictionary ties break by value)
DETERMINISTIC = list(CODECS)


@pytest.fixture(params=["triton", "torch"])
def gpu_path(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(gpu, "triton_available", lambda: False)
    elif not gpu.triton_available():
        pytest.skip("Triton not installed")
    return request.param


def cross_check(t: torch.Tensor, codec: str) -> None:
    try:
        cpu_enc = encode(t, codec)
    except CodecNotApplicable:
        return
    g = t.cuda()
    enc = encode(g, codec)
    assert enc.device.type == "cuda"
    assert bits_equal(decode(enc), g), "GPU encode -> GPU decode"
    assert bits_equal(decode(Encoded.from_bytes(enc.to_bytes())), t), "GPU encode -> CPU decode"
    assert bits_equal(decode(cpu_enc.to("cuda")), g), "CPU encode -> GPU decode"
    if codec in DETERMINISTIC:
        assert enc.to_bytes() == cpu_enc.to_bytes(), "GPU and CPU bytes differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("codec", list(CODECS) + ["auto"])
@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_gpu_roundtrip_property(gpu_path: str, dtype: torch.dtype, codec: str, data) -> None:
    cross_check(data.draw(tensors(dtype, max_len=5000)), codec)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int16, torch.float16], ids=str)
def test_gpu_huff_exp_symbol_the_sample_missed(gpu_path: str, dtype: torch.dtype) -> None:
    """A symbol outside the sampled code set sends the encoder back for a code that has it
    (the GPU encoder flags it while summing lane lengths): the same bytes as the CPU."""
    t = torch.ones((1 << 21) + 6, dtype=dtype)
    # far from 1's symbol, at an odd index: a stride-2 sample never reads it
    t[12345] = {torch.bfloat16: 3e30, torch.float32: 3e30, torch.int16: 30000, torch.float16: 6e4}[dtype]
    cross_check(t, "huff_exp")


@pytest.mark.parametrize("dtype", list(SPECIAL_BITS), ids=str)
@pytest.mark.parametrize("codec", list(CODECS))
def test_gpu_special_values_large(gpu_path: str, dtype: torch.dtype, codec: str) -> None:
    t = from_bits(SPECIAL_BITS[dtype] * 30000, dtype)
    t = torch.cat([t, (torch.randn(300001) * 7).to(dtype)])
    cross_check(t, codec)
    cross_check(t[1::3], codec)


def test_gpu_every_16bit_pattern(gpu_path: str) -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.int16):
        t = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        for codec in CODECS:
            cross_check(t, codec)


def test_gpu_corrupt_is_detected(gpu_path: str) -> None:
    t = torch.randn(100000, device="cuda").bfloat16() * torch.tensor(1e30, device="cuda", dtype=torch.bfloat16) ** (
        torch.rand(100000, device="cuda") < 0.01)  # some escapes
    for codec in ("ancf_exp", "huff_exp", "zero", "ancf"):
        enc = encode(t, codec)
        for k, b in enc.buffers.items():
            if b.numel() > 1:
                bad = Encoded(enc.codec, enc.dtype, enc.shape, enc.meta, {**enc.buffers, k: b[:-1]})
                with pytest.raises(CorruptEncodedError):
                    decode(bad)
        if "escapes" in enc.meta:
            bad = Encoded(enc.codec, enc.dtype, enc.shape, {**enc.meta, "escapes": enc.escapes + 1}, enc.buffers)
            with pytest.raises(CorruptEncodedError):
                decode(bad)
        if enc.escapes >= 2:  # a repeated position with consistent counts
            pos = enc.buffers["esc_pos"].view(torch.int32).clone()
            pos[1] = pos[0]
            bad = Encoded(enc.codec, enc.dtype, enc.shape, enc.meta, {**enc.buffers, "esc_pos": pos.view(torch.uint8)})
            with pytest.raises(CorruptEncodedError):
                decode(bad)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16, torch.uint8, torch.bool, torch.int8])
def test_gpu_scan_integers_identical(dtype: torch.dtype) -> None:
    x = torch.randint(-100 if dtype.is_signed else 0, 100, (3, 1_000_003), device="cuda").to(dtype)
    for dim in (0, 1):
        for rev in (False, True):
            ref = torch.cumsum(x.flip(dim), dim).flip(dim) if rev else torch.cumsum(x, dim)
            assert torch.equal(associative_scan(x, dim, reverse=rev), ref)


def test_gpu_scan_int32_extremes_identical() -> None:
    """Prefixes far past 32 bits, of both signs, through the one-pass kernel's packed words."""
    x = torch.randint(-2**31, 2**31 - 1, (2, 3_000_000), device="cuda", dtype=torch.int32)
    x[0, ::2] = 2**31 - 1
    assert torch.equal(associative_scan(x, 1), torch.cumsum(x, 1))
    assert torch.equal(associative_scan(x, 1, reverse=True), torch.cumsum(x.flip(1), 1).flip(1))


def test_gpu_scan_many_blocks_identical() -> None:
    """Thousands of blocks in flight at once, looking back through words read without fences:
    every output of several runs is torch.cumsum's."""
    x = torch.randint(-50, 50, (1 << 26,), device="cuda", dtype=torch.int32)
    for out in (None, torch.int32):
        ref = torch.cumsum(x, 0, dtype=out)
        for _ in range(3):
            assert torch.equal(associative_scan(x, 0, dtype=out), ref)


@pytest.mark.parametrize("src", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.float32])
def test_gpu_scan_int32_output_identical(src: torch.dtype) -> None:
    """dtype=torch.int32, as torch.cumsum's: the same wrapped 32-bit sums, one pass or three."""
    x = torch.randint(-2**31, 2**31 - 1, (2, 3_000_000), device="cuda", dtype=torch.int64)
    x[0, ::2] = 2**31 - 1  # sums wrap many times
    x = x.to(src) if src != torch.float32 else (x >> 8).to(src)
    for rev in (False, True):
        ref = torch.cumsum(x.flip(1), 1, dtype=torch.int32).flip(1) if rev else torch.cumsum(x, 1, dtype=torch.int32)
        out = associative_scan(x, 1, reverse=rev, dtype=torch.int32)
        assert out.dtype == torch.int32 and torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_scan_float_bound(dtype: torch.dtype) -> None:
    x = torch.randn(4, 2_000_000, device="cuda", dtype=torch.float64).to(dtype)
    out = associative_scan(x, 1).double()
    exact = torch.cumsum(x.double(), 1)
    i = torch.arange(1, x.shape[1] + 1, device="cuda", dtype=torch.float64)
    acc = i * 2.0**-24 * torch.cumsum(x.double().abs(), 1)  # float32 accumulation, in any order
    u_out = {torch.float32: 0.0, torch.bfloat16: 2.0**-8}[dtype]  # bf16 outputs are rounded once
    bound = acc + u_out * (exact.abs() + acc)
    assert bool(((out - exact).abs() <= bound).all())


def frame_written(f: torch.Tensor, n: int) -> torch.Tensor:
    """A frame's bytes but its escape slots past the count, which the encoders leave unwritten."""
    from storm.kernels.frame import layout
    f, lay = f.cpu(), layout(n)
    count = int(f[:4].view(torch.int32)[0])
    return f[:lay.sym + min(count, lay.cap)]


@pytest.mark.parametrize("n", [1, 7, 2048, 4097, 32768, 32769, 40960, 3_000_001])
def test_gpu_frames_match_the_cpu_reference(gpu_path: str, n: int) -> None:
    """The Triton frame kernels (and torch's ops on CUDA, where Triton is not there) write the CPU
    reference's bytes, by one program (up to 16 tiles) and by many (the look-back), also from a
    tensor not 4-byte aligned; frames decode on either device; the specials survive; overflow is
    counted the same."""
    from storm.kernels.frame import complete, decode_frame, encode_frame, frame_nbytes
    specials = from_bits(SPECIAL_BITS[torch.bfloat16], torch.bfloat16)
    t = (torch.randn(n) * 3).bfloat16()
    t[:: max(1, n // 50)] = specials.repeat(n // 10 + 1)[: len(t[:: max(1, n // 50)])]
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for x in (t, every[:n].repeat(max(1, n // 65536 + 1))[:n]):  # the second overflows when long enough
        g = x.cuda()
        cpu_f = torch.empty(frame_nbytes(n), dtype=torch.uint8)
        gpu_f = torch.empty(frame_nbytes(n), dtype=torch.uint8, device="cuda")
        encode_frame(x, cpu_f)
        for view in (torch.cat([g[:1], g])[1:], g):  # 2 bytes past 4-byte alignment (full tiles are read in pairs)
            encode_frame(view, gpu_f)
            assert torch.equal(frame_written(gpu_f, n), frame_written(cpu_f, n))
        assert complete(gpu_f[:16].cpu()) == complete(cpu_f[:16])
        if complete(cpu_f):
            words = x.view(torch.int16)
            assert bits_equal(decode_frame(gpu_f, n), g.view(torch.int16)), "GPU -> GPU"
            assert bits_equal(decode_frame(gpu_f.cpu(), n), words), "GPU -> CPU"
            assert bits_equal(decode_frame(cpu_f.cuda(), n), g.view(torch.int16)), "CPU -> GPU"


def test_gpu_frame_runs_on_the_current_stream_without_a_host_wait() -> None:
    """Encode and decode queue work only: on a stream held behind a long kernel they return
    before it has run, and the result is right once it has."""
    from storm.kernels.frame import decode_frame, encode_frame, frame_nbytes
    n = 1 << 24
    x = torch.randn(n, device="cuda").bfloat16()
    f = torch.empty(frame_nbytes(n), dtype=torch.uint8, device="cuda")
    out = torch.empty(n, dtype=torch.int16, device="cuda")
    encode_frame(x, f)  # Triton compiles the kernels for these arguments on first use
    decode_frame(f, n, out=out)
    out.zero_()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(500_000_000)  # ~0.3 s of GPU time ahead of the frame's kernels
        encode_frame(x, f)
        decode_frame(f, n, out=out)
        done = torch.cuda.Event()
        done.record()
    assert not done.query(), "encode or decode waited for the device"
    done.synchronize()
    assert bits_equal(out, x.view(torch.int16))


DAMAGED_FRAME = """
import sys, torch
from storm.kernels.frame import HEADER, PREFIX, decode_frame, encode_frame, frame_nbytes, layout
n = 1 << 20
x = torch.randn(n, device="cuda").bfloat16()
x[::997] = 2.0 ** 100  # escapes in most tiles
f = torch.empty(frame_nbytes(n), dtype=torch.uint8, device="cuda")
encode_frame(x, f)
ends = f[HEADER:layout(n).codes].view(torch.int64)
ends[100] = int(sys.argv[1]) << 2 | PREFIX
decode_frame(f, n)
torch.cuda.synchronize()
print("decoded")
"""


@pytest.mark.parametrize("end", [-(1 << 40), 1 << 40, -5])
def test_gpu_decode_of_a_damaged_frame_stays_inside_it(end: int) -> None:
    """The device's decode checks nothing (the frame is the mover's own), but a damaged tile end
    must not send its reads outside the frame: far outside would be an illegal address, which
    ends the process's CUDA context (so each case runs in a process of its own)."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", DAMAGED_FRAME, str(end)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "decoded" in run.stdout, run.stderr[-2000:]


@pytest.mark.parametrize("seed", range(6))
def test_gpu_code_built_on_the_device_is_the_hosts(seed: int) -> None:
    """kernels.gpu.huffman_code.build_code against kernels.huffman on the host: the same lengths,
    encode table and pad symbol for counts that need JPEG's depth limit, one symbol, a few,
    all 256, and forced symbols."""
    import numpy as np

    from storm.kernels import huffman
    from storm.kernels.codecs.huff_exp import HUFF_MARGIN, _forced_on_device, _huff_counts
    from storm.kernels.gpu.huffman import code_work
    from storm.kernels.gpu.huffman_code import build_code

    rng = np.random.default_rng(seed)
    for trial in range(8):
        hist = np.zeros(256, dtype=np.int64)
        kind = (seed + trial) % 4
        if kind == 0:  # exponent-like: geometric tails in both sign halves (deep trees)
            for half in (0, 128):
                for k in range(40):
                    hist[half + 60 - k] = int(2**20 * 0.5 ** abs(k - 3) * rng.random())
        elif kind == 1:
            idx = rng.choice(256, int(rng.integers(1, 40)), replace=False)
            hist[idx] = rng.integers(1, 10**6, len(idx))
        elif kind == 2:
            hist[int(rng.integers(0, 256))] = 1000
        else:
            hist[:] = rng.integers(1, 1000, 256)
        forced = np.zeros(256, dtype=np.uint8)
        forced[rng.choice(256, int(rng.integers(0, 6)), replace=False)] = 1
        dev = torch.device("cuda")
        with code_work(dev, 1) as work:
            work.hist.copy_(torch.from_numpy(hist.astype(np.int32)))
            build_code(work, torch.from_numpy(forced).to(dev) | _forced_on_device(torch.bfloat16, dev), HUFF_MARGIN,
                       huffman.MAX_LEN)
        table, code = work.table.clone(), work.info.clone()
        assert not work.hist.any()  # the counts it read left at rest for the next encode
        counts = _huff_counts(hist, torch.bfloat16)  # the bf16 specials, as the device's mask has them
        counts[(forced == 1) & (counts == 0)] = 1
        lengths = huffman.code_lengths(counts)
        code = code.cpu()
        assert (code[2:34].numpy().view(np.uint8) == lengths).all()
        assert int(code[34]) == int(np.flatnonzero(lengths == lengths[lengths > 0].min())[0])
        assert (table.cpu().numpy() == huffman.device_tables(lengths.tobytes(), torch.device("cpu"))[0].numpy()).all()


def test_gpu_launcher_finds_the_kernel_the_jit_would() -> None:
    """kernels.gpu.launch.Launcher: for arguments the JIT specializes differently (a pointer
    off 16 bytes, an integer of 1, a multiple of 16, one past 32 bits), each launch past the
    JIT runs the very kernel the JIT returns for those arguments, and computes what it should."""
    import triton
    import triton.language as tl

    from storm.kernels.gpu.launch import Launcher, _spec

    @Launcher
    @triton.jit
    def add(x_ptr, out_ptr, k, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n, other=0) + k, mask=i < n)

    base = torch.arange(64, dtype=torch.int64, device="cuda")
    for x in (base, base[1:]):  # 16-byte aligned, and 8 bytes off
        for k in (1, 2, 16, 17, 2**31 - 1, 2**31 + 5, -3):
            for n in (1, 16, 17):
                args = (x, torch.zeros(n, dtype=torch.int64, device="cuda"), k, n)
                for _ in range(2):  # the first goes through the JIT, the second past it
                    args[1].zero_()
                    add[(1,)](*args, BLOCK=32)
                    assert torch.equal(args[1], x[:n] + k), (x.data_ptr() % 16, k, n)
                key = (torch.cuda.current_device(), tuple(map(_spec, args)), (("BLOCK", 32),))
                assert add.compiled[key] is add.fn[(1,)](*args, BLOCK=32), (x.data_ptr() % 16, k, n)


@pytest.mark.parametrize("n", [1, 8, 4103, 1 << 22])
def test_gpu_bit_frames_are_the_cpu_bytes_and_round_trip(gpu_path: str, n: int) -> None:
    from storm.kernels.bits_frame import bits_frame_nbytes, decode_bits_frame, encode_bits_frame
    raw = torch.randint(0, 2, (n,), dtype=torch.uint8)
    raw[n // 2] = 3  # a byte one bit cannot hold: the header's largest on both devices
    frames = []
    for device in ("cpu", "cuda"):
        frame = torch.empty(bits_frame_nbytes(n), dtype=torch.uint8, device=device)
        encode_bits_frame(raw.to(device), frame)
        frames.append(frame.cpu())
    assert torch.equal(frames[0], frames[1])
    raw[n // 2] = 1
    frame = torch.empty(bits_frame_nbytes(n), dtype=torch.uint8, device="cuda")
    encode_bits_frame(raw.cuda(), frame)
    out = torch.empty(n, dtype=torch.uint8, device="cuda")
    assert torch.equal(decode_bits_frame(frame, out).cpu(), raw)


def test_gpu_upcast_frames_are_the_cpu_bytes_and_round_trip() -> None:
    from storm.kernels.upcast_frame import decode_upcast_frame, encode_upcast_frame, upcast_frame_nbytes
    wide = torch.randn(1 << 20).to(torch.bfloat16).float()
    frames = []
    for t in (wide, wide.clone().view(torch.int32).add_(1).view(torch.float32)):  # an upcast, then not
        for device in ("cpu", "cuda"):
            frame = torch.empty(upcast_frame_nbytes(t.numel() * 4), dtype=torch.uint8, device=device)
            encode_upcast_frame(t.to(device), frame)
            frames.append(frame.cpu())
    assert torch.equal(frames[0], frames[1]) and torch.equal(frames[2], frames[3])
    out = torch.empty_like(wide, device="cuda")
    assert torch.equal(decode_upcast_frame(frames[1].cuda(), out).cpu().view(torch.int32), wide.view(torch.int32))


def test_gpu_float32_frames_decode_on_either_device_to_every_bit() -> None:
    """Encoded on the GPU (the frame kernels leave escape slots past the count unwritten, so the
    bytes are compared through decoding), decoded there and on the CPU."""
    from storm.kernels.float32_frame import decode_float32_frame, encode_float32_frame, float32_frame_nbytes
    probs = torch.randn(256, 4096).softmax(-1).reshape(-1)
    frame = torch.empty(float32_frame_nbytes(probs.numel() * 4), dtype=torch.uint8, device="cuda")
    encode_float32_frame(probs.cuda(), frame)
    on_cpu = decode_float32_frame(frame.cpu(), torch.empty_like(probs))  # first: decoding writes the frame
    on_gpu = decode_float32_frame(frame, torch.empty_like(probs, device="cuda")).cpu()
    assert torch.equal(on_gpu.view(torch.int32), probs.view(torch.int32))
    assert torch.equal(on_cpu.view(torch.int32), probs.view(torch.int32))
