"""README.md's commands as a test: every fenced block of the README runs, in the README's order,
against one live `shoal up` stack (its own data dir, gateway port and namespace, SmolLM2 served
as `make up` serves it), or is listed in ENTRIES with the reason it does not run. A block that is
neither fails test_every_readme_block_is_run_or_listed, so a block cannot be added untested.

How a block runs (as a reader pastes it into one terminal, or one Python session):
- a bash block: `bash -e -o pipefail` in the repository (the README's `.venv/bin/...` paths), with
  SHOAL_DATA_DIR the stack's (the README: "give the CLI the same one"); under `set -a`, so what a
  block sets (SMOL, MINILM) reaches the blocks after it; `curl` fails on an HTTP error
  (`--fail-with-body`), so a 4xx cannot pass for an answer;
- a python block: in one interpreter and one namespace, in order;
- the README's address 127.0.0.1:8000 is the stack's port (the one substitution every block gets);
  a placeholder (`/path/to/model.gguf`) gets a real value, listed in the block's entry.

Where the README shows what a block prints (readme_blocks.shown_output), the output must match it
(`...` and `<x>` stand for anything; what varies by machine, such as the host name `myhost`, is
listed in the entry's `vary`). Between blocks the test may delete what a block deployed (`after`,
the test's own housekeeping, not the README's) to keep the machine's memory bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from shoal.services.engine import minilm_path, smollm2_gguf_path
from shoal.shared.embedded import free_port
from tests.e2e.readme_blocks import (
    Block, printed_differently, readme_blocks, shown_output, unaccounted, unmatched
)
from tests.e2e.test_serve_cli import populate_hf_cache

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
UP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Run:
    """A block that runs. `subs`: README text -> what runs instead ({name} filled from the
    stack: port, smol, minilm, hostname, data_dir), with `why` saying why."""

    marker: str
    why: str = ""
    subs: tuple[tuple[str, str], ...] = ()
    vary: tuple[tuple[str, str], ...] = ()
    """Shown output -> what stands for it here (`<x>` for anything) where it varies by machine."""
    rc: int = 0
    after: str = ""
    """The test's housekeeping (bash) once the block passed or failed; not the README's."""
    check: Callable[[str, Stack], None] | None = None
    """Further checks of the output, where the README says what it shows in words."""
    capture: Callable[[str], dict[str, str]] | None = None
    """Variables for the blocks after this one, from its output (what a reader copies)."""
    timeout_s: float = 180.0


@dataclass(frozen=True)
class Shown:
    """A plain block showing what a command prints; checked against that output."""

    marker: str
    of: str
    vary: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Skip:
    marker: str
    why: str


Entry = Run | Shown | Skip


@dataclass
class Stack:
    port: int
    data_dir: Path
    env: dict[str, str]
    """The blocks' environment; bash blocks add what they set."""
    up_output: Path
    values: dict[str, str]
    work: Path
    groups: list[int] = field(default_factory=list)
    """Process groups of the bash blocks: background jobs (`&`) are ended at teardown."""
    python: PythonSession | None = None

    def bash(self, script: str, timeout_s: float) -> tuple[int, str]:
        """Run `script` as a README block runs; (exit status, stdout and stderr together)."""
        n = len(self.groups)
        out, env_file = self.work / f"block-{n}.out", self.work / f"block-{n}.env"
        prelude = ("set -a\n"
                   'curl() { command curl --fail-with-body -sS "$@"; }\n')
        trailer = f"\nenv -0 > {env_file}\n"
        with out.open("w") as sink:
            proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c",
                                     prelude + script + trailer],
                                    cwd=ROOT, env=self.env, stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            self.groups.append(proc.pid)
            try:
                rc = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = -1
        if env_file.exists():
            pairs = env_file.read_bytes().split(b"\0")
            self.env = dict(p.decode().partition("=")[::2] for p in pairs if b"=" in p)
        return rc, out.read_text(errors="replace")

    def fill(self, text: str) -> str:
        """README text as it runs on this stack."""
        return text.replace("127.0.0.1:8000", f"127.0.0.1:{self.port}")


