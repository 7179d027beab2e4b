"""A cross-encoder (BertForSequenceClassification, one label) in the embedding engine against
sentence-transformers' CrossEncoder on a tiny random model with MiniLM's tokenizer: pair
tokenization with token types, the pooler and classifier, the sigmoid, packed batches, and the
refusals between embedders and cross-encoders."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from shoal.services.engine import EmbeddingEngine, EngineConfig, minilm_path
from shoal.services.engine.embedding.async_engine import AsyncEmbeddingEngine
from shoal.services.engine.embedding.pooling import is_embedding_model
from shoal.shared.errors import InvalidRequest
from tests.tiny_models import save_tiny_cross_encoder

CrossEncoder = pytest.importorskip("sentence_transformers").CrossEncoder
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "word " * 60,
        "Ünïcödé and punctuation!? 123", "France", "The Eiffel Tower is in Paris, France."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> EmbeddingEngine:
    return EmbeddingEngine(EngineConfig(model=str(model_dir), num_threads=1), model_dir)


def reference(folder: Path, pairs: list[tuple[str, str]]) -> torch.Tensor:
    ce = CrossEncoder(str(folder), device="cpu")
    return torch.as_tensor(ce.predict(pairs, batch_size=4)).float()


def test_scores_match_sentence_transformers(engine: EmbeddingEngine, model_dir: Path) -> None:
    assert is_embedding_model(model_dir) and engine.activation == "sigmoid"
    ours = engine.score_texts([QUERY] * len(DOCS), DOCS)
    ref = reference(model_dir, [(QUERY, d) for d in DOCS])
    assert ours.shape == (len(DOCS),)
    assert (ours - ref).abs().max().item() <= 1e-5
    assert ours.max() - ours.min() > 0.05  # the scores differ: the check can fail


def test_token_types_count(engine: EmbeddingEngine) -> None:
    """The document is segment 1: scoring it as segment 0 gives other scores."""
    pairs = engine.inputs.pair_inputs([QUERY], DOCS[:1])
    ids, types = pairs[0]
    assert types[0] == 0 and types[-1] == 1 and len(ids) == len(types)
    flat = engine.score([(ids, [0] * len(ids))])
    assert (engine.score(pairs) - flat).abs().item() > 1e-4


def test_small_batches_and_identity_activation(model_dir: Path, engine: EmbeddingEngine,
                                               tmp_path: Path) -> None:
    tight = EmbeddingEngine(EngineConfig(model=str(model_dir), num_threads=1, max_num_seqs=2,
                                         max_num_batched_tokens=64), model_dir)
    pairs = tight.inputs.pair_inputs([QUERY] * len(DOCS), DOCS)
    assert len(tight.batches([len(p[0]) for p in pairs])) >= 3
    assert (tight.score(pairs) - engine.score(pairs)).abs().max().item() <= 1e-6
    # a model saved with Identity: the raw logit, as CrossEncoder gives it
    folder = tmp_path / "identity"
    folder.mkdir()
    for f in model_dir.iterdir():
        (folder / f.name).symlink_to(f)
    config = json.loads((model_dir / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    raw = EmbeddingEngine(EngineConfig(model=str(folder), num_threads=1), folder)
    ref = reference(folder, [(QUERY, d) for d in DOCS])
    assert raw.activation == "identity"
    assert (raw.score(pairs) - ref).abs().max().item() <= 1e-4
    assert (torch.sigmoid(raw.score(pairs)) - engine.score(pairs)).abs().max().item() <= 1e-6


def test_truncation_and_refusals(engine: EmbeddingEngine) -> None:
    long = "word " * 600
    with pytest.raises(InvalidRequest) as err:
        engine.score_texts([QUERY], [long])
    assert err.value.code == "context_length_exceeded"
    pairs = engine.inputs.pair_inputs([QUERY], [long], truncate=-1)
    assert len(pairs[0][0]) == engine.max_model_len
    embedder = EmbeddingEngine(EngineConfig(model=str(minilm_path()), num_threads=1),
                               minilm_path())
    with pytest.raises(InvalidRequest) as err:
        embedder.score(pairs)
    assert err.value.code == "wrong_model_type"


async def test_async_engine_batches_scores(model_dir: Path, engine: EmbeddingEngine) -> None:
    served = AsyncEmbeddingEngine(EngineConfig(model=str(model_dir), num_threads=1), model_dir)
    try:
        pairs = engine.inputs.pair_inputs([QUERY] * len(DOCS), DOCS)
        got = await asyncio.gather(*(served.score([p]) for p in pairs))
        assert (torch.cat(got) - engine.score(pairs)).abs().max().item() <= 1e-6
        with pytest.raises(InvalidRequest) as err:  # a cross-encoder does not embed
            await served.embed([pairs[0][0]])
        assert err.value.code == "wrong_model_type"
    finally:
        served.shutdown()
