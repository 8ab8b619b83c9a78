"""The server of `--launch`: `xpod serve --port 0 ...` as a child process in its own session,
waited for (`/health`), stopped with SIGTERM (its exit status checked) or killed with all it
started."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import psutil

from bench.common import progress
from bench.serve.options import BenchError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE_URL_LINE = re.compile(r"serving (\S+) on (https?://\S+)")
LAUNCH_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


class LaunchedServer:
    """`xpod serve --port 0 ...` as a child process (its own session: nothing outlives it)."""

    def __init__(self, argv: tuple[str, ...]):
        self.cmd = [sys.executable, "-m", "runtime.cli", "serve", "--port", "0", *argv]
        self.log = tempfile.TemporaryFile(mode="w+b")  # noqa: SIM115 - closed by close()
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def tail(self, n: int = 15) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").splitlines()
        return "\n".join("    " + ln for ln in lines[-n:])

    def start(self) -> str:
        progress(f"  launching: {shlex.join(self.cmd[1:])}")
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            self.cmd,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not self.url:
            self.log.seek(0)
            m = SERVE_URL_LINE.search(self.log.read().decode(errors="replace"))
            if m:
                self.url = m.group(2)
                break
            if self.proc.poll() is not None:
                raise BenchError(
                    f"xpod serve exited with status {self.proc.returncode} before"
                    f" serving:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise BenchError(
                    f"xpod serve did not serve within {LAUNCH_TIMEOUT_S:g} s:\n{self.tail()}"
                )
            time.sleep(0.05)
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2.0) as r:
                    if r.status == 200:
                        return self.url
            except (urllib.error.URLError, OSError):
                pass
            if self.proc.poll() is not None:
                raise BenchError(
                    f"xpod serve exited with status {self.proc.returncode}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise BenchError(f"{self.url}/health not 200 within {LAUNCH_TIMEOUT_S:g} s")
            time.sleep(0.1)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (drain), wait for the exit status (up to `timeout_s`: more with
        --replay-check, whose replay of every step runs before the exit)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise BenchError(
                f"xpod serve did not stop {timeout_s:g} s after SIGTERM:\n{self.tail()}"
            ) from None

    def kill(self) -> None:
        """Stop it whatever state it is in: SIGTERM twice (no drain), then SIGKILL its session."""
        p = self.proc
        if p is None or p.poll() is not None:
            self._reap_group()
            return
        for _ in range(2):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            time.sleep(0.1)
        try:
            p.wait(15.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10.0)
        self._reap_group()

    def _reap_group(self) -> None:
        """Anything left in the server's session (its pid is the session id) gets SIGKILL."""
        if self.proc is None:
            return
        sid = self.proc.pid
        for q in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error, OSError):
                if q.pid not in (os.getpid(), sid) and os.getsid(q.pid) == sid:
                    q.kill()

    def close(self) -> None:
        self.log.close()
