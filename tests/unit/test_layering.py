"""The layering rules of docs/architecture.md ("Layers"), checked on the source:

- domain logic (the engine core, kernels, scheduler policy and claims, the gateway's pure modules,
  the state machine) imports no nats, aiohttp, sqlalchemy or asyncpg;
- the engine imports no other service; other services and the CLI reach it only through the names
  `shoal.services.engine` exports (its public API);
- only `shoal` is installed at the top level;
- a `Sequence` is written only by the scheduler and the block manager (others read it, or ask the
  scheduler through a method), so one step's state changes read in one place;
- the engine's folders by role (docs/engine-core.md "Layout"): core/ imports no torch (nor
  anything that loads it) and no runner, front end or server; the model side (runner/, models/,
  layers/, distributed/, spec_decode/, embedding/, structured_output/) reaches the core only
  through its contract (core/outputs.py) and imports no front end or server; frontend/ imports
  no server; the shared top-level modules import no folder of the engine;
- no engine module reads the environment but EngineConfig (docs/architecture.md "Config
  objects");
- request input has one owner: only input_processor.py tokenizes text or renders a chat
  template (the LLM, the NATS adapters and the embedding engine ask it);
- rules two processes must agree on live once: the tensor-parallel divisibility rule in
  model_limits.py (the scheduler imports it), a rank's command line in distributed/launch.py
  (the engine's executor and the worker's stages both build a RankLaunch).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "services" / "engine"
NETWORK = {"nats", "aiohttp", "sqlalchemy", "asyncpg"}
PURE = ["kernels", "services/scheduler/policies", "services/scheduler/claim",
        "services/scheduler/planner.py", "shared/units.py", "shared/states.py", "shared/errors.py",
        "services/worker/devices.py", "services/backends/args.py", "services/gateway/parsers",
        "shared/schemas/backends.py"] + [
    f"services/gateway/{name}" for name in (
        "openai/body.py", "routing/router.py", "openai/protocol.py", "openai/responses.py",
        "openai/streaming.py", "auth/admission.py", "openai/structured.py", "openai/tools.py",
        "openai/tool_parsers.py", "openai/embeddings.py", "auth/ratelimit.py", "json_body.py",
        "auth/edge_rules.py", "openai/objects.py", "openai/builders.py",
        "auth/reservation.py", "anthropic/protocol.py", "anthropic/objects.py",
        "anthropic/answer.py", "responses_api/protocol.py", "responses_api/answer.py",
        "responses_api/objects.py")]


def python_files(entry: str | Path) -> list[Path]:
    path = ROOT / entry
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


def imports_of(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every absolute import in the file."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def engine_core_files() -> list[Path]:
    return [f for f in python_files(ENGINE) if "server" not in f.relative_to(ENGINE).parts]


@pytest.mark.parametrize("entry", PURE + ["services/engine (all but server/)"])
def test_domain_code_has_no_network_imports(entry: str) -> None:
    files = engine_core_files() if entry.startswith("services/engine") else python_files(entry)
    assert files, f"{entry} has no Python files"
    roots = {str(f.relative_to(ROOT)): {m.split(".")[0] for m, _ in imports_of(f)} for f in files}
    offenders = {f: sorted(r & NETWORK) for f, r in roots.items()}
    assert not {f: bad for f, bad in offenders.items() if bad}


def test_the_engine_imports_no_other_service() -> None:
    offenders = [f"{f.relative_to(ROOT)}: {module}" for f in python_files(ENGINE)
                 for module, _ in imports_of(f)
                 if module.startswith("shoal.services.")
                 and not module.startswith("shoal.services.engine")]
    assert not offenders


def test_services_use_the_engine_through_its_public_api() -> None:
    import shoal.services.engine as engine

    public = set(engine.__all__)
    users = [f for entry in ("services", "shoal") for f in python_files(entry)
             if ENGINE not in f.parents]
    offenders = []
    for path in users:
        for module, names in imports_of(path):
            if not module.startswith("shoal.services.engine"):
                continue
            if module != "shoal.services.engine" or not set(names) <= public:
                offenders.append(f"{path.relative_to(ROOT)}: {module} {names}")
    assert not offenders, offenders
    for name in public:  # and every public name resolves
        assert getattr(engine, name) is not None


def test_no_top_level_shared_services_kernels_package_is_installed() -> None:
    """Only `shoal` is importable from the install (the HF `kernels` package must stay free)."""
    probe = (
        "import importlib.util, json; "
        "print(json.dumps({n: getattr(importlib.util.find_spec(n), 'origin', None) "
        "for n in ('shared', 'services', 'kernels')}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True, text=True,
                         check=True)
    origins = json.loads(out.stdout)
    assert all(origin is None or str(ROOT) not in origin for origin in origins.values()), origins
    import shoal.kernels
    import shoal.services
    import shoal.shared

    assert Path(shoal.shared.__file__).parent == ROOT / "shared"
    assert Path(shoal.kernels.__file__).parent == ROOT / "kernels"


SEQUENCE_WRITERS = {"services/engine/core/scheduler.py", "services/engine/core/step_update.py",
                    "services/engine/core/block_manager.py", "services/engine/core/sequence.py"}
"""The only modules that change a Sequence: the scheduler (step_update.py is its update from the
runner's output), the block manager, and sequence.py's own `append_token`."""
MUTATORS = {"append", "extend", "clear", "pop", "insert", "remove", "sort", "reverse",
            "append_token"}


def sequence_writes(path: Path) -> list[str]:
    """Assignments, deletions and in-place changes of a Sequence field on anything but `self`
    (`seq.status = ...`, `del seq.token_ids[i:]`, `seq.block_ids.append(...)`)."""
    from shoal.services.engine.core.sequence import Sequence

    fields = set(Sequence.__dataclass_fields__)

    def field_of(node: ast.AST) -> str | None:
        while isinstance(node, ast.Subscript):
            node = node.value
        if (isinstance(node, ast.Attribute) and node.attr in fields
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
            return node.attr
        return None

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in MUTATORS):
            owner = node.func.value
            name = ("append_token" if node.func.attr == "append_token"
                    and not (isinstance(owner, ast.Name) and owner.id == "self")
                    else field_of(owner))
            if name is not None:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
        for target in targets:
            for part in (target.elts if isinstance(target, ast.Tuple) else [target]):
                name = field_of(part)
                if name is not None:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    return found


def test_only_the_scheduler_and_block_manager_write_sequences() -> None:
    """The engine's other modules that hold sequences (request state, engine core, grammar gate,
    front ends, server) read them or ask the scheduler; the runner never sees one (outputs.py:
    its SeqState has fields of the same names, so it is not scanned)."""
    holders = [f for f in python_files(ENGINE)
               if f.relative_to(ENGINE).parts[0] in ("frontend", "server")
               or any(m == "shoal.services.engine.core.sequence" for m, _ in imports_of(f))]
    assert ENGINE / "core" / "engine_core.py" in holders
    writers = [w for f in holders if str(f.relative_to(ROOT)) not in SEQUENCE_WRITERS
               for w in sequence_writes(f)]
    assert not writers, writers
    assert sequence_writes(ENGINE / "core" / "scheduler.py")  # the check sees writes at all


E = "shoal.services.engine"
BASE = {f"{E}.{name}" for name in ("config", "sampling_params", "model_limits", "model_prep",
                                   "gguf_config", "gguf_folder", "input_processor",
                                   "lora_request")}
"""The top-level modules every part shares."""
MODEL_SIDE = ("runner", "models", "layers", "distributed", "spec_decode", "embedding",
              "structured_output")
HEAVY = {"torch", "triton", "transformers", "xgrammar", "safetensors", "gguf", "nats"}
"""What the core never imports: torch, and the libraries that load it."""


def engine_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, at module level) of every import of an engine module in the file; relative
    imports resolved. At module level: outside functions and `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(["shoal", *path.relative_to(ROOT).with_suffix("").parts[:-1]])
    lazy: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
            lazy |= {id(n) for n in ast.walk(node) if n is not node}
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [base]
        found += [(name, node.lineno, id(node) not in lazy) for name in names]
    return found


def folder_of(path: Path) -> str:
    """The engine folder a file belongs to ("" for the top-level modules)."""
    parts = path.relative_to(ENGINE).parts
    return parts[0] if len(parts) > 1 else ""


def engine_files(*folders: str) -> list[Path]:
    files = [f for f in python_files(ENGINE) if folder_of(f) in folders]
    assert files, folders
    return files


def test_the_core_imports_no_torch_and_no_other_part() -> None:
    """core/ is torch-free scheduling and KV bookkeeping: it imports the core, the shared
    top-level modules, and (lazily, at the first constrained request) the grammar compiler."""
    offenders = []
    for path in engine_files("core"):
        for module, line, top in engine_imports(path):
            where = f"{path.relative_to(ROOT)}:{line} {module}"
            if module.split(".")[0] in HEAVY:
                offenders.append(where)
            elif module == f"{E}.structured_output.compiler":
                if top:
                    offenders.append(where + " (only lazily: it loads xgrammar and torch)")
            elif module.startswith(E) and not (module.startswith(f"{E}.core") or module in BASE):
                offenders.append(where)
    assert not offenders, offenders


def test_importing_the_core_loads_no_torch() -> None:
    modules = [".".join(["shoal", *f.relative_to(ROOT).with_suffix("").parts])
               for f in engine_files("core")]
    probe = ("import importlib, sys\n"
             f"for m in {modules!r}: importlib.import_module(m)\n"
             f"print(sorted(m for m in {sorted(HEAVY)!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_folders_import_in_one_direction() -> None:
    """The model side knows the core only by its contract (core/outputs.py: it never sees a
    Sequence); nothing but the server imports the server, and only the front ends and the
    server import the front ends."""
    offenders = []
    rules: list[tuple[tuple[str, ...], Callable[[str], bool]]] = [
        (MODEL_SIDE, lambda m: (m.startswith(f"{E}.core") and m != f"{E}.core.outputs")
         or m.startswith((f"{E}.frontend", f"{E}.server"))),
        (("frontend",), lambda m: m.startswith(f"{E}.server")),
        (("",), lambda m: m.startswith(E) and m not in BASE and m != E),
    ]
    for folders, forbidden in rules:
        for path in engine_files(*folders):
            if path.name == "__init__.py" and folder_of(path) == "":
                continue  # the package's public names resolve lazily into every part
            offenders += [f"{path.relative_to(ROOT)}:{line} {module}"
                          for module, line, _ in engine_imports(path) if forbidden(module)]
    assert not offenders, offenders


ENVIRONMENT_READERS = {"services/engine/config.py", "services/engine/distributed/executor.py"}
"""EngineConfig (OMP_NUM_THREADS, when num_threads is not given), and the executor, which hands
its own environment on to the ranks it spawns."""


def test_no_engine_module_below_the_entry_point_reads_the_environment() -> None:
    offenders = []
    for path in python_files(ENGINE):
        if str(path.relative_to(ROOT)) in ENVIRONMENT_READERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "os" and node.attr in ("environ", "getenv", "environb")):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} os.{node.attr}")
    assert not offenders, offenders


INPUT_OWNER = ENGINE / "input_processor.py"
TOKENIZING = {"encode", "apply_chat_template", "batch_encode_plus", "encode_plus"}


def tokenizer_calls(path: Path) -> list[str]:
    """Calls that turn text into token ids: `<...tokenizer>.encode(...)`,
    `.apply_chat_template(...)`, or a tokenizer called itself (`self.tokenizer(texts)`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = ast.unparse(func)
        if ((isinstance(func, ast.Attribute) and func.attr in TOKENIZING
             and "tokenizer" in ast.unparse(func.value).lower())
                or (isinstance(func, ast.Attribute) and func.attr == "tokenizer")
                or (isinstance(func, ast.Name) and func.id == "tokenizer")):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {called}")
    return found


def test_only_the_input_processor_tokenizes_requests() -> None:
    """The front ends (LLM, AsyncEngine), the NATS adapters and the embedding engine turn a
    request's text into token ids through the InputProcessor, so the prompt policy (chat
    templates, special tokens, the size bound, truncation) reads in one place."""
    users = [f for f in python_files(ENGINE)
             if folder_of(f) in ("frontend", "server", "embedding", "core")]
    offenders = [c for f in users for c in tokenizer_calls(f)]
    assert not offenders, offenders
    assert tokenizer_calls(INPUT_OWNER)  # the check sees tokenizer calls at all


def test_rules_two_processes_share_are_written_once() -> None:
    """What tp must divide (a `%` on heads, the MLP size or tp) is model_limits.py's alone, and
    the rank's command-line flags appear only where RankLaunch writes and parses them."""
    owners = {"tp": ROOT / "services/engine/model_limits.py",
              "argv": ROOT / "services/engine/distributed/launch.py"}
    found: dict[str, list[str]] = {"tp": [], "argv": []}
    for path in [f for entry in ("services", "shared", "shoal") for f in python_files(entry)]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
                operands = [ast.unparse(node.left).lower(), ast.unparse(node.right).lower()]
                if any("head" in o or "intermediate" in o for o in operands) or "tp" in operands:
                    found["tp"].append(where)
            elif isinstance(node, ast.Constant) and node.value in ("--init-method", "--cores"):
                found["argv"].append(where)
    for rule, places in found.items():
        assert places, rule  # the check sees the owner's own
        assert {p.split(":")[0] for p in places} == {str(owners[rule].relative_to(ROOT))}, places
