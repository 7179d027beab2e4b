"""Follow a model's instance until it is RUNNING, on the terminal: a line per state, and a tqdm
bar while the engine prepares its model (download, conversion), fed by the progress the engine
writes into the instance's state message (shared/progress.py). When the console is not a terminal
(a log file, CI), a bar's redraws would pile up as one endless line: then a plain line is written
for each stage and each tenth of the way instead.

Used by `shoal up` / `shoal serve` and `shoal models deploy --wait`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.errors import Timeout, Unavailable
from shoal.shared.progress import parse_progress
from shoal.shared.schemas.registry import InstanceFilter, InstancePublic
from shoal.shared.states import InstanceState

POLL_S = 0.5


class ProgressView:
    """Draws what successive snapshots of one instance say; `show` is called with each."""

    def __init__(self, out: Callable[[str], None] = lambda line: print(line, flush=True),
                 tty: bool | None = None) -> None:
        self.out = out
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.last_line = ""
        self.bar: Any = None

    def show(self, inst: InstancePublic) -> None:
        progress = parse_progress(inst.state_message)
        if progress is not None:
            self._draw(inst, *progress)
            return
        self.close()
        line = f"shoal: {inst.name} {inst.state.value}" + (
            f": {inst.state_message}" if inst.state_message else "")
        if line != self.last_line:
            self.out(line)
            self.last_line = line

    def _draw(self, inst: InstancePublic, stage: str, fraction: float) -> None:
        if not self.tty:
            line = f"shoal: {inst.name} {inst.state.value}: {int(fraction * 10) * 10}% {stage}"
            if line != self.last_line:
                self.out(line)
                self.last_line = line
            return
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=100, unit="%", desc=f"shoal: {inst.name} {inst.state.value}",
                            bar_format="{desc}: {percentage:3.0f}%|{bar:30}| {postfix}")
        self.bar.set_postfix_str(stage, refresh=False)
        self.bar.update(max(0, round(fraction * 100) - self.bar.n))
        self.last_line = ""

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


async def wait_running(client: RegistryClient, model_id: str, deadline: float,
                       stopping: Callable[[], bool] = lambda: False,
                       since: datetime | None = None,
                       view: ProgressView | None = None) -> InstancePublic | None:
    """Until an instance of the model is RUNNING, or one fails (ERROR: returned, its reason in
    its message, so the caller says it rather than wait on restarts that may fail the same way
    forever); None when stopped or past the deadline. Rows that last changed before `since`
    belong to engines of a previous run and do not count."""
    view = view or ProgressView()
    try:
        while time.monotonic() < deadline and not stopping():
            try:
                instances = await client.list_instances(InstanceFilter(model_id=model_id))
            except (Timeout, Unavailable):  # a busy or restarting registry: ask again
                await asyncio.sleep(POLL_S)
                continue
            fresh = [i for i in instances if since is None or i.state_changed_at >= since]
            for state in (InstanceState.RUNNING, InstanceState.ERROR):
                done = [i for i in fresh if i.state is state]
                if done:
                    view.show(done[0])
                    return done[0]
            if instances:
                view.show(instances[0])
            await asyncio.sleep(POLL_S)
        return None
    finally:
        view.close()


def failed_start(model: str, inst: InstancePublic) -> str:
    """What a wait says when the model's instance fails: which instance, and the reason."""
    return f"{model} failed to start ({inst.name} ERROR): {inst.state_message}"
