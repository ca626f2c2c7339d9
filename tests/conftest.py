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


# JAXATTN_TEST_KERNEL_FLAGS=FLAG[=0|1][,...]: the tests run with those forms of the Mosaic GPU kernels on (or, =0,
# off: the upper-case booleans of jaxattn.kernels.extend_attention_mgpu, `kernel_flags()`), a form before it becomes
# a default or a default's predecessor.
if os.environ.get("JAXATTN_TEST_KERNEL_FLAGS"):
    from jaxattn.kernels import extend_attention_mgpu

    for _setting in os.environ["JAXATTN_TEST_KERNEL_FLAGS"].split(","):
        extend_attention_mgpu.set_kernel_flag(_setting)


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's name, so failures reproduce and tests differ."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
