"""A decoder embedder (Qwen3-Embedding style: a causal LM, last-token pooling, normalised) in the
embedding engine, on the generation engine's own Qwen3 code, against sentence-transformers on a
tiny random Qwen3 padded left and right; the checkpoint saved as the trunk alone (as
Qwen3-Embedding ships it); vLLM's task and override_pooler_config; packed batches of any size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from shoal.services.engine import EmbeddingEngine, EngineConfig, is_embedding_model
from shoal.services.engine.embedding.pooling import read_pooling
from shoal.shared.errors import InvalidRequest
from tests.tiny_models import save_tiny_decoder_embedder

SentenceTransformer = pytest.importorskip("sentence_transformers").SentenceTransformer
TEXTS = ["The capital of France is Paris.", "Paris", "Bananas are yellow and curved, mostly.",
         "word " * 40, "Ünïcödé and punctuation!? 123", "a b c d e f g h i j k l m n o p q"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_decoder_embedder(tmp_path_factory.mktemp("qwen3-embedder"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> EmbeddingEngine:
    return EmbeddingEngine(EngineConfig(model=str(model_dir), num_threads=1), model_dir)


def reference(folder: Path, texts: list[str], side: str) -> np.ndarray:
    st = SentenceTransformer(str(folder), device="cpu")
    st.tokenizer.padding_side = side
    return st.encode(texts, batch_size=4)


@pytest.mark.parametrize("side", ["left", "right"])
def test_last_token_pooling_matches_sentence_transformers(engine: EmbeddingEngine,
                                                          model_dir: Path, side: str) -> None:
    assert engine.pooling.mode == "last" and engine.pooling.normalize
    ours = engine.encode(TEXTS).numpy()
    ref = reference(model_dir, TEXTS, side)
    assert ours.shape == ref.shape == (len(TEXTS), 64)
    assert np.abs(ours - ref).max() <= 1e-5
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    assert np.abs(ours[0] - ours[1]).max() > 0.05  # the vectors differ: the check can fail


def test_which_folders_embed(model_dir: Path, tmp_path: Path) -> None:
    assert is_embedding_model(model_dir)  # sentence-transformers' files: task "auto" embeds
    assert not is_embedding_model(model_dir, "generate")
    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain)
    shutil.rmtree(plain / "1_Pooling")
    (plain / "modules.json").unlink()
    assert not is_embedding_model(plain)  # a causal LM generates unless asked to embed
    assert is_embedding_model(plain, "embed")
    pooling = read_pooling(plain)  # vLLM's default for an embedding causal LM: LAST, normalised
    assert (pooling.mode, pooling.normalize) == ("last", True)


def test_trunk_only_checkpoint_and_overrides(model_dir: Path, engine: EmbeddingEngine,
                                             tmp_path: Path) -> None:
    """sentence-transformers saves the trunk alone ("layers.0..." with no "model." and no LM
    head), as Qwen3-Embedding's files are: the same vectors."""
    saved = tmp_path / "saved"
    SentenceTransformer(str(model_dir), device="cpu").save(str(saved))
    from safetensors import safe_open
    with safe_open(str(next(saved.glob("*.safetensors"))), framework="pt") as f:
        names = list(f.keys())
    assert names and not any(n.startswith(("model.", "lm_head.")) for n in names)
    trunk = EmbeddingEngine(EngineConfig(model=str(saved), num_threads=1), saved)
    assert (trunk.encode(TEXTS) - engine.encode(TEXTS)).abs().max().item() <= 1e-6
    mean = EmbeddingEngine(EngineConfig(model=str(model_dir), num_threads=1, override_pooler_config=
                                        json.dumps({"pooling_type": "mean"})), model_dir)
    hidden_mean = mean.encode(TEXTS)
    assert mean.pooling.mode == "mean" and (hidden_mean - engine.encode(TEXTS)).abs().max() > 0.05


def test_small_batches_give_the_same_vectors(model_dir: Path, engine: EmbeddingEngine) -> None:
    """Packed batches of one or two inputs and tight token budgets (the scratch KV cache grows
    with the largest batch) give the vectors of one big batch."""
    tight = EmbeddingEngine(EngineConfig(model=str(model_dir), num_threads=1, max_num_seqs=2,
                                         max_num_batched_tokens=24, block_size=8), model_dir)
    assert (tight.encode(TEXTS) - engine.encode(TEXTS)).abs().max().item() <= 1e-5


def test_refusals(engine: EmbeddingEngine) -> None:
    with pytest.raises(InvalidRequest) as err:
        engine.encode(["word " * 400])
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequest):
        engine.score([([1, 2], [0, 0])])  # an embedder has no scores
    with pytest.raises(InvalidRequest):
        EngineConfig(model="m", override_pooler_config={"pooling_type": "STEP"})
    with pytest.raises(InvalidRequest):
        EngineConfig(model="m", task="classify")
    assert torch.isfinite(engine.encode(["x"])).all()