class PythonSession:
    """One interpreter running the README's python blocks in one namespace, in order. A block's
    stdout is its output (what its prints print); the interpreter's stderr (engine logs,
    progress bars) goes to a file."""

    DRIVER = (
        "import contextlib, io, json, sys, traceback\n"
        "ns = {'__name__': '__main__'}\n"
        "for line in sys.stdin:\n"
        "    out, rc = io.StringIO(), 0\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out):\n"
        "            exec(compile(json.loads(line), '<README block>', 'exec'), ns)\n"
        "    except BaseException:\n"
        "        out.write(traceback.format_exc())\n"
        "        rc = 1\n"
        "    sys.stderr.flush()\n"
        "    print(json.dumps({'rc': rc, 'out': out.getvalue()}), flush=True)\n")

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("w") as sink:
            self.proc = subprocess.Popen([sys.executable, "-u", "-c", self.DRIVER], cwd=ROOT,
                                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=sink, text=True)
        self.replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.replies.put(line)
        self.replies.put(None)

    def run(self, code: str, timeout_s: float) -> tuple[int, str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(code) + "\n")
        self.proc.stdin.flush()
        try:
            reply = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            reply, why = None, f"no end after {timeout_s:.0f} s"
        else:
            why = "the interpreter exited"
        if reply is None:
            return -1, f"({why}; its stderr ends:)\n{self.log.read_text()[-4000:]}"
        done = json.loads(reply)
        return done["rc"], done["out"]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _key_values(output: str) -> dict[str, str]:
    """ADMIN and ID, which the README's management API block uses: the secret `keys create
    ops` printed, and my-app's id from `keys list`."""
    secret = re.search(r"API key ops \(\w+, admin\) created.*?\n\s*\n\s*(\S+)", output, re.S)
    row = re.search(r"^my-app\s+(\w+)\s", output, re.M)
    assert secret and row, output
    return {"ADMIN": secret.group(1), "ID": row.group(1)}


def _on_both_workers(output: str, stack: Stack) -> None:
    """`instances list` shows the smol-pp2 instance on both workers."""
    rows = [line for line in output.splitlines() if line.startswith("smol-pp2-")]
    assert len(rows) == 1, output
    host = stack.values["hostname"]  # either may lead: spread starts with the emptiest
    assert f" {host}, second " in rows[0] or f" second, {host} " in rows[0], rows[0]


