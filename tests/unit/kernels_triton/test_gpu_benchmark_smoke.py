"""The GPU benchmark's plumbing on tiny shapes (CPU interpreter), and its refusal without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_kernels import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels are compiled for the GPU here; "
                    "run python -m benchmarks.gpu_kernels for real instead")
def test_smoke_run_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    assert main(["--smoke", "--skip-transformers", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    kernels = {row["kernel"] for row in result["kernels"]}
    assert kernels == {"reshape_and_cache", "paged_attention_decode", "rms_norm_residual", "rotary"}
    shoal = result["engine"]["shoal"]
    assert shoal["batch1_decode_tok/s"] > 0 and shoal["throughput_16_output_tok/s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_refuses_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", "/nonexistent/x.json"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
