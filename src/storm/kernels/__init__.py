"""storm.kernels: lossless codecs for saved activations, the associative scan, bit packing.

How the store calls it::

    from storm.kernels import encode, decode, Encoded, CorruptEncodedError

    enc = encode(t, codec="auto")   # t on CPU or CUDA, any strides; buffers stay on t's device
    n = enc.nbytes                  # exact size of the serialized form, known without copying
    blob = enc.to_bytes()           # header + checksum + payload (device buffers copied to host)
    ...
    enc = Encoded.from_bytes(blob)  # verifies magic, lengths and checksum
    t = decode(enc.to("cuda"))      # decode where the buffers are; or decode(enc, out=dst)

``codec`` is ``"auto"`` or one of ``raw``, ``ancf`` (a: exact-value dictionary,
the source design), ``ancf_exp`` (b: dictionary on the exponent field),
``huff_exp`` (c: Huffman-coded exponent field), ``zero`` (d: bitmap +
non-zeros), ``pack`` (e: 1/2-bit packing of tensors with <= 4 distinct values),
``zstd`` (zstandard level 1 on byte planes, run on the host: a codec for host tensors).
Every codec is bit-exact for every bit pattern; ``auto`` never returns a payload
larger than the input and stores raw when no codec saves 5 %; on the host it weighs
zstd too and is never larger than zstd on a tensor of at least 4 KiB;
``encode(t, "auto", min_gbps=x)`` restricts it to codecs whose encode rate
measured on a GPU (``registry.ENCODE_GBPS``) is at least x GB/s.
``Encoded.to_bytes`` copies CUDA buffers to (pageable) host memory; a store that
wants pinned staging can copy ``enc.buffers`` itself.

On CUDA, encode waits for the device once per compaction (``scan.compact``
reads the number of escapes / non-zeros to size its output) and once per Huffman
stream (its total bit length); ``encode`` synchronizes at the end so that
``Encoded.encode_s`` is the real time. Decoding sizes are all in the header, so
decode itself needs no host round trip except for its checks (escape counts).

``storm.kernels.frame`` is codec b at a size fixed before encoding, for copy
streams: CUDA tensors go to the store in frames without a host wait.

Errors: ``CorruptEncodedError`` (a ValueError) for truncated, corrupted or
inconsistent data; ``CodecNotApplicable`` (a ValueError) when a named codec
cannot encode a tensor (``auto`` never raises it).

Where each part is (a module of kernels.gpu named like one here or in kernels.codecs is
its Triton side, imported lazily by it and importing nothing from it, so no import cycle
forms: tests/kernels/test_kernels_layout.py checks):

* ``registry``       the codecs by name, ``encode``/``decode``, the ``auto`` choice
* ``container``      ``Encoded``: the self-describing container and its byte format
* ``codecs/<name>``  one module per codec (``raw``, ``ancf``, ``ancf_exp``, ``huff_exp``,
                     ``zero``, ``pack``, ``zstd``); ``codecs/base``, ``codecs/fields`` what they share
* ``huffman``        the lane-parallel Huffman coder of ``huff_exp`` (gpu/huffman,
                     gpu/huffman_code)
* ``frame``          frames (codec b at a fixed size); ``frame_layout`` their bytes
* ``bits``, ``bitpack``, ``scan``   bit patterns and field splits, bit packing, the scan
* ``stats``, ``ancf_encoder``       statistics, and the source document's ``ANCFEncoder``
* ``gpu/launch``, ``gpu/rest``, ``gpu/tiles``, ``gpu/fields``  what the kernels share
"""
from .ancf_encoder import ANCFEncoder
from .bitpack import pack_bits, unpack_bits
from .bits import verify_lossless
from .codecs.base import CodecNotApplicable
from .container import CorruptEncodedError, Encoded
from .registry import CODECS, choose_codec, decode, encode, encoded_nbytes, estimate_sizes
from .scan import associative_scan, compact
from .stats import CodecStats, LayerStats

__all__ = [
    "ANCFEncoder", "CODECS", "CodecNotApplicable", "CodecStats", "CorruptEncodedError", "Encoded",
    "LayerStats", "associative_scan", "choose_codec", "compact", "decode", "encode", "encoded_nbytes",
    "estimate_sizes", "pack_bits", "unpack_bits", "verify_lossless",
]
