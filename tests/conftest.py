import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Tokenizers trained by tests go to a per-session cache, not the user's."""
    os.environ.setdefault("TIERLM_CACHE", str(tmp_path_factory.mktemp("tierlm-cache")))
    torch.manual_seed(0)
    yield
