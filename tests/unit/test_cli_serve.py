"""`shoal serve` with `vllm serve`'s flags: each becomes the model's field or engine arg that
does the same, the deploy's own rules check the values, and vLLM flags Shoal does not implement
are refused by name (never ignored)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.cli import build_parser, main
from shoal.cli.serve import model_spec
from shoal.cli.progress import ProgressView
from shoal.shared.errors import InvalidRequest, NotFound
from shoal.shared.progress import parse_progress, progress_message
from shoal.shared.schemas.registry import InstancePublic
from shoal.shared.states import InstanceState
from shoal.shared.version import VERSION


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return tmp_path / "my-model"


def spec(*argv: str):
    return model_spec(build_parser().parse_args(["serve", *argv]))


def test_vllm_flags_become_the_models_settings(folder: Path, tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    s = spec(str(folder), "--served-model-name", "smol", "--max-model-len", "4096",
             "--dtype", "half", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "8",
             "--no-enable-prefix-caching", "--seed", "7", "--chat-template", str(template),
             "--max-num-batched-tokens", "1024", "--kv-cache-memory-bytes", "67108864",
             "--tool-call-parser", "qwen3_xml", "--reasoning-parser", "qwen3",
             "--quantization", "int8", "--speculative-config",
             '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
    assert (s.name, s.source, s.max_model_len, s.dtype, s.gpu_memory_utilization) == \
        ("smol", str(folder), 4096, "float16", 0.5)
    assert s.engine_args.given() == {
        "max_num_seqs": 8, "max_num_batched_tokens": 1024, "kv_cache_memory": 67108864,
        "enable_prefix_caching": False, "seed": 7, "tool_call_parser": "qwen3_xml",
        "reasoning_parser": "qwen3", "quantization": "int8",
        "chat_template": template.read_text(),
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                               "prompt_lookup_min": 4, "prompt_lookup_max": 4}}
    assert s.device.value == "cpu" and s.tp is None
    parallel = spec(str(folder), "--tensor-parallel-size", "2", "-pp", "2")
    assert (parallel.tp, parallel.pp, parallel.device.value) == (2, 2, "auto")
    assert spec(str(folder)).name == "my-model" and spec(str(folder)).engine_args.given() == {}


def test_bad_values_are_refused_by_the_deploy_rules(folder: Path) -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        spec(str(folder), "--max-num-seqs", "0")
    with pytest.raises(InvalidRequest, match="speculative-config is not JSON"):
        spec(str(folder), "--speculative-config", "{method: ngram}")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        spec(str(folder), "--speculative-config", '{"method": "ngram"}')
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, gguf"):
        spec(str(folder), "--quantization", "awq")
    with pytest.raises(ValueError, match="must be a .gguf file"):
        spec(str(folder), "--quantization", "gguf")
    with pytest.raises(InvalidRequest, match="generation-config"):
        spec(str(folder), "--generation-config", "auto")
    with pytest.raises(NotFound, match="neither a file nor a Jinja template"):
        spec(str(folder), "--chat-template", "missing.jinja")
    with pytest.raises(NotFound, match="nor is 'nowhere' a Hugging Face id"):
        spec("nowhere")


def test_lora_flags_become_lora_modules_and_engine_args(folder: Path, tmp_path: Path) -> None:
    s = spec(str(folder), "--enable-lora", "--max-loras", "4", "--max-lora-rank", "32",
             "--lora-modules", f"sql={tmp_path}/sql",
             '{"name": "chat", "path": "/a/chat", "base_model_name": "my-model"}')
    assert s.engine_args.given() == {"enable_lora": True, "max_loras": 4, "max_lora_rank": 32}
    assert [(m.name, m.path, m.base_model_name) for m in s.lora_modules] == [
        ("sql", str(tmp_path / "sql"), None), ("chat", "/a/chat", "my-model")]
    with pytest.raises(ValueError, match="lora_modules need engine_args.enable_lora"):
        spec(str(folder), "--lora-modules", "sql=/a/sql")
    with pytest.raises(InvalidRequest, match="name=path"):
        spec(str(folder), "--enable-lora", "--lora-modules", "sql")
    with pytest.raises(ValueError, match="max_cpu_loras"):
        spec(str(folder), "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2")


def test_unsupported_vllm_flags_are_refused_by_name(folder: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(folder), "--swap-space", "4", "--fully-sharded-loras"]) == 1
    err = capsys.readouterr().err
    assert "does not support --fully-sharded-loras, --swap-space" in err
    with pytest.raises(SystemExit):  # other commands keep argparse's own refusal
        main(["workers", "list", "--quantization", "awq"])


def test_enable_auto_tool_choice_is_taken_with_a_parser_as_vllm_takes_it(
        folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 24: vLLM command lines carry --enable-auto-tool-choice beside --tool-call-parser
    (refused by name before); alone it is vLLM's startup error, before anything starts."""
    s = spec(str(folder), "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert s.engine_args.given() == {"tool_call_parser": "hermes"}
    with pytest.raises(InvalidRequest, match="--enable-auto-tool-choice requires "
                                             "--tool-call-parser"):
        spec(str(folder), "--enable-auto-tool-choice")
    assert main(["serve", str(folder), "--enable-auto-tool-choice"]) == 1
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err


def test_several_served_model_names_make_aliases(folder: Path) -> None:
    """vLLM's `--served-model-name a b`: the model answers to both, under a."""
    s = spec(str(folder), "--served-model-name", "smol", "smol-latest", "gpt-4o",
             "--max-model-len", "512")
    assert (s.name, s.aliases, s.max_model_len) == ("smol", ["smol-latest", "gpt-4o"], 512)
    assert spec(str(folder), "--served-model-name", "smol").aliases == []
    with pytest.raises(ValueError, match="each alias once"):
        spec(str(folder), "--served-model-name", "a", "b", "b")


@pytest.mark.parametrize("argv", [
    ["serve", "m", "--data-dir", "D"], ["--data-dir", "D", "serve", "m"],
    ["up", "--data-dir", "D"], ["--data-dir", "D", "up"]])
def test_data_dir_is_taken_after_the_command_too(argv: list[str]) -> None:
    """`shoal serve MODEL --data-dir DIR` (where vLLM users put flags) was refused as a vLLM
    flag shoal serve does not take."""
    args, extra = build_parser().parse_known_args(argv)
    assert extra == [] and args.data_dir == Path("D")
    args, extra = build_parser().parse_known_args([a for a in argv if a not in ("--data-dir", "D")])
    assert extra == [] and args.data_dir is None


def test_version() -> None:
    out = subprocess.run([sys.executable, "-m", "shoal", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == f"shoal {VERSION}"


def test_progress_travels_in_the_state_message_and_draws_a_bar() -> None:
    assert parse_progress(progress_message("downloading 12 of 270 MB", 0.044)) == \
        ("downloading 12 of 270 MB", 0.04)
    assert parse_progress("loading weights") is None and parse_progress(None) is None
    lines: list[str] = []
    view = ProgressView(lines.append, tty=True)

    def inst(state: InstanceState, message: str | None) -> InstancePublic:
        now = "2026-01-01T00:00:00Z"
        return InstancePublic(id="i", name="smol-1", model_id="m", model_name="smol", state=state,
                              state_message=message, created_at=now, updated_at=now,
                              state_changed_at=now, version=1)

    view.show(inst(InstanceState.SCHEDULED, None))
    view.show(inst(InstanceState.DOWNLOADING, progress_message("dequantising gguf tensors", 0.3)))
    assert view.bar is not None and view.bar.n == 30
    view.show(inst(InstanceState.DOWNLOADING, progress_message("dequantising gguf tensors", 0.7)))
    assert view.bar.n == 70
    view.show(inst(InstanceState.STARTING, "loading weights"))
    assert view.bar is None
    assert lines == ["shoal: smol-1 SCHEDULED", "shoal: smol-1 STARTING: loading weights"]

    # Not a terminal (a log file): one plain line per stage and tenth, never a bar's redraws.
    lines.clear()
    plain = ProgressView(lines.append, tty=False)
    for fraction in (0.0, 0.0, 0.04, 0.31, 0.35):
        plain.show(inst(InstanceState.DOWNLOADING, progress_message("dequantising gguf tensors",
                                                                    fraction)))
    plain.show(inst(InstanceState.DOWNLOADING, progress_message("writing safetensors", 0.8)))
    plain.show(inst(InstanceState.STARTING, "loading weights"))
    assert plain.bar is None
    assert lines == ["shoal: smol-1 DOWNLOADING: 0% dequantising gguf tensors",
                     "shoal: smol-1 DOWNLOADING: 30% dequantising gguf tensors",
                     "shoal: smol-1 DOWNLOADING: 80% writing safetensors",
                     "shoal: smol-1 STARTING: loading weights"]
