"""An XLM-RoBERTa cross-encoder (XLMRobertaForSequenceClassification, one label: bge-reranker's
architecture) in the embedding engine against sentence-transformers' CrossEncoder on a tiny
random model: positions counted from pad_token_id + 1, one token type, the classifier head on
<s>, pairs as `<s> a </s></s> b </s>`, and the position table's limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal.services.engine import EmbeddingEngine, EngineConfig, is_embedding_model
from shoal.shared.errors import InvalidRequest
from tests.tiny_models import save_tiny_xlm_roberta_cross_encoder

CrossEncoder = pytest.importorskip("sentence_transformers").CrossEncoder
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "word " * 40,
        "Ünïcödé and punctuation!? 123", "France", "The Eiffel Tower is in Paris, France."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_xlm_roberta_cross_encoder(tmp_path_factory.mktemp("xlmr-cross-encoder"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> EmbeddingEngine:
    return EmbeddingEngine(EngineConfig(model=str(model_dir), num_threads=1), model_dir)


def test_scores_match_sentence_transformers(engine: EmbeddingEngine, model_dir: Path) -> None:
    assert is_embedding_model(model_dir) and engine.activation == "sigmoid"
    ours = engine.score_texts([QUERY] * len(DOCS), DOCS)
    ce = CrossEncoder(str(model_dir), device="cpu")
    ref = torch.as_tensor(ce.predict([(QUERY, d) for d in DOCS], batch_size=4)).float()
    assert (ours - ref).abs().max().item() <= 1e-5
    assert ours.max() - ours.min() > 0.05  # the scores differ: the check can fail


def test_pairs_positions_and_limit(engine: EmbeddingEngine) -> None:
    (ids, types), = engine.inputs.pair_inputs([QUERY], ["Paris"])
    assert ids[0] == 0 and ids[-1] == 2 and 2 in ids[1:-1] and set(types) == {0}
    assert engine.max_model_len == 128  # 130 positions, counted from pad_token_id + 1 = 2
    long = engine.inputs.pair_inputs([QUERY], ["word " * 200], truncate=-1)
    assert len(long[0][0]) == 128
    assert torch.isfinite(engine.score(long)).all()  # the last position is in the table
    with pytest.raises(InvalidRequest) as err:
        engine.score_texts([QUERY], ["word " * 200])
    assert err.value.code == "context_length_exceeded"
