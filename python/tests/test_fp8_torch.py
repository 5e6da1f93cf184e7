"""The FP8 block codec's bytes against PyTorch's own e4m3 conversion, on every device torch has.

`crates/weights/tests/fp8_vectors.rs` holds the Rust codec to the stored vectors bit for bit;
here the same inputs are quantized again by today's PyTorch, on the CPU and, where there is one,
on a CUDA GPU (whose e4m3 conversion is the hardware's), so a trainer that quantizes on its GPU
and an engine that reads Troupe's bytes agree."""

import importlib.util
import json
import pathlib

import pytest

from conftest import need_torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
VECTORS = ROOT / "crates" / "weights" / "tests" / "data" / "fp8_vectors.safetensors"


def vectors_module():
    spec = importlib.util.spec_from_file_location("fp8_vectors", ROOT / "scripts" / "fp8_vectors.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_stored_fp8_vectors_match_torch_on_the_device(device):
    torch = need_torch()
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    mod = vectors_module()
    assert mod.check(device, VECTORS) == []


def test_the_check_sees_a_changed_byte(tmp_path):
    need_torch()
    mod = vectors_module()
    raw = bytearray(VECTORS.read_bytes())
    # Flip one quantized byte of the first case and expect that case, and only it, named.
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    first = json.loads(header["__metadata__"]["cases"])[0]["name"]
    a, _ = header[f"{first}.q"]["data_offsets"]
    raw[8 + n + a] ^= 0x01
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(raw))
    assert mod.check("cpu", bad) == [first]
