"""The runs a studio starts: each `lora-llama train` in a process of its own, its output in a log beside the run
folder, so the page survives a run that crashes and the folder holds what the CLI writes. Stop sends SIGTERM
(the trainer saves a checkpoint at the next step and ends); Resume starts the same command again, which resumes
from the folder's checkpoint. The run folder's lock keeps two studios (or a studio and a terminal) from running
one run twice."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from lora_llama.errors import UserError
from lora_llama.studio.runs import TRAIN, is_running
from lora_llama.training.run_folder import log_file


class Jobs:
    """The processes this studio started, by run folder."""

    def __init__(self, runs: Path):
        self.runs = runs
        self.processes: dict[tuple[Path, str], subprocess.Popen] = {}

    def start(self, run: Path, command: list[str], what: str = TRAIN, log: Path | None = None) -> None:
        """Run `lora-llama ARGS` (command without the program's name) for a folder, as the job `what` names: a run's
        training ("train"), unless it runs already, or another command (merge, export, push, a chat pane), its
        output in its own log (by default the run folder's log of that job)."""
        if what == TRAIN and is_running(run):
            raise UserError(f"{run.name} is running already")
        if what == TRAIN and self.busy(run, what):  # it let go of the run folder's lock: it is ending
            self.processes[run, what].wait(timeout=60)
        if self.busy(run, what):
            raise UserError(f"{run.name}: the last {what} command is still running")
        run.parent.mkdir(parents=True, exist_ok=True)
        output = open(log or log_file(run, what), "w")
        output.write(f"$ {shlex.join(['lora-llama', *command])}\n")
        output.flush()
        self.processes[run, what] = subprocess.Popen(
            [sys.executable, "-m", "lora_llama", *command],
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # Ctrl-C on the studio does not stop its runs
        )
        output.close()

    def busy(self, run: Path, what: str) -> bool:
        process = self.processes.get((run, what))
        return process is not None and process.poll() is None

    def stop(self, run: Path) -> None:
        """SIGTERM to the run's trainer: it saves a checkpoint at the next step boundary and ends."""
        process = self.processes.get((run, TRAIN))
        if process is None or process.poll() is not None:
            raise UserError(f"{run.name} is not running from this studio")
        process.send_signal(signal.SIGTERM)

    def command_of(self, run: Path) -> list[str]:
        """The command the studio last started for the run (its log's first line), to resume it."""
        log = log_file(run, TRAIN)
        first = log.read_text().splitlines()[0] if log.is_file() else ""
        if not first.startswith("$ lora-llama "):
            raise UserError(f"{run.name} was not started from the studio: resume it with the command that started it")
        return shlex.split(first[2:])[1:]
