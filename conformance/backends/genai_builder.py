"""onnxruntime-genai's model builder, run as its command line runs it, from a process that has
imported what it needs once.

`python -m onnxruntime_genai.models.builder` spends ~4.5 s of a tiny model's ~5.8 s importing
torch, transformers and onnx (measured on CI's class of machine): a run that builds several models
(the genai column and its int4 twin, the tests' dozens) paid that for each. Here one server process
imports those (PRELOADED) and waits; each build is a fork of it, which imports the builder itself
(0.2 s: it loads onnxruntime, whose import starts a thread, so the server never does) and runs its
`__main__` with the build's arguments. Every build starts from the state a fresh interpreter has
after those imports, and nothing one build sets is seen by the next.

A fork is safe only while the server holds a single thread: it sets OPENBLAS_NUM_THREADS=1 for
itself (numpy's BLAS would start a pool at import; the builder's numpy work is casts and copies),
and where it still holds more, where it cannot start, or where it dies, the build runs as a fresh
`python -m onnxruntime_genai.models.builder`, the way it always could.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

BUILDER = "onnxruntime_genai.models.builder"
PRELOADED = ("torch", "transformers", "transformers.modeling_utils", "onnx", "onnx_ir")


def run_builder(arguments: Sequence[str], log: Path) -> int:
    """Run the builder's command line with `arguments`, its stdout and stderr written to `log`;
    its exit status."""
    server = _server()
    if server is not None:
        status = server.build(list(arguments), log)
        if status is not None:
            return status
    with open(log, "w") as output:
        return subprocess.run([sys.executable, "-m", BUILDER, *arguments], stdout=output,
                              stderr=subprocess.STDOUT).returncode


class _Server:
    """The client's side: one request at a time (a lock), a JSON line each way."""

    COMMAND = (sys.executable, "-m", "conformance.backends.genai_builder")

    def __init__(self):
        self.process = subprocess.Popen(self.COMMAND,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        self.lock = threading.Lock()

    def build(self, arguments: list[str], log: Path) -> int | None:
        """The build's exit status, or None where the server could not run it (then it is closed; one
        that answered it cannot fork is not started again in this process: each would import anew)."""
        global _FORKS_REFUSED
        with self.lock:
            try:
                self.process.stdin.write(json.dumps({"arguments": arguments, "log": str(log)}) + "\n")
                self.process.stdin.flush()
                answer = json.loads(self.process.stdout.readline() or "null")
            except (OSError, ValueError):
                answer = None
            if not isinstance(answer, dict) or answer.get("status") is None:
                _FORKS_REFUSED = isinstance(answer, dict)
                self.close()
                return None
            return int(answer["status"])

    def close(self) -> None:
        global _SERVER
        _SERVER = None
        try:
            self.process.stdin.close()
        except OSError:
            pass
        self.process.kill()
        self.process.wait()


_SERVER: _Server | None = None
_FORKS_REFUSED = False
_STARTING = threading.Lock()


def _server() -> _Server | None:
    global _SERVER
    with _STARTING:
        if _SERVER is None and not _FORKS_REFUSED and hasattr(os, "fork"):
            try:
                _SERVER = _Server()
            except OSError:
                return None
        return _SERVER


def _single_threaded() -> bool:
    """Whether this process runs one thread (native ones counted, where /proc says)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return threading.active_count() == 1


def _build_in_child(arguments: list[str], log: str) -> None:
    """The forked child: the builder's __main__ with the arguments, as `python -m` runs it. Never returns."""
    import runpy
    import traceback

    status = 1
    try:
        descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(descriptor, 1)
        os.dup2(descriptor, 2)
        sys.argv = [BUILDER, *arguments]
        try:
            runpy.run_module(BUILDER, run_name="__main__", alter_sys=True)
            status = 0
        except SystemExit as done:
            status = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        except BaseException:  # noqa: BLE001 - the child reports what failed in its log, as the command would
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _serve() -> None:
    """The server's side: import what the builder needs, then a fork per request until stdin
    closes. A request it cannot fork safely is answered with status null: the client runs it afresh."""
    import importlib

    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # what the imports print must not break the answers
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the build imports it again and says what is wrong
            pass
    for line in sys.stdin:
        request = json.loads(line)
        status = None
        if _single_threaded():
            answers.flush()
            child = os.fork()
            if child == 0:
                _build_in_child(request["arguments"], request["log"])
            _, code = os.waitpid(child, 0)
            status = os.waitstatus_to_exitcode(code)
        answers.write(json.dumps({"status": status}) + "\n")
        answers.flush()


if __name__ == "__main__":
    _serve()