SMOL_SUB = "{smol}"
ENTRIES: list[Entry] = [
    Skip("make up      # creates .venv",
         "`make up` runs `shoal up` in the foreground: this test's stack is that `shoal up`; "
         "`make test` is this suite"),
    Shown("shoal: embedded NATS at", of="up",
          vary=(("4222", "<port>"), ("d3f0c9a1b2e", "<ns>"), ("3.9s", "<t>s"))),
    Run(".venv/bin/shoal workers list                 # devices",
        why="a model folder or .gguf of the reader's own: SmolLM2's; the hub id comes from the "
            "stack's Hugging Face cache (HF_HUB_CACHE, HF_HUB_OFFLINE=1: no network here)",
        subs=(("/path/to/model-folder-or.gguf", SMOL_SUB),),
        after=".venv/bin/shoal models delete smol2"),
    Run("SMOL=$(.venv/bin/python -c"),
    Run("curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        "  -d '{\"model\": \"SmolLM2-135M-Instruct\", \"messages\""),
    Skip(".venv/bin/shoal serve HuggingFaceTB/SmolLM2-135M-Instruct --max-model-len 2048",
         "`shoal serve` starts a second stack in the foreground (tests/e2e/test_serve_cli.py "
         "serves a hub id from the cache this way)"),
    Run("print(out.choices[0].message.content, out.usage)"),
    Run('"messages": [{"role": "user", "content": "Invent a person, as JSON."}],\n'
        '  "response_format"'),
    Run('"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}\''),
    Run("out = client.chat.completions.parse("),
    Skip(".venv/bin/shoal serve Qwen/Qwen3-0.6B --reasoning-parser qwen3",
         "a Qwen3 model is a 1.5 GB download (no network here); "
         "tests/e2e/test_structured_serving.py splits SmolLM2's real answer with deepseek_r1 "
         "through a deployment made the same way, and the parsers' fixtures hold Qwen3's output"),
    Skip("print(out.choices[0].message.reasoning_content)",
         "asks the Qwen3 deployment above (not served here)"),
    Run("curl http://127.0.0.1:8000/v1/messages -H"),
    Run("claude = anthropic.Anthropic("),
    Run("RESP=$(curl -s http://127.0.0.1:8000/v1/responses"),
    Run("first = client.responses.create("),
    Run(".venv/bin/shoal keys create ops --scope admin", capture=_key_values),
    Run('curl -H "Authorization: Bearer $ADMIN"'),
    Run("MINILM=$(.venv/bin/python -c"),
    Run("client.embeddings.create("),
    Skip(".venv/bin/shoal models deploy qwen3-emb --source Qwen/Qwen3-Embedding-0.6B",
         "a Hub download (no network here); tests/e2e/test_embeddings_serving.py::"
         "test_decoder_embedder_matches_sentence_transformers deploys a tiny Qwen3 saved as "
         "Qwen3-Embedding is, against sentence-transformers; task and override_pooler_config: "
         "tests/unit/engine/test_decoder_embeddings.py"),
    Run("engine = EmbeddingEngine("),
    Skip(".venv/bin/shoal models deploy reranker --source cross-encoder/ms-marco-MiniLM-L6-v2",
         "a Hub download (no network here); tests/e2e/test_embeddings_serving.py::"
         "test_rerank_and_score_match_cross_encoder sends these requests to a tiny cross-encoder "
         "deployed the same way, against sentence-transformers' CrossEncoder"),
    Run("curl -s http://127.0.0.1:8000/metrics/targets"),
    Run("outs = llm.chat("),
    Run('"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2})'),
    Run(".venv/bin/shoal serve path/to/model.gguf \\\n    --speculative-config",
        why="`shoal serve` starts a second stack in the foreground (test_serve_cli.py); the "
            "deploy gets SmolLM2 for the reader's model",
        subs=((".venv/bin/shoal serve path/to/model.gguf \\\n"
               "    --speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
               "\"prompt_lookup_max\": 4}'", ": shoal serve skipped"),
              ("/path/to/model.gguf", SMOL_SUB)),
        after=".venv/bin/shoal models delete smol-spec"),
    Run('lora_request=[LoRARequest("smol-lora", 1, "/tmp/smol-lora"), None])'),
    Skip(".venv/bin/shoal serve path/to/smollm2 --enable-lora",
         "`shoal serve` starts a second stack (test_serve_cli.py); the deploy, the request by "
         "adapter name, runtime load and unload are tests/e2e/test_lora_serving.py's, through "
         "the gateway with the openai SDK (a tiny model: a second SmolLM2 costs a minute here)"),
    Skip("curl http://127.0.0.1:8000/v1/load_lora_adapter",
         "needs the deploy above (skipped): tests/e2e/test_lora_serving.py loads and unloads "
         "with these bodies and checks these answers"),
    Skip("with LLM(smollm2, tensor_parallel_size=3",
         "starts 3 rank processes, then 2 (a minute of two cores); "
         "tests/e2e/test_parallel_serving.py and the engine's parallel tests run the same"),
    Run("SMOL_HF=$(.venv/bin/python -c 'from shoal.services.engine import prepare_model",
        why="the dry run writes nothing; the second deploy is refused (exit status 2)", rc=2),
    Skip('.venv/bin/shoal models deploy smol-custom --source "$SMOL_HF"',
         "a second whole stack as the backend (a minute on two cores): "
         "tests/e2e/test_backend_custom.py deploys the same command"),
    Run(".venv/bin/shoal models deploy llama --source /models/llama-3-8b --dry-run",
        why="a path of the reader's: SmolLM2's", subs=(("/models/llama-3-8b", SMOL_SUB),)),
    Skip(".venv/bin/shoal models deploy smol-pp --source",
         "the same deploy (SmolLM2, CPU, pp=2 on one worker) is "
         "tests/e2e/test_parallel_serving.py's; half a minute more here"),
    Run(".venv/bin/shoal up &",
        why="this test's stack is the `shoal up`",
        subs=((".venv/bin/shoal up &", ": the stack is up"),),
        check=_on_both_workers,
        after=".venv/bin/shoal models delete smol-pp2"),
    Run('curl -X POST http://127.0.0.1:8000/api/v1/models -H \'Content-Type: application/json\' '
        "-d '{\n  \"name\": \"minilm"),
    Run(".venv/bin/shoal models deploy smol --source /path/to/model.gguf \\\n"
        "    --engine-arg max_num_seqs=64",
        why="the reader's model: SmolLM2; the second deploy is refused (exit status 2)",
        subs=(("/path/to/model.gguf", SMOL_SUB),), rc=2,
        after=".venv/bin/shoal models delete smol"),
    Skip("llm = LLM(model=str(smollm2_gguf_path()), num_threads=2)",
         "loads SmolLM2 again (25 s); tests/unit/engine/test_quantized_smollm2.py checks "
         "the same `runner.settings` line (a .gguf's own blocks by default)"),
    Skip("export SHOAL_NATS_URL=nats://127.0.0.1:4222",
         "each service in the foreground against servers of the reader's: what `shoal up` "
         "does for this test's stack"),
    Skip("infra/compose-secrets.sh && docker compose up -d --build",
         "Docker: `make compose-test` runs these steps (tests/compose)"),
    Skip("make up   # in another terminal (data in ~/.shoal)", "the soak runs for an hour"),
    Skip("make bench                                   # offline engine",
         "benchmarks take minutes each"),
    Skip("make peer-vllm", "builds vLLM's CPU venv; benchmarks take minutes"),
    Skip("make peer-llamacpp", "builds llama.cpp (10 minutes); benchmarks take minutes"),
    Skip(".venv/bin/python -m loadtests.served_offline",
         "a benchmark: a 1B model served and offline, minutes (docs/figures.md)"),
    Skip("shoal/       the `shoal` command", "the repository's layout, not a command"),
]


def _blocks() -> list[Block]:
    return readme_blocks(README.read_text())


def _entry_of(block: Block) -> list[Entry]:
    return [e for e in ENTRIES if e.marker in block.text]


def test_every_readme_block_is_run_or_listed() -> None:
    """Each block matches exactly one entry and each entry one block, in the README's order."""
    problems = unaccounted(_blocks(), [e.marker for e in ENTRIES])
    assert not problems, "\n\n".join(problems)


def _runs() -> list[tuple[Block, Run | Shown]]:
    pairs = []
    for block in _blocks():
        found = _entry_of(block)
        if len(found) == 1 and isinstance(found[0], Run | Shown):
            pairs.append((block, found[0]))
    return pairs


def _wait_up(up: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if "shoal: press Ctrl-C to stop everything" in text:
            return
        if up.poll() is not None:
            break
        time.sleep(0.5)
    servers = "".join(f"\n{p.name}:\n{p.read_text(errors='replace')[-3000:]}"
                      for p in sorted(log.parent.glob("stack/*.log")))
    pytest.fail(f"`shoal up` was not ready:\n{log.read_text()[-6000:]}{servers}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    assert (ROOT / ".venv" / "bin" / "shoal").exists(), \
        "the README's commands use .venv/bin/ (`make install` creates it)"
    work = tmp_path_factory.mktemp("readme")
    populate_hf_cache(work / "hf")
    port = free_port()
    data_dir = work / "stack"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "HF_"))}
    env.update(SHOAL_DATA_DIR=str(data_dir), SHOAL_GATEWAY_PORT=str(port),
               HF_HUB_CACHE=str(work / "hf"), HF_HUB_OFFLINE="1")
    log = work / "up.log"
    with log.open("w") as sink:
        up = subprocess.Popen([str(ROOT / ".venv" / "bin" / "shoal"), "up"], cwd=ROOT, env=env,
                              stdout=sink, stderr=subprocess.STDOUT)
    values = {"port": str(port), "smol": str(smollm2_gguf_path()), "minilm": str(minilm_path()),
              "hostname": socket.gethostname(), "data_dir": str(data_dir)}
    running = Stack(port, data_dir, env, log, values, work)
    try:
        _wait_up(up, log)
        yield running
    finally:
        if running.python is not None:
            running.python.close()
        for group in running.groups:  # a block's background jobs: the second worker agent
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGTERM)
        up.send_signal(signal.SIGINT)
        try:
            up.wait(90)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
        _end_leftovers(data_dir)


