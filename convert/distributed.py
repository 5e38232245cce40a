"""Encoding a conversion's tensors on a Ray cluster (`kimi-convert SRC -o OUT --ray [ADDRESS]`).

The weight file's layout is planned before anything is encoded, so the driver writes each encoded
tensor in place as its task finishes, in any order, and journals it exactly as a local conversion
does: an interrupted run resumes from the journal, and the file is byte for byte the one a single
process writes. Workers read their source tensors themselves from the checkpoint directory, which
every node must see at the same path (a shared filesystem; trivially so on one machine). A task whose
worker dies is run again elsewhere (RETRIES). Importance vectors and second moments travel through
the object store, each moment once however many experts share it.

Ray is an optional dependency (`pip install 'kimi-stream[cluster]'`); nothing else imports this module.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from .converter import ConversionError, encode_tensor
from .encoder import set_threads
from .source import SourceError, open_checkpoint

RETRIES = 3                 # runs of a task whose worker died before its result is given up
IN_FLIGHT_PER_CPU = 2       # tasks submitted ahead per cluster CPU: workers never wait for the driver

_checkpoints: dict = {}     # per worker process: the opened source checkpoint, by directory


def _encode_task(src: str, name: str, codec: str, importance, moment):
    """On a worker: (encoded tensor, float32 bytes held), encoded with as many threads as the task
    was given CPUs."""
    import ray
    set_threads(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))
    ckpt = _checkpoints.get(src)
    if ckpt is None:
        try:
            ckpt = _checkpoints[src] = open_checkpoint(src, allow_missing_shards=True)
        except SourceError as e:
            raise ConversionError(str(e)) from None
    return encode_tensor(ckpt, name, codec, importance, moment)


def preflight(address: str) -> None:
    """What must hold before a Ray conversion writes anything: Ray installed, the address answering."""
    import importlib.util
    if importlib.util.find_spec("ray") is None:
        raise ConversionError("--ray needs Ray, which is not installed: pip install 'kimi-stream[cluster]'")
    _check_reachable(address)


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """A HOST:PORT address must answer at once: Ray itself retries an absent cluster for minutes."""
    if address == "local" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except ValueError:
        raise ConversionError(f"--ray {address}: not HOST:PORT") from None
    except OSError as e:
        raise ConversionError(f"--ray {address}: cannot join the cluster: nothing answers there "
                              f"({e.strerror or e}; start its head with `ray start --head --port {port}`)") from None


class RayEncoder:
    """Jobs (name, codec, importance, moment) encoded by Ray tasks; `map` yields (name, encoded, float32
    bytes held) as tasks finish."""

    def __init__(self, address: str, src):
        try:
            import ray
        except ImportError:
            raise ConversionError("--ray needs Ray, which is not installed: pip install 'kimi-stream[cluster]'") \
                from None
        self.ray = ray
        self.src = str(Path(src).resolve())
        self.started = not ray.is_initialized()
        if self.started:
            _check_reachable(address)
            # Ray turns a loopback address into this node's own and connects there; on a loaded machine
            # that first connection has been seen to fail once with the cluster up (a CI run), so a
            # reachable address gets a second try before the conversion gives up
            for attempt in (1, 2):
                try:
                    ray.init(address=None if address == "local" else address, include_dashboard=False,
                             logging_level="ERROR", log_to_driver=False, configure_logging=False)
                    break
                except Exception as e:   # Ray raises ConnectionError, RuntimeError, ValueError ... for a bad address
                    if attempt == 1 and isinstance(e, ConnectionError):
                        ray.shutdown()
                        time.sleep(1.0)
                        continue
                    raise ConversionError(f"--ray {address}: cannot join the cluster: "
                                          f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") \
                        from None
        self.task = ray.remote(num_cpus=1, max_retries=RETRIES)(_encode_task)

    def map(self, jobs):
        ray = self.ray
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        window = IN_FLIGHT_PER_CPU * cpus
        shared: dict[int, object] = {}          # id(moment) -> its object, put once
        pending: dict = {}
        jobs = iter(jobs)

        def submit() -> bool:
            job = next(jobs, None)
            if job is None:
                return False
            name, codec, importance, moment = job
            if moment is not None:
                ref = shared.get(id(moment))
                if ref is None or ref[0] is not moment:
                    ref = shared[id(moment)] = (moment, ray.put(moment))
                moment = ref[1]
            pending[self.task.remote(self.src, name, codec, importance, moment)] = name
            return True

        while len(pending) < window and submit():
            pass
        try:
            while pending:
                (ref,), _ = ray.wait(list(pending), num_returns=1)
                name = pending.pop(ref)
                encoded, held = self._result(ref, name)
                submit()
                yield name, encoded, held
        finally:
            if pending:         # an error, or the caller stopped early
                self._drain(pending)

    def _drain(self, pending: dict) -> None:
        """Cancel what is still in flight and let it settle, so that no task fails while Ray shuts down
        (Ray's core then prints its own error lines past ours)."""
        ray = self.ray
        for ref in pending:
            ray.cancel(ref, force=False)
        try:
            ray.wait(list(pending), num_returns=len(pending), timeout=5)
        except Exception:       # a cancelled task's error is what we asked for
            pass
        pending.clear()

    def _result(self, ref, name: str):
        """(encoded, held) of a finished task; its failure as one ConversionError."""
        ray = self.ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(getattr(e, "cause", None), Exception) else None
            if isinstance(cause, ConversionError):
                raise ConversionError(str(cause)) from None
            raise ConversionError(f"tensor {name}: the Ray task failed: "
                                  f"{cause!r}" if cause else f"tensor {name}: the Ray task failed") from None
        except ray.exceptions.RayError as e:
            raise ConversionError(f"tensor {name}: the Ray task failed {RETRIES + 1} times "
                                  f"({type(e).__name__})") from None

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
