import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's name, so failures reproduce and tests differ."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
