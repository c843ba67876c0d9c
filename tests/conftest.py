import os
import tempfile
from pathlib import Path

import pytest
import torch

# Trained tokenizers and encoded corpora, kept between sessions as the compile tests' kernels
# are: entries are keyed by their content (texts, vocab size, tokenizer), the library versions
# and the producing code (tierlm.cache_keys) and written atomically,
# so sessions (and clones) share them safely; training and encoding them again costs seconds
# per corpus and vocab size in every session.
SHARED_DATA_CACHE = Path(tempfile.gettempdir()) / f"tierlm-test-data-{os.getuid()}"


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Tokenizers trained by tests go to a test cache, not the user's: a per-session folder
    whose tokenizers and tokens live in SHARED_DATA_CACHE (the rest, such as a probe's saved
    results, stays with the session)."""
    if "TIERLM_CACHE" not in os.environ:
        cache = tmp_path_factory.mktemp("tierlm-cache")
        for kind in ("tokenizers", "tokens"):
            shared = SHARED_DATA_CACHE / kind
            shared.mkdir(parents=True, exist_ok=True)
            (cache / kind).symlink_to(shared, target_is_directory=True)
        os.environ["TIERLM_CACHE"] = str(cache)
    torch.manual_seed(0)
    yield


@pytest.fixture
def make_engine(tmp_path):
    """The engine factory (tests.runtime_helpers.new_engine) with the engine's files under this
    test's tmp_path/offload unless `offload_dir` says where: make_engine(model, policy="disk",
    micro_batches=2, ...), any EngineOptions field by name."""
    # imported here: runtime_helpers loads transformers, which tests that build no engine skip
    from tests.runtime_helpers import new_engine

    def make(model, offload_dir=None, **options):
        return new_engine(model, tmp_path / "offload" if offload_dir is None else offload_dir,
                          **options)

    return make
