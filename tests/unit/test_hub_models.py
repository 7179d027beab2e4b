"""Hugging Face ids as model sources, against a Hugging Face cache laid out as huggingface_hub
writes it (models--org--name/refs/main -> snapshots/<rev>/...): a cached model resolves with no
network, for the engine (the whole snapshot) and the scheduler (its config); an uncached one on a
machine where the hub cannot be reached, or with HF_HUB_OFFLINE, is refused saying exactly that."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from huggingface_hub import constants

from shoal.services.engine.model_prep import prepare_model
from shoal.services.scheduler.claim import read_profile
from shoal.shared.embedded import free_port
from shoal.shared.errors import NotFound, Unavailable
from shoal.shared.hf_hub import hub_config_folder, is_hub_id

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
          "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 1024}


def hf_cache(root: Path, repo_id: str, files: dict[str, str], revision: str = "0123abcd") -> Path:
    """A cache as huggingface_hub lays it out: blobs, a snapshot of links to them, refs/main."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, (name, text) in enumerate(files.items()):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_text(text)
        (snapshot / name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def unreachable_hub(monkeypatch: pytest.MonkeyPatch) -> str:
    """The hub's address is a closed local port: connection refused, at once."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)  # both, as HF_ENDPOINT sets them
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return endpoint


def test_hub_ids_and_paths_are_told_apart() -> None:
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_hub_id("org/m.v1_2")
    assert not any(is_hub_id(s) for s in ("/models/x", "./org/x", "~/org/x", "x", "a/b/c",
                                          "org/", ".hidden/x"))


def test_a_cached_model_resolves_offline(tmp_path: Path, unreachable_hub: str) -> None:
    snapshot = hf_cache(tmp_path, "org/tiny", {"config.json": json.dumps(CONFIG),
                                               "tokenizer.json": "{}"})
    stages: list[tuple[str, float]] = []
    folder = prepare_model("org/tiny", tmp_path / "shoal-cache",
                           lambda s, f: stages.append((s, f)), hub_cache_dir=tmp_path)
    assert folder == snapshot and (folder / "config.json").is_file()
    assert stages == [("in the Hugging Face cache", 1.0)]
    assert hub_config_folder("org/tiny", tmp_path) == snapshot


def test_the_scheduler_sizes_a_cached_hub_model(tmp_path: Path, unreachable_hub: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    hf_cache(tmp_path, "org/tiny", {"config.json": json.dumps(CONFIG)})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # the standard cache
    profile = read_profile("org/tiny")
    assert profile.shape.num_layers == 2 and profile.shape.max_position_embeddings == 1024


def test_an_uncached_model_with_the_hub_unreachable_says_so(
        tmp_path: Path, unreachable_hub: str, caplog: pytest.LogCaptureFixture) -> None:
    """Said at once: a refused connection is not retried (huggingface_hub's backoff would
    keep a user of `shoal serve` waiting ~23 s for the same answer)."""
    caplog.set_level(logging.INFO, logger="huggingface_hub")
    with pytest.raises(Unavailable) as err:
        prepare_model("org/absent", tmp_path / "shoal-cache", hub_cache_dir=tmp_path)
    message = err.value.message
    assert "'org/absent' is not in the Hugging Face cache" in message
    assert f"the hub ({unreachable_hub}) cannot be reached" in message and str(tmp_path) in message
    with pytest.raises(Unavailable, match="cannot be reached"):
        hub_config_folder("org/absent", tmp_path)
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]


def test_hf_hub_offline_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(Unavailable, match="HF_HUB_OFFLINE is set"):
        prepare_model("org/absent", tmp_path / "shoal-cache", hub_cache_dir=tmp_path)


def test_a_missing_path_is_not_mistaken_for_a_hub_id(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="no such folder"):
        prepare_model(str(tmp_path / "nope"), tmp_path / "cache")


def test_download_progress_is_reported_in_bytes() -> None:
    """snapshot_download's byte bars (unit "B") feed the progress callback; its file-count bar
    does not (no hub here: the bar class is driven as snapshot_download drives it)."""
    from shoal.shared.hf_hub import _progress_tqdm

    reports: list[tuple[str, float]] = []
    bar_class = _progress_tqdm(lambda stage, f: reports.append((stage, f)))
    files = bar_class(total=3, desc="Fetching 3 files")
    files.update(1)
    data = bar_class(total=200e6, unit="B", desc="Downloading bytes")
    data.update(50e6)
    data.update(150e6)
    files.close()
    data.close()
    assert reports == [("downloading 50 of 200 MB", 0.25), ("downloading 200 of 200 MB", 0.99)]
