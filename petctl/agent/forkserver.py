"""The fork server: one interpreter per node that does the warm workers' imports once and forks every warm
worker from it, in milliseconds. Both sides are here: the server's process (`python -u -m
petctl.agent.forkserver`, a child of the agent that never imports torch itself) and the agent's handle on it
(`ForkServer`, with `ForkedProc` for each worker), since they are one protocol.

Sections: the server (this docstring), the agent's side.

Why: a warm worker spawned afresh spends seconds of CPU on its imports (torch and torch._dynamo: about 3 s
on the bench's cores; a framework's more), so a refill is not warm until those have passed, and a second
notice early in a round (spot reclaims come in bursts) found a worker still importing (bench P1 with
`--notice-at burst`). A fork of a process that has imported them copies its pages on write instead:
measured here, 10-15 ms for a 290 MB interpreter with torch imported, and no import CPU per worker at all.

How (`python -u -m petctl.agent.forkserver PRELOADS CONTROL_FD SCRIPT`): the server imports what a warm worker
would (`warm_up`), says whether it may fork (`fork_blocker`) in a `hello` line, then serves requests on its
control socket (one byte each, with three descriptors attached: the worker's stdin, its stdout and stderr, its
ready pipe). Each request forks a child that goes on exactly as a spawned warm worker after its imports: it
signals ready and waits for its order on stdin. The server answers `forked` with the child's pid, in request
order, and `exited` with its exit code once it reaps it (it is the child's parent: the agent cannot wait for
it). Children die with the server (PR_SET_PDEATHSIG) and the server with its agent, so the chain a spawned
worker has (agent -> worker) holds through it. It stops when the agent closes the socket.

Where a fork would be unsafe, the server says so and exits, and the pool spawns its workers as before: a
Python thread started by a preloaded module (a fork copies only the calling thread, and a lock another
held stays held in the child), or CUDA initialised by an import (a forked child cannot use it). The native
thread numpy's OpenBLAS starts at import is safe: OpenBLAS stops and restarts its pool around a fork
(pthread_atfork), as the fork-started DataLoader workers of every torch job rely on.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO

from petctl.agent.warm_worker import OrderReader, run_order, signal_ready, warm_up
from petctl.io.procs import alive, wait_until

PR_SET_PDEATHSIG = 1  # linux/prctl.h

# --- the server ---------------------------------------------------------------------------------------------

FORK_REQUEST = b"F"  # one request; its three descriptors ride along (SCM_RIGHTS)


@dataclass(frozen=True)
class ServerMessage:
    """One line from the fork server to its agent.

    `hello`: the imports are done; `reason` is empty when the server forks, else why it will not (it then
    exits). `forked`: the pid of the worker forked for the oldest unanswered request. `exited`: a worker's
    exit code as Popen reports one (negative: killed by that signal)."""

    kind: str
    pid: int = 0
    code: int = 0
    reason: str = ""

    def line(self) -> bytes:
        return (json.dumps(asdict(self)) + "\n").encode()

    @classmethod
    def parse(cls, line: bytes) -> ServerMessage:
        """Raises ValueError for a line that is not one (the agent then stops trusting the server)."""
        try:
            record = json.loads(line)
            message = cls(**record)
        except (TypeError, ValueError) as e:
            raise ValueError(f"not a fork server message: {line[:200]!r}") from e
        if message.kind not in ("hello", "forked", "exited"):
            raise ValueError(f"unknown fork server message {message.kind!r}")
        return message


def fork_blocker() -> str:
    """Why this process must not fork workers, "" when it may (see the section above)."""
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if others:
        return f"a preloaded module started Python threads ({', '.join(others)[:200]})"
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None and cuda.is_initialized():
        return "a preloaded module initialised CUDA, which a forked worker cannot use"
    return ""


def serve(sock: socket.socket) -> int | None:
    """Fork a warm worker per request until the agent closes `sock`, then return None (in the server).
    In each forked child this returns the child's ready descriptor, with its stdin, stdout and stderr in
    place: the caller goes on as a warm worker after its imports. Raises OSError when the socket fails."""
    wake_r, wake_w = os.pipe()  # SIGCHLD wakes the select (signal.set_wakeup_fd)
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
            _reap(sock)
        if sock not in readable:
            continue
        msg, fds, _flags, _addr = socket.recv_fds(sock, 1, 3)
        if not msg:
            return None  # the agent closed the socket: the pool is closed
        if msg != FORK_REQUEST or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            continue
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here may be written twice
            stream.flush()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            sock.close()
            return _become_worker(server, *fds)
        for fd in fds:
            os.close(fd)
        sock.sendall(ServerMessage("forked", pid=pid).line())


def _reap(sock: socket.socket) -> None:
    """Collect every child that has exited and report its exit code."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.sendall(ServerMessage("exited", pid=pid, code=os.waitstatus_to_exitcode(status)).line())