def _end_leftovers(data_dir: Path) -> None:
    """Whatever the stack or a block started and is still running after 30 s (engines and
    ranks carry the stack's SHOAL_DATA_DIR in their environment): SIGKILL, so no test after
    this module shares the machine with it."""
    def ours() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.environ().get("SHOAL_DATA_DIR") == str(data_dir):
                    found.append(proc)
        return found

    deadline = time.monotonic() + 30
    while (left := ours()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()


@pytest.mark.parametrize(("block", "entry"), _runs(), ids=[b.label for b, _ in _runs()])
def test_readme_block(block: Block, entry: Run | Shown, stack: Stack) -> None:
    vary = {"myhost": stack.values["hostname"], "/root/.shoal": str(stack.data_dir),
            "127.0.0.1:8000": f"127.0.0.1:{stack.port}"}
    if isinstance(entry, Shown):
        vary.update(entry.vary)
        output = stack.up_output.read_text(errors="replace")
        lines = block.text.splitlines()
        missing = unmatched(lines, output, vary, one_line=True)
        assert missing is None, f"`shoal {entry.of}` never printed {missing!r}:\n{output}"
        warned = re.findall(r"^.*\w+Warning: .*$", output, re.M)
        assert not warned, f"`shoal {entry.of}` printed a warning the README does not: {warned}"
        return
    vary.update(entry.vary)
    code = stack.fill(block.text)
    for shown, real in entry.subs:
        assert shown in code, f"{shown!r} is no longer in the block"
        code = code.replace(shown, real.format(**stack.values))
    try:
        if block.lang == "python":
            if stack.python is None:
                stack.python = PythonSession(stack.env, stack.work / "python.err")
            rc, output = stack.python.run(code, entry.timeout_s)
            if rc == -1:  # it hangs or died: the blocks after this one start afresh
                stack.python.close()
                stack.python = None
        else:
            rc, output = stack.bash(code, entry.timeout_s)
        assert rc == entry.rc, f"exit status {rc} (expected {entry.rc}):\n{output}"
        if block.lang == "python":
            wrong = printed_differently(shown_output(block), output, vary)
            assert wrong is None, f"{wrong}; it printed:\n{output}"
        else:
            missing = unmatched(shown_output(block), output, vary)
            assert missing is None, f"the README shows {missing!r}; the block printed:\n{output}"
        if entry.check is not None:
            entry.check(output, stack)
        if entry.capture is not None:
            stack.env.update(entry.capture(output))
    finally:
        if entry.after:
            stack.bash(entry.after, 60)
