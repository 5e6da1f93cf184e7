#!/usr/bin/env python3
"""Produce FP8 (e4m3fn) block-quantization test vectors with real PyTorch.

The Rust codec in `crates/weights/src/fp8/` must match these bytes bit for bit, so the tests in
`crates/weights/tests/fp8_vectors.rs` can check it without PyTorch installed.

Reference semantics (DeepSeek / Hugging Face FP8 checkpoints, DESIGN.md section 8):

    per block of bm x bn (edge blocks hold only their real elements):
        scale = max(amax(|x|), 1e-10) / 448   (f32, the correctly rounded quotient; optionally
                                                rounded to bf16)
        q     = clamp(x.float() / scale, -448, 448).to(torch.float8_e4m3fn)
    stored scale = the dequant multiplier (w ~= q * scale), shape ceil(M/bm) x ceil(N/bn)

    per-tensor fallback (no block size): scale = max(amax, 1e-12) / 448, shape [1].

Usage (PyTorch from PyPI is enough; the CPU is fine):

    python3 -m venv /tmp/fp8venv && /tmp/fp8venv/bin/pip install torch safetensors numpy
    /tmp/fp8venv/bin/python scripts/fp8_vectors.py crates/weights/tests/data/fp8_vectors.safetensors

Check mode, on any device PyTorch has (a GPU converts to e4m3 in hardware):

    python scripts/fp8_vectors.py --check cuda crates/weights/tests/data/fp8_vectors.safetensors

re-quantizes every stored input there and compares each byte with the stored bytes (which the
Rust codec matches); it needs only torch (the file is read without `safetensors`).

Output: one safetensors file. For every case `C` it holds `C.input` (bf16 or f32), `C.q`
(float8_e4m3fn) and `C.scale` (f32 or bf16); `__metadata__["cases"]` is a JSON list describing
each case (name, block size or null for per-tensor, scale dtype).
"""

import json
import math
import sys

import torch

E4M3_MAX = 448.0
BLOCK_EPS = 1e-10
TENSOR_EPS = 1e-12


def to_scale(amax, eps, naive=False):
    """`max(amax, eps) / 448` in f32, correctly rounded on any device.

    On a CUDA tensor, PyTorch computes `t / 448.0` (a Python number) as `t * (1 / 448.0)`, which
    can differ from the true quotient in the last bit; a CPU tensor gets the true quotient, as
    the Rust codec does. Dividing by a tensor on the same device gives the true quotient
    everywhere; `naive` computes `amax / 448.0` instead, to show the difference."""
    amax = amax.clamp(min=eps)
    if naive:
        return amax / E4M3_MAX
    return amax / torch.tensor(E4M3_MAX, dtype=amax.dtype, device=amax.device)


