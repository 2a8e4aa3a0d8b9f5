"""The packed expert codec: bit packing, HQQ encoding, decoding without hqq, refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hqq.core.quantize import Quantizer

from loader.codec import BITS, CodecError, MatrixSpec, RecordLayout, decode_matrix, unpack_codes
from loader.errors import MoeError
from prep.errors import MoeprepError
from prep.quant.hqq_codec import encode_expert, encode_matrix, matrix_spec
from prep.records import pack_codes


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_pack_unpack_round_trip(bits):
    torch.manual_seed(bits)
    codes = torch.randint(0, 2**bits, (96, 16), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.numel() == codes.numel() * bits // 8
    assert torch.equal(unpack_codes(packed, bits, codes.numel()), codes.reshape(-1))


@pytest.mark.parametrize("precision", ["int8", "int4", "int3", "int2"])
def test_decode_equals_hqq_dequantization(precision):
    """Our decode is (code - zero) * scale with hqq's own codes, scale and zero (stored as float16)."""
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    spec = matrix_spec("w", w, precision, 16)
    got = decode_matrix(spec, encode_matrix(spec, w))
    w_q, meta = Quantizer.quantize(w, nbits=BITS[precision], group_size=16, axis=1, bitpack=False,
                                   compute_dtype=torch.float32, device="cpu")
    scale = meta["scale"].to(torch.float16).float()
    zero = meta["zero"].to(torch.float16).float()
    expected = ((w_q.float() - zero) * scale).reshape(w.shape)
    assert torch.allclose(got, expected, atol=1e-6)
    assert float((got - w).abs().max()) < 4.0  # sane, not garbage


def test_error_falls_with_bits():
    torch.manual_seed(0)
    w = torch.randn(32, 128)
    errs = []
    for precision in ["int2", "int3", "int4", "int8"]:
        spec = matrix_spec("w", w, precision, 32)
        errs.append(float((decode_matrix(spec, encode_matrix(spec, w)) - w).pow(2).mean()))
    assert errs == sorted(errs, reverse=True)


def test_expert_record_round_trip_with_bias_and_transpose():
    torch.manual_seed(0)
    tensors = {"gate_up_proj": torch.randn(32, 16), "down_proj": torch.randn(16, 8),
               "down_proj_bias": torch.randn(16)}
    layout, record = encode_expert(tensors, "passthrough", 0)
    decoded = RecordLayout.from_json(layout.to_json()).decode(record)
    for name, t in tensors.items():
        assert torch.equal(decoded[name], t)
    layout, record = encode_expert(tensors, "int8", 8, transposed=True)
    decoded = layout.decode(record)
    assert decoded["gate_up_proj"].shape == (32, 16)
    assert torch.allclose(decoded["gate_up_proj"], tensors["gate_up_proj"], atol=0.05)
    assert torch.equal(decoded["down_proj_bias"], tensors["down_proj_bias"])  # biases stay exact


def test_refuses_mismatched_group_and_shape():
    with pytest.raises(MoeprepError, match="group size 16 does not divide"):
        matrix_spec("gate_up_proj", torch.randn(8, 24), "int4", 16)
    spec = matrix_spec("w", torch.randn(8, 32), "int4", 16)
    with pytest.raises(MoeprepError, match="does not match"):
        encode_matrix(spec, torch.randn(8, 16))


def test_decode_needs_no_hqq():
    code = (
        "import sys, torch\n"
        "from loader.codec import RecordLayout, MatrixSpec\n"
        "layout = RecordLayout((MatrixSpec('w', (4, 16), 'int4', 'float32', 16),))\n"
        "out = layout.decode(torch.zeros(layout.nbytes, dtype=torch.uint8))\n"
        "assert out['w'].shape == (4, 16)\n"
        "assert 'hqq' not in sys.modules\n"
        "assert 'prep' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_codec_errors_are_project_errors():
    """One error root: a bad record is a MoeError (printed without a traceback), not a bare ValueError."""
    assert issubclass(CodecError, MoeError) and not issubclass(CodecError, ValueError)
    assert issubclass(MoeprepError, MoeError)
    layout = RecordLayout((MatrixSpec("w", (4, 16), "int4", "float32", 16),))
    with pytest.raises(CodecError, match="layout needs"):
        layout.decode(torch.zeros(layout.nbytes - 1, dtype=torch.uint8))
    with pytest.raises(CodecError, match="bit-width"):
        pack_codes(torch.zeros(8, dtype=torch.uint8), 5)
