"""Hugging Face hub ids (`org/name`) as model sources, resolved through `huggingface_hub`: the
whole model for an engine (resolve_hub_model), its config alone for the scheduler's claim
(hub_config_folder).

The standard cache comes first (HF_HUB_CACHE, by default ~/.cache/huggingface/hub), so a model
already downloaded serves with no network at all; otherwise the files are downloaded into that
cache with progress. A hub that cannot be reached, a repository that does not exist and a gated
one each get their own message, never a stack trace.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.shared.errors import NotFound, Unavailable

Progress = Callable[[str, float], None]

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
"""`org/name`, as the hub spells repository ids (no leading dot, slash or tilde: paths)."""
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
"""What the engine loads: config, weights, tokenizer and chat template (no .bin, no .gguf)."""


def is_hub_id(source: str) -> bool:
    return bool(HUB_ID.match(source))


def _unreachable(repo_id: str, cache: str, why: str) -> Unavailable:
    return Unavailable(f"model {repo_id!r} is not in the Hugging Face cache ({cache}) and {why}: "
                       f"download it where the hub is reachable (`hf download {repo_id}`) or "
                       "serve a local folder")


def hub_config_folder(repo_id: str, cache_dir: Path | None = None) -> Path:
    """A folder with the model's config.json (and its weights' headers when the whole model is
    cached): what the scheduler sizes a claim from, without downloading the weights."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    where = str(cache_dir) if cache_dir is not None else None
    try:
        return Path(hf_hub_download(repo_id, "config.json", cache_dir=where,
                                    local_files_only=True)).parent
    except LocalEntryNotFoundError:
        pass
    cache = where or constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        raise _unreachable(repo_id, cache, "HF_HUB_OFFLINE is set")
    _fail_fast_if_unreachable(repo_id, cache)
    try:
        return Path(hf_hub_download(repo_id, "config.json", cache_dir=where,
                                    endpoint=constants.ENDPOINT)).parent
    except GatedRepoError:
        raise NotFound(f"model {repo_id!r} is gated on the Hugging Face hub: accept its terms "
                       "and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise NotFound(f"model {repo_id!r} does not exist on the Hugging Face hub "
                       f"({constants.ENDPOINT}), nor as a local path") from None
    except LocalEntryNotFoundError as exc:
        cause = str(exc).split("\n", 1)[0]
        raise _unreachable(repo_id, cache, f"the hub ({constants.ENDPOINT}) cannot be reached "
                                           f"({cause})") from None


def _fail_fast_if_unreachable(repo_id: str, cache: str) -> None:
    """One HEAD of the model's config.json without retries: a hub that refuses the connection,
    cannot be resolved or does not answer is named at once. (hf_hub_download, with nothing
    cached, retries network errors with backoff for ~23 s before it gives up.) Any answer of
    the hub, an error status included, is left to the download, which words it."""
    import httpx2
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    url = hf_hub_url(repo_id, "config.json", endpoint=constants.ENDPOINT)
    try:
        get_hf_file_metadata(url, timeout=constants.HF_HUB_ETAG_TIMEOUT, retry_on_errors=False)
    except (httpx2.NetworkError, httpx2.TimeoutException) as exc:
        raise _unreachable(repo_id, cache, f"the hub ({constants.ENDPOINT}) cannot be reached "
                                           f"({type(exc).__name__}: {exc})") from None
    except HfHubHTTPError:
        pass


def resolve_hub_model(repo_id: str, report: Progress, cache_dir: Path | None = None) -> Path:
    """The snapshot folder of `repo_id`: from the cache when it is there, else downloaded.
    `cache_dir` overrides the standard cache (tests)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = str(cache_dir) if cache_dir is not None else None
    try:
        folder = snapshot_download(repo_id, cache_dir=where, local_files_only=True,
                                   allow_patterns=ALLOW_PATTERNS)
        report("in the Hugging Face cache", 1.0)
        return Path(folder)
    except LocalEntryNotFoundError:
        pass  # not cached: download it
    cache = where or constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        raise _unreachable(repo_id, cache, "HF_HUB_OFFLINE is set")
    report("downloading", 0.0)
    try:
        folder = snapshot_download(repo_id, cache_dir=where, allow_patterns=ALLOW_PATTERNS,
                                   tqdm_class=_progress_tqdm(report))
    except GatedRepoError:
        raise NotFound(f"model {repo_id!r} is gated on the Hugging Face hub: accept its terms "
                       "and set HF_TOKEN") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise NotFound(f"model {repo_id!r} does not exist on the Hugging Face hub "
                       f"({constants.ENDPOINT}), nor as a local path") from None
    except LocalEntryNotFoundError as exc:  # raised for connection errors when nothing is cached
        cause = str(exc).split("\n", 1)[0]
        raise _unreachable(repo_id, cache, f"the hub ({constants.ENDPOINT}) cannot be reached "
                                           f"({cause})") from None
    report("downloaded", 1.0)
    return Path(folder)


def _progress_tqdm(report: Progress) -> type[Any]:
    """A tqdm class for snapshot_download whose byte bars feed `report` instead of drawing on a
    terminal: the engine process has none, its progress goes to the instance's state message."""
    from tqdm.auto import tqdm

    class Reporting(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.counts_bytes = kwargs.get("unit") == "B"
            kwargs.update(disable=False, file=_Null())
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            if self.counts_bytes and self.total:
                report(f"downloading {self.n / 1e6:.0f} of {self.total / 1e6:.0f} MB",
                       min(0.99, self.n / self.total))
            return shown

    return Reporting


class _Null:
    def write(self, _text: str) -> None:
        pass

    def flush(self) -> None:
        pass
