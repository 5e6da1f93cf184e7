"""`Service.update_weights` input kinds: numpy float32 / float64 / float16, bfloat16 (ml_dtypes)
and its raw uint16 bits, DLPack producers (strided too), non-native byte order; each must reach
the engines as the same BF16 weights, and bad input must raise and change nothing."""

import ctypes
import time

import ml_dtypes
import numpy as np
import pytest

import troupe
from conftest import need_torch

NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def env(served):
    cluster, svc = served
    return svc, cluster.spawn_trainer(model="tiny")


class DL:
    """A DLPack producer that is not a numpy array (as a torch tensor would be)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return (1, 0)


class OnDevice:
    """A DLPack producer on an accelerator (DLPack device type 2, CUDA) that exports to the host
    only when asked with `dl_device=(1, 0), copy=True`, as a torch CUDA tensor does."""

    def __init__(self, a):
        self.a, self.asked = a, []

    def __dlpack__(self, stream=None, dl_device=None, copy=None):
        self.asked.append((dl_device, copy))
        if dl_device != (1, 0) or not copy:
            raise BufferError("device memory cannot be read from the host")
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return (2, 0)


class OldOnDevice(OnDevice):
    """An accelerator tensor of an older producer, whose `__dlpack__` takes no arguments."""

    def __dlpack__(self):
        raise BufferError("device memory cannot be read from the host")


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class BF16Producer:
    """A DLPack producer of a bfloat16 tensor (DLPack type code 4), as torch exports one: the
    test double for torch where torch is not installed. Counts its deleter's calls."""

    def __init__(self, bits, device_type=1):
        self.bits = np.ascontiguousarray(bits, dtype=np.uint16)
        self.shape = (ctypes.c_int64 * self.bits.ndim)(*self.bits.shape)
        self.deleted = 0
        self.deleter = DELETER(self._delete)
        self.managed = DLManagedTensor()
        t = self.managed.dl_tensor
        t.data = self.bits.ctypes.data
        t.device = DLDevice(device_type, 0)
        t.ndim = self.bits.ndim
        t.dtype = DLDataType(4, 16, 1)
        t.shape = self.shape
        t.strides = None
        t.byte_offset = 0
        self.managed.deleter = self.deleter

    def _delete(self, _ptr):
        self.deleted += 1

    def __dlpack__(self, **_kw):
        return _capsule_new(ctypes.addressof(self.managed), b"dltensor", None)

    def __dlpack_device__(self):
        return (1, 0)


def greedy(svc):
    return svc.client().generate([5, 6, 7, 8], max_new_tokens=8, temperature=0.0, ignore_eos=True)["output_ids"].tolist()


def pushed(svc, tensors, version):
    rep = svc.update_weights(tensors, version=version)
    assert rep["version"] == str(version) and svc.weight_version() == str(version)
    return greedy(svc)


def test_every_float_kind_reaches_the_engines_as_the_same_bf16_weights(env):
    svc, _ = env
    w = np.random.default_rng(1).normal(size=64).astype(np.float32) * 3
    wb = w.astype(ml_dtypes.bfloat16)  # what the engines hold
    exact = wb.astype(np.float32)
    ref = pushed(svc, {NORM: wb}, "bf16")
    assert pushed(svc, {NORM: np.ones(64, np.float32)}, "ones") != ref
    assert pushed(svc, {NORM: exact}, "f32") == ref
    assert pushed(svc, {NORM: wb.view(np.uint16)}, "bits") == ref
    assert pushed(svc, {NORM: exact.astype(np.float64)}, 7) == ref
    assert pushed(svc, {NORM: exact.astype(">f4")}, "big-endian") == ref
    assert pushed(svc, {NORM: DL(exact)}, "dlpack-f32") == ref
    assert pushed(svc, {NORM: DL(wb.view(np.uint16))}, "dlpack-bits") == ref
    assert pushed(svc, {NORM: DL(exact.astype(np.float64))}, "dlpack-f64") == ref
    h = w.astype(np.float16)
    assert pushed(svc, {NORM: h}, "f16") == pushed(svc, {NORM: h.astype(np.float32)}, "f16-as-f32")
    assert pushed(svc, {NORM: DL(h)}, "dlpack-f16") == pushed(svc, {NORM: h.astype(np.float32)}, "f16-again")


def test_a_bf16_dlpack_tensor_is_read_and_handed_back(env):
    svc, _ = env
    wb = (np.random.default_rng(3).normal(size=64) * 2).astype(ml_dtypes.bfloat16)
    ref = pushed(svc, {NORM: wb.astype(np.float32)}, "bf16-ref")
    producer = BF16Producer(wb.view(np.uint16))
    assert pushed(svc, {NORM: producer}, "bf16-dlpack") == ref
    deadline = time.monotonic() + 30
    while producer.deleted == 0:  # the consumer calls the deleter when it is done
        assert time.monotonic() < deadline, "the DLPack deleter was never called"
        time.sleep(0.01)
    assert producer.deleted == 1