def quantize_blocks(x, bm, bn, scale_dtype, naive=False):
    """The specification, written block by block: edge blocks use only their real elements."""
    m, n = x.shape
    xf = x.float()
    rows, cols = math.ceil(m / bm), math.ceil(n / bn)
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, cols, dtype=torch.float32, device=x.device)
    for i in range(rows):
        for j in range(cols):
            block = xf[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            scale = to_scale(block.abs().amax(), BLOCK_EPS, naive)
            if scale_dtype == "bf16":
                scale = scale.to(torch.bfloat16).float()
            q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (
                (block / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            )
            scales[i, j] = scale
    if scale_dtype == "bf16":
        scales = scales.to(torch.bfloat16)
    return q, scales


def quantize_blocks_padded(x, bm, bn, naive=False):
    """The vectorized, zero-padded formulation used by DeepSeek / AReaL kernels (f32 scales).

    Zero padding cannot change a block's amax, so it must agree with `quantize_blocks`; the script
    asserts that, as a cross-check of the reference itself.
    """
    m, n = x.shape
    pm, pn = math.ceil(m / bm) * bm, math.ceil(n / bn) * bn
    padded = torch.zeros(pm, pn, dtype=torch.float32, device=x.device)
    padded[:m, :n] = x.float()
    view = padded.view(pm // bm, bm, pn // bn, bn)
    amax = view.abs().amax(dim=(1, 3), keepdim=True)
    scale = to_scale(amax, BLOCK_EPS, naive)
    q = (view / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(pm, pn)[:m, :n].contiguous(), scale.view(pm // bm, pn // bn)


def quantize_tensor(x, naive=False):
    """Per-tensor fallback: one scale for the whole matrix, stored with shape [1]."""
    xf = x.float()
    scale = to_scale(xf.abs().amax(), TENSOR_EPS, naive)
    q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.reshape(1)


def e4m3_ties(gen, m, n):
    """Values on e4m3 rounding midpoints (and the grid itself) with each block's amax exactly 448.

    With amax = 448 the block scale is exactly 1.0, so x / scale = x and every midpoint is a true
    tie: this pins round-to-nearest-even, including the subnormal range (multiples of 2^-10).
    """
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[:-1] + grid[1:]) / 2
    pool = torch.cat([grid, mids, -grid, -mids])
    x = pool[torch.randint(0, pool.numel(), (m, n), generator=gen)]
    x[::128, ::128] = 448.0
    return x


def build_cases():
    gen = torch.Generator().manual_seed(20240611)

    def randn(m, n, dtype, magnitude=1.0):
        return (torch.randn(m, n, generator=gen) * magnitude).to(dtype)

    def log_uniform(m, n, dtype, lo, hi):
        """Magnitudes spread over many decades: exercises e4m3 subnormals and flush to zero."""
        exps = torch.rand(m, n, generator=gen) * (hi - lo) + lo
        signs = torch.randint(0, 2, (m, n), generator=gen).float() * 2 - 1
        return (signs * torch.pow(10.0, exps)).to(dtype)

    bf16, f32 = torch.bfloat16, torch.float32
    block = (128, 128)
    outlier = randn(128, 256, bf16)
    outlier[5, 7] = 1.0e4
    outlier[100, 200] = -3.0e3
    signed_zeros = randn(40, 150, bf16, 1e-6)
    signed_zeros[0, :10] = -0.0
    signed_zeros[1, :10] = 0.0
    signed_zeros[2, 0] = 1.0

    return [
        # (name, input, block or None, scale dtype)
        ("one_by_one", randn(1, 1, bf16), block, "f32"),
        ("rows3_cols200", randn(3, 200, bf16), block, "f32"),
        ("exact_128", randn(128, 128, bf16), block, "f32"),
        ("ragged_130x257", randn(130, 257, bf16), block, "f32"),
        ("multi_256x384", randn(256, 384, bf16), block, "f32"),
        ("f32_ragged_130x257", randn(130, 257, f32), block, "f32"),
        ("zeros", torch.zeros(64, 200, dtype=bf16), block, "f32"),
        ("large_1e4", randn(100, 300, bf16, 1.0e4), block, "f32"),
        ("tiny_1e-6", randn(70, 200, f32, 1.0e-6), block, "f32"),
        ("tiny_bf16_1e-6", randn(100, 300, bf16, 1.0e-6), block, "f32"),
        ("below_eps_1e-12", randn(20, 40, f32, 1.0e-12), block, "f32"),
        ("decades_bf16", log_uniform(130, 257, bf16, -9.0, 3.0), block, "f32"),
        ("decades_f32", log_uniform(129, 140, f32, -9.0, 3.0), block, "f32"),
        ("outlier", outlier, block, "f32"),
        ("signed_zeros", signed_zeros, block, "f32"),
        ("ties", e4m3_ties(gen, 130, 257).to(bf16), block, "f32"),
        ("ties_f32", e4m3_ties(gen, 64, 300), block, "f32"),
        ("column_300x1", randn(300, 1, bf16), block, "f32"),
        ("row_1x300", randn(1, 300, bf16), block, "f32"),
        ("block_64x32", randn(130, 200, bf16), (64, 32), "f32"),
        ("block_1x128", randn(5, 300, f32), (1, 128), "f32"),
        ("block_bigger_than_matrix", randn(50, 60, bf16), (128, 128), "f32"),
        ("bf16_scales", randn(130, 257, bf16), block, "bf16"),
        ("bf16_scales_decades", log_uniform(129, 140, f32, -6.0, 2.0), block, "bf16"),
        ("per_tensor_bf16", randn(130, 257, bf16), None, "f32"),
        ("per_tensor_f32", log_uniform(70, 90, f32, -7.0, 1.0), None, "f32"),
        ("per_tensor_zeros", torch.zeros(3, 5, dtype=f32), None, "f32"),
    ]


ST_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}


def read_safetensors(path):
    """`(tensors, metadata)` of a safetensors file, read with torch alone."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    body = raw[8 + n :]
    tensors = {}
    for name, t in header.items():
        a, b = t["data_offsets"]
        flat = torch.frombuffer(bytearray(body[a:b]), dtype=torch.uint8)
        tensors[name] = flat.view(ST_DTYPES[t["dtype"]]).reshape(t["shape"])
    return tensors, meta


def quantize_case(x, block, scale_dtype, naive=False):
    if block is None:
        return quantize_tensor(x, naive)
    if scale_dtype == "f32":
        # The vectorized form, as a GPU trainer runs it; the loop form must agree with it.
        q, scale = quantize_blocks_padded(x, block[0], block[1], naive)
        q2, scale2 = quantize_blocks(x, block[0], block[1], scale_dtype, naive)
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, scale2)
        return q, scale
    return quantize_blocks(x, block[0], block[1], scale_dtype, naive)


def check(device, path, naive=False):
    """Every stored case re-quantized on `device`; returns the names whose bytes differ. With
    `naive`, scales are computed as `amax / 448.0` (see `to_scale`)."""
    tensors, meta = read_safetensors(path)
    bad = []
    for case in json.loads(meta["cases"]):
        name, block = case["name"], case["block"]
        x = tensors[f"{name}.input"].to(device)
        q, scale = quantize_case(x, block, case["scale_dtype"], naive)
        same_q = torch.equal(q.cpu().view(torch.uint8), tensors[f"{name}.q"].view(torch.uint8))
        want_scale = tensors[f"{name}.scale"]
        same_s = torch.equal(scale.cpu().view(-1).view(torch.uint8), want_scale.view(-1).view(torch.uint8))
        if not (same_q and same_s):
            bad.append(name)
    return bad


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--check":
        bad = check(sys.argv[2], sys.argv[3])
        if bad:
            sys.exit(f"{len(bad)} cases differ on {sys.argv[2]}: {bad}")
        naive = check(sys.argv[2], sys.argv[3], naive=True)
        print(
            f"every case matches on {sys.argv[2]} (torch {torch.__version__}); with scales as "
            f"`amax / 448.0` there, {len(naive)} of them would differ: {naive}"
        )
        return
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT.safetensors | --check DEVICE VECTORS.safetensors")
    from safetensors.torch import save_file

    tensors, meta = {}, []
    for name, x, block, scale_dtype in build_cases():
        q, scale = quantize_case(x, block, scale_dtype)
        tensors[f"{name}.input"] = x.contiguous()
        tensors[f"{name}.q"] = q.contiguous()
        tensors[f"{name}.scale"] = scale.contiguous()
        meta.append(
            {
                "name": name,
                "block": list(block) if block is not None else None,
                "scale_dtype": scale_dtype,
            }
        )
    info = {"cases": json.dumps(meta), "torch": torch.__version__}
    save_file(tensors, sys.argv[1], metadata=info)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"wrote {len(meta)} cases, {total} bytes of tensors, torch {torch.__version__}")


if __name__ == "__main__":
    main()
