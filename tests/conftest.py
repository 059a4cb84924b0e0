import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared"
WIKITEXT = SHARED / "data" / "wikitext-2"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny():
    from pipeline.config import ModelConfig
    from pipeline.model import load_model
    return load_model(ModelConfig(name="tiny", source="tiny"))


@pytest.fixture(scope="session")
def smollm2():
    from pipeline.config import ModelConfig
    from pipeline.model import load_model
    return load_model(ModelConfig())


@pytest.fixture(scope="session")
def tiny_windows(tiny):
    from pipeline.config import DataConfig
    from pipeline.data import build_windows
    return build_windows(DataConfig(n_samples=3, seq_len=48, eval_n_samples=2, eval_seq_len=48), tiny.tokenizer)