def test_strided_arrays_are_read_in_their_logical_order(env):
    svc, trainer = env
    name, w = next((k, v) for k, v in trainer.get_weights().items() if v.ndim == 2 and v.shape[0] != v.shape[1])
    w = (w + np.random.default_rng(2).normal(size=w.shape).astype(np.float32)).astype(ml_dtypes.bfloat16).astype(np.float32)
    ref = pushed(svc, {name: w}, "contiguous")
    fortran = np.asfortranarray(w)
    assert not fortran.flags.c_contiguous
    assert pushed(svc, {name: fortran}, "fortran") == ref
    assert pushed(svc, {name: DL(fortran)}, "dlpack-strided") == ref
    wide = np.zeros((w.shape[0], w.shape[1] * 2), np.float32)
    wide[:, ::2] = w
    assert pushed(svc, {name: DL(wide[:, ::2])}, "dlpack-step") == ref


def test_the_rust_path_and_the_numpy_path_send_the_same_weights(env):
    svc, trainer = env
    via_rust = svc.update_weights_from(trainer, "rust")
    assert via_rust["version"] == "rust"
    a = greedy(svc)
    assert pushed(svc, trainer.get_weights(), "numpy") == a


def test_bad_tensors_raise_and_change_nothing(env):
    svc, _ = env
    pushed(svc, {NORM: np.ones(64, np.float32)}, "good")
    before = greedy(svc)
    cases = [
        (TypeError, NORM, {NORM: np.zeros(64, np.int32)}),
        (TypeError, "device type 2, not the CPU.*would not copy", {NORM: OldOnDevice(np.zeros(64, np.float32))}),
        (TypeError, f"{NORM}: the producer would not export it \\(BufferError: grad", {NORM: Refuses()}),
        (TypeError, "tensor names", {3: np.zeros(64, np.float32)}),
        (troupe.WeightSyncError, "65", {NORM: np.zeros(65, np.float32)}),
        (troupe.WeightSyncError, "no_such", {"model.no_such.weight": np.zeros(64, np.float32)}),
        (TypeError, NORM, {NORM: "not an array"}),
    ]
    for exc, match, tensors in cases:
        with pytest.raises(exc, match=match):
            svc.update_weights(tensors, version="bad")
    with pytest.raises(TypeError, match="version"):
        svc.update_weights({NORM: np.ones(64, np.float32)}, version=-1)
    # A version is checked where it is given, as every version is: naming the argument.
    for bad in ["", "a\nb", "v" * 300]:
        with pytest.raises(ValueError, match="^version: "):
            svc.update_weights({NORM: np.ones(64, np.float32)}, version=bad)
    assert svc.weight_version() == "good" and greedy(svc) == before


class Refuses:
    """A host tensor whose producer refuses to export it (torch does for a tensor needing grad)."""

    def __dlpack__(self, **_kw):
        raise BufferError("grad")

    def __dlpack_device__(self):
        return (1, 0)


def test_an_accelerator_tensor_is_copied_to_the_host_on_the_way(env):
    svc, _ = env
    w = (np.random.default_rng(4).normal(size=64) * 2).astype(ml_dtypes.bfloat16).astype(np.float32)
    ref = pushed(svc, {NORM: w}, "host-ref")
    on_device = OnDevice(w)
    assert pushed(svc, {NORM: on_device}, "from-device") == ref
    assert on_device.asked == [((1, 0), True)]


def test_a_capsule_on_a_device_is_refused_whatever_its_producer_said(env):
    svc, _ = env
    pushed(svc, {NORM: np.ones(64, np.float32)}, "before-liar")
    before = greedy(svc)
    liar = BF16Producer(np.zeros(64, np.uint16), device_type=2)
    with pytest.raises(TypeError, match="gave a tensor on DLPack device type 2"):
        svc.update_weights({NORM: liar}, version="liar")
    assert liar.deleted == 1, "a refused capsule is still handed back to its producer"
    assert svc.weight_version() == "before-liar" and greedy(svc) == before


def test_torch_tensors_go_through_dlpack_bf16_included(env):
    torch = need_torch()
    svc, _ = env
    w = torch.randn(64, dtype=torch.float32).to(torch.bfloat16)
    ref = pushed(svc, {NORM: w.float().numpy()}, "torch-ref")
    assert pushed(svc, {NORM: w}, "torch-bf16") == ref
    assert pushed(svc, {NORM: w.float()}, "torch-f32") == ref
    p = torch.nn.Parameter(w.float())  # named_parameters() needs detach(); torch says so
    with pytest.raises(TypeError, match=f"{NORM}.*detach"):
        svc.update_weights({NORM: p}, version="param")
    assert pushed(svc, {NORM: p.detach()}, "param-detached") == ref


def test_cuda_tensors_reach_the_engines_from_a_gpu_trainer(env):
    torch = need_torch()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    svc, trainer = env
    w = torch.randn(64, dtype=torch.float32).to(torch.bfloat16)
    ref = pushed(svc, {NORM: w}, "cuda-ref")
    assert pushed(svc, {NORM: w.cuda()}, "cuda-bf16") == ref
    assert pushed(svc, {NORM: w.float().cuda()}, "cuda-f32") == ref
    # A whole model's weights as a GPU trainer's state_dict holds them (bf16 on the device),
    # one of them a non-contiguous view.
    host = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in trainer.get_weights().items()}
    ref = pushed(svc, host, "model-ref")
    sd = {k: torch.from_numpy(v).to(torch.bfloat16).cuda() for k, v in host.items()}
    name = next(k for k, v in host.items() if v.ndim == 2 and v.shape[0] != v.shape[1])
    sd[name] = sd[name].t().contiguous().t()
    assert not sd[name].is_contiguous() and all(t.is_cuda for t in sd.values())
    assert pushed(svc, sd, "model-cuda") == ref
