"""Which CUDA saves go to the pool in frames, and each kind of frame: its size, fixed before
encoding (the copy is queued before the encoder has run), its encoder and its decoder.

- ``FRAME_CODEC`` (storm.kernels.frame): codec b on bf16 words, with codec ``auto`` or ``ancf_exp``;
- ``BITS_FRAME_CODEC`` (storm.kernels.bits_frame): one bit an element of a bool tensor
  (dropout's masks), with codec ``auto``;
- ``UPCAST_FRAME_CODEC`` (storm.kernels.upcast_frame): the high halves of float32 words widened
  from bf16 (a norm's or a loss's ``.float()``), with codec ``auto``, for the output of a dtype
  conversion (``WIDENING``) alone: other float32 tensors' low halves are not 0, and an upcast
  frame of one would be stored again raw after a copy that bought nothing. A conversion from
  another dtype (float16, an integer) overflows so once, and its kind takes float32 frames from
  then on;
- ``FLOAT32_FRAME_CODEC`` (storm.kernels.float32_frame): codec b on the high halves of the other
  float32 tensors (a softmax's probabilities, a loss's log-probabilities, a float32 model's
  activations), the low halves raw, with codec ``auto``.

Smaller tensors are copied raw: a frame's kernel launches cost the training thread the same host
time at any size, while what it saves on the link shrinks with the size.
"""

from __future__ import annotations

from typing import Callable, Collection, NamedTuple

import torch

from stormd.wire.protocol import BITS_FRAME_CODEC, FLOAT32_FRAME_CODEC, FRAME_CODEC, UPCAST_FRAME_CODEC

from .kernels.bits_frame import bits_frame_nbytes, decode_bits_frame, encode_bits_frame
from .kernels.float32_frame import decode_float32_frame, encode_float32_frame, float32_frame_nbytes
from .kernels.frame import decode_frame, encode_frame, frame_nbytes
from .kernels.upcast_frame import decode_upcast_frame, encode_upcast_frame, upcast_frame_nbytes

FRAME_MIN_BYTES = 4 << 20
FRAME_CODECS = ("auto", "ancf_exp")  # codec settings that put some CUDA tensors in frames
WIDENING = "ToCopyBackward0"  # the grad_fn of .float() and .to(dtype): what makes an upcast


class FrameKind(NamedTuple):
    """``nbytes``: a frame's size for a storage of that many bytes; ``encode(storage, frame)`` and
    ``decode(frame, out)``: the storage's bytes (uint8) into a frame of that size, and back."""

    nbytes: Callable[[int], int]
    encode: Callable[[torch.Tensor, torch.Tensor], None]
    decode: Callable[[torch.Tensor, torch.Tensor], object]


KINDS: dict[str, FrameKind] = {
    FRAME_CODEC: FrameKind(lambda nbytes: frame_nbytes(nbytes // 2),
                           lambda raw, frame: encode_frame(raw.view(torch.int16), frame),
                           lambda frame, out: decode_frame(frame, out.numel() // 2, out=out.view(torch.int16))),
    BITS_FRAME_CODEC: FrameKind(bits_frame_nbytes, encode_bits_frame, decode_bits_frame),
    UPCAST_FRAME_CODEC: FrameKind(upcast_frame_nbytes, encode_upcast_frame, decode_upcast_frame),
    FLOAT32_FRAME_CODEC: FrameKind(float32_frame_nbytes, encode_float32_frame, decode_float32_frame),
}
# per frame codec, the codec settings, the saved view's dtype (its name, as in a PUT's meta) it
# takes and the bytes its words come in; float32 goes in the first that takes its producer
_TAKES = {FRAME_CODEC: (("auto", "ancf_exp"), "bfloat16", 2), BITS_FRAME_CODEC: (("auto",), "bool", 1),
          UPCAST_FRAME_CODEC: (("auto",), "float32", 4), FLOAT32_FRAME_CODEC: (("auto",), "float32", 4)}


def frame_bytes(codec: str, nbytes: int) -> int:
    """The device bytes of the frame a storage of ``nbytes`` is encoded into under the codec its
    route gave it (mover.route), 0 for a codec that makes none on the device."""
    kind = KINDS.get(codec)
    return 0 if kind is None else kind.nbytes(nbytes)


def frame_codec(setting: str | None, device_type: str, dtype: str, nbytes: int, producer: str = "",
                overflowed: Collection[str] = ()) -> str | None:
    """The frame a storage goes in under codec ``setting``, of this device type, saved view dtype,
    size and producer (the op that made its bytes: saved.producer_of), or None (raw): CUDA, at
    least FRAME_MIN_BYTES, whole words of the dtype; an upcast frame for a conversion's output, a
    float32 frame for the rest (and for a conversion from float16, whose upcast frame overflowed:
    ``overflowed``, the frames that overflowed for saves of its kind, which it does not take again)."""
    if device_type != "cuda" or nbytes < FRAME_MIN_BYTES:
        return None
    for codec, (settings, takes, word) in _TAKES.items():
        if setting in settings and dtype == takes and nbytes % word == 0 and codec not in overflowed \
                and (codec != UPCAST_FRAME_CODEC or producer == WIDENING):
            return codec
    return None
