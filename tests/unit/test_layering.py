"""The layering rules of docs/architecture.md ("Layers"), checked on the source:

- domain logic (the engine core, kernels, scheduler policy and claims, the gateway's pure modules,
  the state machine) imports no nats, aiohttp, sqlalchemy or asyncpg;
- the engine imports no other service; other services and the CLI reach it only through the names
  `shoal.services.engine` exports (its public API);
- only `shoal` is installed at the top level;
- a `Sequence` is written only by the scheduler and the block manager (others read it, or ask the
  scheduler through a method), so one step's state changes read in one place.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "services" / "engine"
NETWORK = {"nats", "aiohttp", "sqlalchemy", "asyncpg"}
PURE = ["kernels", "services/scheduler/policies", "services/scheduler/claim",
        "services/scheduler/planner.py", "shared/units.py", "shared/states.py", "shared/errors.py",
        "services/worker/devices.py"] + [
    f"services/gateway/{name}" for name in (
        "openai/body.py", "routing/router.py", "openai/protocol.py", "openai/responses.py",
        "openai/streaming.py", "auth/admission.py", "openai/structured.py", "openai/tools.py",
        "openai/tool_parsers.py", "openai/embeddings.py", "auth/ratelimit.py", "json_body.py",
        "auth/edge_rules.py")]


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
