"""Retrying storage calls: which errors are transient, how long to wait, when to give up.

Every call the manager makes to a non-local file system goes through :meth:`Retrier.call`
(one *operation*: write a file, read a file, list, delete, write a commit record). On ``gs://``
and ``s3://`` each HTTP *request* inside an operation is also retried, by the same policy with
``client_attempts`` tries (see :func:`ckptmgr.storage.open_filesystem`), instead of gcsfs' and
s3fs' own retry loops, so that both levels are classified, logged and bounded in one place.

Only transient errors are retried: HTTP 408, 429, 500, 502, 503 and 504 (and the S3 error codes
that mean the same, such as ``SlowDown``), connection resets, refusals and timeouts. Everything
else fails at once: 400, 401, 403, 404, 412, local-disk errors such as ``ENOSPC``, and anything
that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``, and DCP's
``CheckpointException``, which derives from ``BaseException``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import inspect
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import tenacity
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ckptmgr.s3_requests import send_small_bodies_at_once
from ckptmgr.setting_types import Count, Seconds

log = logging.getLogger("ckptmgr.retry")

T = TypeVar("T")

TRANSIENT_HTTP_STATUS = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP status codes worth another try."""

TRANSIENT_S3_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "RequestTimeoutException",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "RequestThrottled",
        "RequestThrottledException",
        "BandwidthLimitExceeded",
        "TransientError",
    }
)
"""S3 error codes of transient failures (botocore ``ClientError.response["Error"]["Code"]``)."""

_NEVER_RETRIED = (
    FileNotFoundError,  # 404
    FileExistsError,  # 412 on a create-only write
    PermissionError,  # 403 on S3, EACCES/EPERM locally
    IsADirectoryError,
    NotADirectoryError,
)
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETRESET,
    }
)
_LOCAL_FATAL_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ENOSPC",
        "EDQUOT",
        "EROFS",
        "EFBIG",
        "ENOMEM",
        "EMFILE",
        "ENFILE",
        "EACCES",
        "EPERM",
        "ENOENT",
        "EEXIST",
        "EISDIR",
        "ENOTDIR",
        "ENAMETOOLONG",
    )
    if hasattr(errno, name)
)
"""errno values of local (disk, memory, permission) errors: retrying cannot help."""
_CONNECTION_CLASS_HINTS = (
    "Connection",
    "Timeout",
    "ServerDisconnected",
    "Payload",
    "ChunkedEncoding",
    "IncompleteRead",
    "ProxyError",
)
_CONNECTION_MODULES = ("aiohttp", "botocore", "urllib3", "requests", "http.client")


class RetryConfig(BaseModel):
    """How ckptmgr retries transient storage errors (object stores and other remote stores).

    One storage operation (write a file, read a file, list, delete, write a commit record) gets
    at most ``max_attempts`` attempts, and no attempt starts later than ``deadline_s`` seconds
    after its first one. Between attempts it waits an exponentially growing time with jitter:
    ``initial_backoff_s``, doubling up to ``max_backoff_s``, plus up to ``initial_backoff_s`` of
    random jitter, cut so that the wait ends by the deadline. On ``gs://`` and ``s3://``, each
    HTTP request inside an attempt gets at most ``client_attempts`` tries with the same backoff
    (this replaces gcsfs' and s3fs' own retries, which would otherwise multiply with these).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_attempts: Count = Field(default=5, ge=1, le=100)
    """Attempts per storage operation, the first one included (1 disables retries)."""
    client_attempts: Count = Field(default=3, ge=1, le=20)
    """Tries per HTTP request inside one attempt, on gs:// and s3:// (1 disables them)."""
    initial_backoff_s: Seconds = Field(default=0.25, ge=0.0, le=60.0)
    """The first wait, and the most random jitter added to each wait."""
    max_backoff_s: Seconds = Field(default=5.0, ge=0.0, le=600.0)
    """The longest wait between two attempts (before jitter)."""
    deadline_s: Seconds = Field(default=20.0, gt=0.0, le=86400.0)
    """No attempt of an operation starts later than this many seconds after its first one."""

    @model_validator(mode="after")
    def _check_backoff(self) -> RetryConfig:
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                f"max_backoff_s ({self.max_backoff_s}) must be at least initial_backoff_s "
                f"({self.initial_backoff_s})"
            )
        return self

    def worst_case_s(self) -> float:
        """An upper bound of the time one operation spends *waiting* between attempts.

        Waits between operation attempts end by ``deadline_s``; on top of that, the last attempt
        may itself wait between its request tries (``client_attempts - 1`` waits of at most
        ``max_backoff_s + initial_backoff_s`` each). Transfer time is not included.
        """
        per_request = (self.client_attempts - 1) * (self.max_backoff_s + self.initial_backoff_s)
        return self.deadline_s + per_request


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the exceptions it was raised from, outermost first (cycles cut)."""
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not other for other in seen) and len(seen) < 8:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _http_status(error: BaseException) -> int | None:
    """The HTTP status an error reports (gcsfs, aiohttp, botocore), or None."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        meta = response.get("ResponseMetadata") or {}
        status = meta.get("HTTPStatusCode")
        code = (response.get("Error") or {}).get("Code")
        if isinstance(code, str) and code in TRANSIENT_S3_CODES:
            # the status itself when it says so (an InternalError is a 500); else a transient
            # code under another status (a store's SlowDown as 400) counts as a 503
            return status if status in TRANSIENT_HTTP_STATUS else 503
        if isinstance(code, str) and code.isdigit():
            return int(code)
        if isinstance(status, int):
            return status
    for attribute in ("code", "status"):  # gcsfs HttpError.code, aiohttp ClientResponseError
        value = getattr(error, attribute, None)
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and 100 <= value <= 599:
            return value
        if isinstance(value, str) and value.isdigit() and 100 <= int(value) <= 599:
            return int(value)
    return None