def _become_worker(server: int, stdin_fd: int, out_fd: int, ready_fd: int) -> int:
    """In a forked child of `server` (its pid, read before the fork): its own stdio, dying with the server,
    fresh random state; returns its ready fd."""
    os.dup2(stdin_fd, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    for fd in (stdin_fd, out_fd):
        if fd > 2:
            os.close(fd)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server:  # the server died before the call took effect, or before the fork returned
        os._exit(1)
    gc.enable()  # the objects the server made stay frozen (shared, never scanned); the worker's own are not
    numpy = sys.modules.get("numpy")  # Python's random reseeds itself in a forked child; numpy does not
    if numpy is not None:
        numpy.random.seed()
    return ready_fd


def main() -> None:
    """The fork server's process: `python -u -m petctl.agent.forkserver PRELOADS CONTROL_FD SCRIPT`."""
    args = sys.argv[1:]
    names = [m for m in (args[0] if args else "").split(",") if m]
    sock = socket.socket(fileno=int(args[1]))
    script = args[2] if len(args) > 2 else ""
    gc.disable()  # no collection may leave holes in the pages the workers share (Python's gc docs, on fork)
    warm_up(names, script)
    gc.freeze()  # and a worker's collections never write to the objects it shares with the server
    blocker = fork_blocker()
    sock.sendall(ServerMessage("hello", reason=blocker).line())
    if blocker:
        return
    ready_fd = serve(sock)
    if ready_fd is None:
        return
    orders = OrderReader(None)
    signal_ready(ready_fd)
    run_order(orders)


# --- the agent's side ---------------------------------------------------------------------------------------
# The server's workers are its children, not the agent's: `ForkedProc` gives them Popen's interface, with the
# exit code the server reports. The warm pool (workers.py) starts one `ForkServer` and forks from it.

FORK_WAIT = 10.0  # longest a fork request waits for its answer
SERVER_STOP = 5.0  # how long a closed fork server gets to exit before it is killed
GONE_POLL = 0.02  # how often a dead server's workers are checked until they are gone


class ForkedProc:
    """A worker forked by the node's fork server, behind the part of Popen's interface the agent uses.

    Its parent is the server, which reaps it and reports its exit code (`ForkServer`); signals go to its pid
    directly. As with multiprocessing's forkserver, a signal sent between the server's reap and its report
    reaching us would go to a pid the kernel may in principle have reused; pids are handed out in sequence,
    so that needs the whole pid range to wrap within those microseconds."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes]) -> None:
        self.pid = pid
        self.stdin: IO[bytes] | None = stdin
        self.stdout: IO[bytes] | None = stdout
        self.returncode: int | None = None
        self._exited = threading.Event()

    def exited(self, code: int) -> None:
        """Called with the exit code the server reported (negative: the signal that killed it)."""
        if self.returncode is None:
            self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, once reported. Raises subprocess.TimeoutExpired after `timeout` s."""
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


@dataclass
class _ForkRequest:
    """A fork request on its way: the agent's ends of the worker's pipes, and the worker once answered."""

    stdin: IO[bytes]
    stdout: IO[bytes]
    ready_fd: int
    answered: threading.Event = field(default_factory=threading.Event)
    proc: ForkedProc | None = None


class ForkServer:
    """The agent's side of a node's fork server: start it, fork workers, learn their exits, close it.

    One reader thread takes the server's lines in order: the `hello`, then each `forked` answer (matched to
    the oldest request still waiting) and `exited` report. When the server's socket ends (it died, or was
    closed), every worker it forked is reported killed: they die with it (PR_SET_PDEATHSIG)."""

    def __init__(self, python: str, preload: Sequence[str], script: str, cwd: str, env: Mapping[str, str],
                 preexec: Callable[[], None] | None, out: IO[str] | None) -> None:
        self.python = python
        self.preload = tuple(preload)
        self.script = script
        self.cwd = cwd
        self.env = dict(env)
        self.preexec = preexec
        self.out = out
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.hello = threading.Event()
        self.reason = ""  # why it does not fork (set with the hello, or when it ends before one)
        self.ended = False
        self._lock = threading.Lock()
        self._requests: deque[_ForkRequest] = deque()
        self._procs: dict[int, ForkedProc] = {}
        self._reader: threading.Thread | None = None

    def start(self, timeout: float) -> str:
        """Start the server and wait (bounded) for its imports; "" when it forks, else why not (it is then
        closed). Never raises: a server that cannot start is a reason like any other."""
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [self.python, "-u", "-m", "petctl.agent.forkserver", ",".join(self.preload),
                 str(theirs.fileno()), self.script],
                cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if self.out is not None else None, stderr=subprocess.STDOUT,
                preexec_fn=self.preexec, pass_fds=(theirs.fileno(),))
        except OSError as e:
            ours.close()
            return f"the fork server did not start: {e}"
        finally:
            theirs.close()
        self.sock = ours
        self._reader = threading.Thread(target=self._read, name="fork-server", daemon=True)
        self._reader.start()
        if self.out is not None:
            threading.Thread(target=self._pump, name="fork-server-out", daemon=True).start()
        if not self.hello.wait(timeout):
            self.reason = f"the fork server's imports were not done in {timeout:.0f}s"
        if self.reason:
            self.close()
        return self.reason

    def fork(self, count: int) -> list[tuple[ForkedProc, int]]:
        """`count` new warm workers, each with the read end of its ready pipe. Raises OSError when the server
        is gone or does not answer in FORK_WAIT (the workers forked by then are killed)."""
        if self.sock is None or self.ended:
            raise OSError(self.reason or "the fork server has ended")
        requests: list[_ForkRequest] = []
        try:
            for _ in range(count):
                stdin_r, stdin_w = os.pipe()
                out_r, out_w = os.pipe()
                ready_r, ready_w = os.pipe()
                request = _ForkRequest(os.fdopen(stdin_w, "wb"), os.fdopen(out_r, "rb"), ready_r)
                requests.append(request)
                try:
                    with self._lock:  # the request's place in the queue is its place on the socket
                        self._requests.append(request)
                        socket.send_fds(self.sock, [FORK_REQUEST], [stdin_r, out_w, ready_w])
                finally:
                    for fd in (stdin_r, out_w, ready_w):
                        os.close(fd)
            deadline = time.monotonic() + FORK_WAIT
            for request in requests:
                if not request.answered.wait(max(0.0, deadline - time.monotonic())) or request.proc is None:
                    raise OSError(self.reason or f"no answer from the fork server in {FORK_WAIT:.0f}s")
        except OSError:
            for request in requests:
                if request.proc is not None:
                    request.proc.kill()
                else:
                    _close_request(request)
            raise
        return [(r.proc, r.ready_fd) for r in requests if r.proc is not None]

    def _read(self) -> None:
        sock = self.sock
        assert sock is not None
        try:
            with sock.makefile("rb") as lines:
                for line in lines:
                    self._on(ServerMessage.parse(line))
        except (OSError, ValueError) as e:
            if not self.ended:
                self.reason = self.reason or f"the fork server's socket failed: {e}"
        finally:
            with self._lock:
                self.ended = True
                self.reason = self.reason or "the fork server exited"
                waiting, self._requests = list(self._requests), deque()
                procs, self._procs = list(self._procs.values()), {}
            self.hello.set()
            for request in waiting:
                _close_request(request)
                request.answered.set()
            for proc in procs:  # they die with it: reported once gone, so none outlives its report
                if not wait_until(lambda pid=proc.pid: not alive(pid), SERVER_STOP, GONE_POLL):
                    proc.kill()
                proc.exited(-signal.SIGKILL)

    def _on(self, message: ServerMessage) -> None:
        if message.kind == "hello":
            self.reason = message.reason
            self.hello.set()
        elif message.kind == "forked":
            with self._lock:
                request = self._requests.popleft()
                request.proc = self._procs[message.pid] = ForkedProc(message.pid, request.stdin,
                                                                     request.stdout)
            request.answered.set()
        else:
            with self._lock:
                proc = self._procs.pop(message.pid, None)
            if proc is not None:
                proc.exited(message.code)

    def _pump(self) -> None:
        """The server's own output (its imports' warnings) into the node log, once for every worker."""
        assert self.proc is not None and self.proc.stdout is not None and self.out is not None
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            with contextlib.suppress(ValueError, OSError):  # our stream is closed: keep draining
                self.out.write(line if line.endswith("\n") else line + "\n")
                self.out.flush()
        self.proc.stdout.close()

    def close(self) -> None:
        """Stop the server (closing its socket ends it) and with it every worker it forked."""
        self.ended = True
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
        if self.proc is not None:
            try:
                self.proc.wait(SERVER_STOP)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(2 * SERVER_STOP)  # every worker's end reported before we return


def _close_request(request: _ForkRequest) -> None:
    for stream in (request.stdin, request.stdout):
        with contextlib.suppress(OSError):
            stream.close()
    with contextlib.suppress(OSError):
        os.close(request.ready_fd)


if __name__ == "__main__":
    main()
