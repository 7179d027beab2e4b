"""model_prep: folders pass through, a GGUF converts once into a cache keyed by its file (with
progress, atomically), and every wrong source is a clear NotFound instead of a crash later."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from shoal.services.engine.model_prep import converted_dir, prepare_model, smollm2_gguf_path
from shoal.shared.errors import NotFound


def test_a_model_folder_is_used_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    stages: list[tuple[str, float]] = []
    assert prepare_model(str(tmp_path), progress=lambda s, f: stages.append((s, f))) == tmp_path
    assert stages == [("ready", 1.0)]


@pytest.mark.parametrize("make", ["folder_without_config", "other_file", "missing", "bad_hub_id"])
def test_wrong_sources_are_not_found(make: str, tmp_path: Path) -> None:
    if make == "folder_without_config":
        source = str(tmp_path)
    elif make == "other_file":
        (tmp_path / "weights.bin").write_bytes(b"\0")
        source = str(tmp_path / "weights.bin")
    elif make == "missing":
        source = str(tmp_path / "nope.gguf")
    else:
        source = "not-a-hub-id"
    with pytest.raises(NotFound):
        prepare_model(source, cache_dir=tmp_path / "cache")


def test_the_cache_key_follows_the_file(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"one")
    first = converted_dir(gguf, tmp_path / "cache")
    assert first.parent == tmp_path / "cache" and first.name.startswith("m-")
    assert converted_dir(gguf, tmp_path / "cache") == first
    gguf.write_bytes(b"other contents")  # a new file at the same path converts again
    assert converted_dir(gguf, tmp_path / "cache") != first


@pytest.mark.slow
def test_gguf_converts_once_with_progress_and_leaves_no_temp_dir(tmp_path: Path) -> None:
    gguf = tmp_path / "smol.gguf"
    os.symlink(smollm2_gguf_path(), gguf)  # a path of its own: a cache entry of its own
    cache = tmp_path / "cache"
    reports: list[tuple[str, float]] = []
    folder = prepare_model(str(gguf), cache, lambda stage, f: reports.append((stage, f)))
    stages = [stage for stage, _ in reports]
    assert folder == converted_dir(gguf, cache)
    assert stages[0] == "dequantising gguf tensors" and stages[-1] == "done"
    # tensor by tensor, not 0 % then done
    fractions = [f for stage, f in reports if stage == "dequantising gguf tensors"]
    assert len({round(f, 2) for f in fractions if 0 < f < 0.7}) >= 3
    assert fractions == sorted(fractions)
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    assert (folder / "tokenizer.json").is_file()
    assert [p.name for p in cache.iterdir()] == [folder.name]  # the temp dir was renamed
    again: list[str] = []
    assert prepare_model(str(gguf), cache, lambda stage, fraction: again.append(stage)) == folder
    assert again == ["cached"]
    shutil.rmtree(folder)
