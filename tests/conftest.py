import os
import zlib

import numpy as np
import pytest

# On CPU machines (CI), XLA's CPU compiler at its lowest optimisation level: the tests compile hundreds of small
# computations (each reference call, each eager op, each shape) and run each once, so compiling is most of their time
# (test_kernel_model_on_random_batches: 23 s -> 16 s with the extend reference as one jitted computation). The HLO
# is the same and LLVM keeps IEEE semantics at any level. Set before JAX starts its backend; a GPU machine keeps
# its defaults.
if not os.path.exists("/dev/nvidiactl"):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
    ).strip()


# JAXATTN_TEST_KERNEL_FLAGS=PREFIX_FAST_WAITS[,FP8_ADDRESSES_PER_TILE]: the tests run with those opt-in forms of the
# Mosaic GPU kernels on (upper-case booleans of jaxattn.kernels.extend_attention_mgpu), before one becomes a default.
if os.environ.get("JAXATTN_TEST_KERNEL_FLAGS"):
    from jaxattn.kernels import extend_attention_mgpu

    for _flag in os.environ["JAXATTN_TEST_KERNEL_FLAGS"].split(","):
        if _flag not in extend_attention_mgpu.opt_in_flags():
            raise ValueError(f"JAXATTN_TEST_KERNEL_FLAGS names {_flag!r}, not a flag of extend_attention_mgpu")
        setattr(extend_attention_mgpu, _flag, True)


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's name, so failures reproduce and tests differ."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
