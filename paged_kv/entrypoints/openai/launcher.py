"""Running the app: uvicorn in the foreground (``paged-kv serve``) or in a background thread (lesson 16).

vLLM starts its server in ``vllm/entrypoints/launchers/launcher.py`` (``serve_http``): uvicorn on a
socket it binds first. :func:`serve_http` does the same in the foreground, until Ctrl-C.

:class:`ServerThread` runs an app in a background thread of the current process, for a notebook, a
test or a benchmark: it binds ``host`` (loopback by default) on ``port`` (0: a free port the system
picks) before uvicorn starts, so :attr:`ServerThread.url` is known at once, and returns from its
constructor only once ``GET /health`` answers 200. :meth:`ServerThread.stop` shuts uvicorn down: it
stops taking connections, lets the open ones finish (at most ``graceful_seconds``, then cancels
them), and runs the app's shutdown, which shuts its ``AsyncLLM`` down: the engine loop stops, every
request left is aborted and every block is free. It is a context manager too.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import uvicorn

LOOPBACK = "127.0.0.1"


def serve_http(app, *, host: str = LOOPBACK, port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn on ``host:port`` until interrupted; the app shuts down on the way out."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


class ServerThread:
    """``app`` served by uvicorn in a daemon thread on ``host:port`` (see the module).

    Raises:
        OSError: the address cannot be bound.
        RuntimeError: the server did not answer ``/health`` within ``start_timeout`` seconds, or its
            thread died; the thread is stopped first.
    """

    def __init__(
        self,
        app,
        host: str = LOOPBACK,
        port: int = 0,
        *,
        log_level: str = "warning",
        start_timeout: float = 60.0,
        graceful_seconds: float = 5.0,
    ) -> None:
        self.app = app
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.host, self.port = host, self.socket.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=graceful_seconds,
            lifespan="on",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self.socket]},
            name=f"uvicorn:{self.port}",
            daemon=True,
        )
        self.thread.start()
        try:
            self._wait_until_healthy(start_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """``http://HOST:PORT``, the base of every route (the ``openai`` client's is ``url + "/v1"``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def async_llm(self):
        """The :class:`~paged_kv.serving.async_llm.AsyncLLM` the app serves (``app.state.async_llm``)."""
        return self.app.state.async_llm

    def _wait_until_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server thread on {self.url} stopped before /health answered")
            if self.server.started:
                try:
                    with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                        if response.status == 200:
                            return
                except (urllib.error.URLError, OSError):
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not answer /health within {timeout} s")
            time.sleep(0.02)

    def stop(self, timeout: float = 30.0) -> None:
        """Shut the server down and wait for its thread (the app's shutdown included); idempotent."""
        self.server.should_exit = True
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)
        self.socket.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.thread.is_alive() else "stopped"
        return f"ServerThread({self.url}, {state})"
