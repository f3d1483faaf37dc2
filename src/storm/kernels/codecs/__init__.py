"""The codecs, one module each: ``encode(tensor) -> (meta, buffers)`` and ``decode(Encoded) -> tensor``.

All of them are written in device-agnostic torch ops, so the same code encodes
on the CPU and on CUDA (where the hot loops dispatch to the Triton kernel of the
same name in kernels.gpu) and data encoded on one device decodes on the other.
Every decoder checks the sizes it reads (``require``) before indexing with them.
kernels.registry maps the names on the wire to these modules.

* ``raw``      the bytes as they are.
* ``ancf``     (a) ANCF as the source document describes it: a dictionary of the
               K-1 most frequent exact bit patterns, ceil(log2 K)-bit codes, code
               K-1 = escape; escaped values and their int32/int64 positions are
               compacted with the scan. Often larger than the input on dense
               activations: its true ratio is reported, never assumed.
* ``ancf_exp`` (b) the same idea on the symbol field of ``bits.split_fields``
               (bf16 sign+exponent byte, fp16/fp32 exponent): 15 entries + escape
               in 4-bit codes, raw field stored as is. Fixed-length: memory-bound.
               Its Triton kernels: kernels.gpu.ancf_exp.
* ``huff_exp`` (c) the symbol field Huffman-coded (kernels.huffman, one code per
               tensor, built from a strided sample: see ``huff_exp._huff_counts``),
               raw field as is.
* ``zero``     (d) a 1-bit bitmap of "bit pattern is not all-zero" plus the
               non-zero elements compacted with the scan (-0.0 is non-zero).
* ``pack``     (e) tensors with at most 4 distinct bit patterns (bool masks,
               ternary {-1, 0, 1} tensors, 0/1 floats): a table of the patterns
               and 1- or 2-bit codes through kernels.bitpack.

What the codecs share: kernels.codecs.base (the error a codec raises when it
does not apply, reading and checking buffers) and kernels.codecs.fields (the
symbol field's sample and the raw field's storage, for codecs b and c).
"""