def _is_connection_error(error: BaseException) -> bool:
    if isinstance(error, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    if isinstance(error, concurrent.futures.TimeoutError):
        return True
    if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS:
        return True
    for cls in type(error).__mro__:
        module = cls.__module__ or ""
        if module.startswith(_CONNECTION_MODULES) and any(
            hint in cls.__name__ for hint in _CONNECTION_CLASS_HINTS
        ):
            return True
    return False


def is_transient(error: BaseException) -> bool:
    """True iff ``error`` is worth another try: a transient HTTP status or a connection problem.

    The exception and what it was raised from are inspected, because clients wrap errors (s3fs
    turns a botocore ``ClientError`` into an ``OSError``). Never true for a ``BaseException``
    that is not an ``Exception`` (DCP's ``CheckpointException`` is one), for missing or existing
    files, for permission errors, or for local-disk errors such as ``ENOSPC``.
    """
    if not isinstance(error, Exception):
        return False
    for item in _chain(error):
        if not isinstance(item, Exception) or isinstance(item, _NEVER_RETRIED):
            return False
        if isinstance(item, OSError) and item.errno in _LOCAL_FATAL_ERRNOS:
            return False
        status = _http_status(item)
        if status is not None:
            return status in TRANSIENT_HTTP_STATUS
        if _is_connection_error(item):
            return True
    return False


def http_status(error: BaseException) -> int | None:
    """The HTTP status reported by ``error`` or by what it was raised from, or None."""
    return next((s for s in map(_http_status, _chain(error)) if s is not None), None)


def describe(error: BaseException) -> str:
    """A one-line description of an error for logs: its type, HTTP status and message."""
    status = http_status(error)
    first_line = (str(error).strip().splitlines() or [""])[0][:300]
    where = f"HTTP {status} " if status is not None else ""
    return f"{type(error).__name__}: {where}{first_line}".rstrip(": ")


class _DeadlineWait:
    """Exponential backoff with jitter, cut so that the wait ends by the deadline."""

    def __init__(self, config: RetryConfig, deadline_s: float | None) -> None:
        self._config = config
        self._deadline_s = deadline_s

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        config = self._config
        exponent = min(max(retry_state.attempt_number - 1, 0), 60)
        wait = min(config.initial_backoff_s * 2.0**exponent, config.max_backoff_s)
        wait += random.uniform(0.0, config.initial_backoff_s)
        if self._deadline_s is None:
            return wait
        elapsed = retry_state.seconds_since_start or 0.0
        return max(0.0, min(wait, self._deadline_s - elapsed))


def _log_retry(level: str, what: str, attempts: int) -> Callable[[tenacity.RetryCallState], None]:
    def before_sleep(retry_state: tenacity.RetryCallState) -> None:
        outcome = retry_state.outcome
        error = outcome.exception() if outcome is not None else None
        sleep = retry_state.next_action.sleep if retry_state.next_action else 0.0
        log.warning(
            "%s: %s failed (attempt %d of %d): %s; retrying in %.2fs",
            level,
            what,
            retry_state.attempt_number,
            attempts,
            describe(error) if error is not None else "no error",
            sleep,
        )

    return before_sleep


class Retrier:
    """Runs storage calls under one :class:`RetryConfig`."""

    def __init__(self, config: RetryConfig | None = None) -> None:
        self.config = config or RetryConfig()

    def _stop(self, attempts: int, deadline_s: float | None) -> Any:
        stop: Any = tenacity.stop_after_attempt(attempts)
        if deadline_s is not None:
            stop = stop | tenacity.stop_after_delay(deadline_s)
        return stop

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, retried on transient errors; the last error is re-raised."""
        config = self.config
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            stop=self._stop(config.max_attempts, config.deadline_s),
            wait=_DeadlineWait(config, config.deadline_s),
            before_sleep=_log_retry("storage", what, config.max_attempts),
            reraise=True,
            sleep=time.sleep,
        )
        return retrying(fn, *args, **kwargs)

    async def call_async(
        self, what: str, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any
    ) -> T:
        """``await fn(*args, **kwargs)`` with ``client_attempts`` tries (one HTTP request)."""
        config = self.config
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(is_transient),
            stop=self._stop(config.client_attempts, config.deadline_s),
            wait=_DeadlineWait(config, config.deadline_s),
            before_sleep=_log_retry("request", what, config.client_attempts),
            reraise=True,
            sleep=asyncio.sleep,
        )
        return await retrying(fn, *args, **kwargs)


_CLIENT_CLASSES: dict[tuple[type, RetryConfig], type] = {}
_CLIENT_LOCK = threading.Lock()


def _derives_from(cls: type, module_prefix: str, name: str) -> bool:
    return any(
        (base.__module__ or "").startswith(module_prefix) and base.__name__ == name
        for base in cls.__mro__
    )


def is_gcs_class(cls: type) -> bool:
    """True for gcsfs' ``GCSFileSystem`` and its subclasses."""
    return _derives_from(cls, "gcsfs", "GCSFileSystem")


def is_s3_class(cls: type) -> bool:
    """True for s3fs' ``S3FileSystem`` and its subclasses."""
    return _derives_from(cls, "s3fs", "S3FileSystem")


def client_class(base: type, config: RetryConfig) -> type:
    """``base``, or a subclass whose HTTP requests ckptmgr retries (gcsfs and s3fs).

    gcsfs retries each request 6 times (about 31 s of sleeps, fixed when the class is defined)
    and s3fs up to 5 times on top of botocore's own attempts. The subclasses replace both with
    :meth:`Retrier.call_async`: ``config.client_attempts`` tries per request, classified by
    :func:`is_transient` and logged. Any other class is returned unchanged. Subclasses are made
    once per (class, config), so fsspec's instance cache keeps working.
    """
    key = (base, config)
    with _CLIENT_LOCK:
        made = _CLIENT_CLASSES.get(key)
        if made is None:
            if is_gcs_class(base):
                made = _gcs_client_class(base, config)
            elif is_s3_class(base):
                made = _s3_client_class(base, config)
            else:
                made = base
            _CLIENT_CLASSES[key] = made
        return made


GCS_REQUEST_TIMEOUTS = {"sock_connect": 5.0, "sock_read": 15.0}
"""Seconds of each gcsfs request: to connect, and without a byte of the answer (s3fs' defaults
for its requests); a request that runs out is retried like any other timeout."""


def client_options(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` plus what turns a client's own retries off, and gives gcsfs' requests a
    timeout, unless the user set them."""
    if is_gcs_class(cls) and options.get("requests_timeout") is None:
        # gcsfs hands requests_timeout (None by default) to every aiohttp request, which turns
        # aiohttp's own timeout off: a server that accepted and never answered held a listing,
        # a save and close() for ever, whatever RetryConfig.deadline_s said.
        import aiohttp

        return {**options, "requests_timeout": aiohttp.ClientTimeout(**GCS_REQUEST_TIMEOUTS)}
    if not is_s3_class(cls):
        return dict(options)
    config_kwargs = dict(options.get("config_kwargs") or {})
    # botocore would retry 5xx/throttling itself; one attempt here, ckptmgr retries the request.
    config_kwargs.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    return {**options, "config_kwargs": config_kwargs}


def _gcs_client_class(base: type, config: RetryConfig) -> type:
    raw = getattr(getattr(base, "_request", None), "__wrapped__", None)
    if raw is None or not inspect.iscoroutinefunction(raw):
        log.info("gcsfs %s has no undecorated _request; its own retries stay on", base.__name__)
        return base
    retrier = Retrier(config)

    class RetryingGCSFileSystem(base):  # type: ignore[misc, valid-type]
        """gcsfs with each HTTP request retried by ckptmgr instead of gcsfs' fixed 6 tries."""

        async def _request(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
            what = f"GCS {method} {_format_quietly(path, args)}"[:200]
            return await retrier.call_async(what, raw, self, method, path, *args, **kwargs)

    return RetryingGCSFileSystem


def _format_quietly(template: str, args: tuple[Any, ...]) -> str:
    """gcsfs' request path with its arguments filled in, for log messages."""
    try:
        return str(template).format(*args)
    except (IndexError, KeyError, ValueError):
        return str(template)


def _s3_client_class(base: type, config: RetryConfig) -> type:
    from fsspec.asyn import sync_wrapper

    retrier = Retrier(config)
    call_s3 = base._call_s3

    class RetryingS3FileSystem(base):  # type: ignore[misc, valid-type]
        """s3fs with each API call retried by ckptmgr instead of s3fs' and botocore's loops
        (and small uploads sent without waiting for ``100 Continue``:
        :mod:`ckptmgr.s3_requests`)."""

        retries = 1  # s3fs' own loop: one try

        async def get_s3(self, bucket: str | None = None) -> Any:
            return send_small_bodies_at_once(await super().get_s3(bucket))

        async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
            key = kwargs.get("Key") or kwargs.get("Prefix") or ""
            what = f"S3 {method} {kwargs.get('Bucket', '')}/{key}"[:200]
            return await retrier.call_async(what, call_s3, self, method, *args, **kwargs)

        call_s3 = sync_wrapper(_call_s3)

    return RetryingS3FileSystem
