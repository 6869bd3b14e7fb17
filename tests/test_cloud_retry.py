"""The retry policy on its own: which errors are transient, and how attempts and time are bounded.

The errors are the real exception types that gcsfs, s3fs/botocore, aiohttp and DCP raise, built
the way those libraries build them; the timing tests run real sleeps with small backoffs.
"""

from __future__ import annotations

import errno
import logging
import time

import pytest
from _cloud_servers import require_cloud_modules

require_cloud_modules()

import aiohttp  # noqa: E402
import botocore.exceptions  # noqa: E402
import gcsfs.retry  # noqa: E402
import pydantic  # noqa: E402
import requests  # noqa: E402
from s3fs.errors import translate_boto_error  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from ckptmgr.retry import Retrier, RetryConfig, describe, is_transient  # noqa: E402

pytestmark = pytest.mark.cloud


def boto_error(code: str, status: int) -> botocore.exceptions.ClientError:
    response = {
        "Error": {"Code": code, "Message": f"test {code}"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return botocore.exceptions.ClientError(response, "PutObject")  # type: ignore[arg-type]


def raised_from(outer: BaseException, cause: BaseException) -> BaseException:
    """``outer`` as raised with ``raise outer from cause``."""
    try:
        raise outer from cause
    except BaseException as error:
        return error


TRANSIENT = {
    "gcsfs 503": gcsfs.retry.HttpError({"code": 503, "message": "backend"}),
    "gcsfs 429": gcsfs.retry.HttpError({"code": 429, "message": "rate"}),
    "gcsfs 408": gcsfs.retry.HttpError({"code": 408, "message": "timeout"}),
    "gcsfs 504": gcsfs.retry.HttpError({"code": 504, "message": "gateway"}),
    "gcsfs 502 (raised as ProxyError)": requests.exceptions.ProxyError(),
    "S3 SlowDown": boto_error("SlowDown", 503),
    "S3 500": boto_error("InternalError", 500),
    "S3 throttling 400": boto_error("ThrottlingException", 400),
    "s3fs-translated SlowDown": translate_boto_error(boto_error("SlowDown", 503)),
    "s3fs-translated 429": translate_boto_error(boto_error("TooManyRequests", 429)),
    "aiohttp reset": aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer"),
    "aiohttp disconnect": aiohttp.ServerDisconnectedError(),
    "botocore endpoint": botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"),
    "botocore closed": botocore.exceptions.ConnectionClosedError(endpoint_url="http://x"),
    "botocore read timeout": botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"),
    "ConnectionResetError": ConnectionResetError(errno.ECONNRESET, "reset"),
    "TimeoutError": TimeoutError("read timed out"),
}
PERMANENT = {
    "gcsfs 400": gcsfs.retry.HttpError({"code": 400, "message": "bad"}),
    "gcsfs 401": gcsfs.retry.HttpError({"code": 401, "message": "Invalid Credentials"}),
    "gcsfs 403 (plain OSError)": OSError("Forbidden: b/o\nno access"),
    "gcsfs 412": FileExistsError("b/o"),
    "S3 403": boto_error("AccessDenied", 403),
    "S3 404": boto_error("NoSuchKey", 404),
    "S3 412": boto_error("PreconditionFailed", 412),
    "s3fs-translated 403": translate_boto_error(boto_error("AccessDenied", 403)),
    "404": FileNotFoundError("b/o"),
    "ENOSPC": OSError(errno.ENOSPC, "No space left on device"),
    "EACCES": PermissionError(errno.EACCES, "Permission denied"),
    "EROFS": OSError(errno.EROFS, "Read-only file system"),
    "ValueError": ValueError("Bad Request: invalid"),
    "DCP CheckpointException": CheckpointException("save", {0: ConnectionResetError()}),
    "KeyboardInterrupt": KeyboardInterrupt(),
    "ENOSPC wrapping a reset": raised_from(OSError(errno.ENOSPC, "full"), ConnectionResetError()),
}


@pytest.mark.parametrize("name", sorted(TRANSIENT))
def test_transient_errors_are_retried(name: str) -> None:
    assert is_transient(TRANSIENT[name]), describe(TRANSIENT[name])


@pytest.mark.parametrize("name", sorted(PERMANENT))
def test_permanent_errors_are_not_retried(name: str) -> None:
    assert not is_transient(PERMANENT[name]), describe(PERMANENT[name])


def test_a_wrapped_transient_cause_is_found() -> None:
    wrapped = raised_from(RuntimeError("upload failed"), aiohttp.ServerDisconnectedError())
    assert is_transient(wrapped)
    assert describe(boto_error("SlowDown", 503)).startswith("ClientError: HTTP 503")


def test_a_transient_s3_code_is_described_with_its_own_status() -> None:
    """An S3 InternalError is a 500 and was logged as "HTTP 503" (every transient S3 code was);
    a transient code under a status that is not (a store's SlowDown as 400) still counts as a
    503, so that it is retried."""
    assert describe(boto_error("InternalError", 500)).startswith("ClientError: HTTP 500")
    assert describe(translate_boto_error(boto_error("InternalError", 500))).count("HTTP 500")
    slow_down_400 = boto_error("SlowDown", 400)
    assert describe(slow_down_400).startswith("ClientError: HTTP 503")
    assert is_transient(slow_down_400)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(pydantic.ValidationError, match="max_attempts"):
        RetryConfig(max_attempts=0)
    with pytest.raises(pydantic.ValidationError, match="max_backoff_s"):
        RetryConfig(initial_backoff_s=2.0, max_backoff_s=1.0)
    with pytest.raises(pydantic.ValidationError, match="extra"):
        RetryConfig(retries=3)  # type: ignore[call-arg]
    assert RetryConfig().worst_case_s() == pytest.approx(20.0 + 2 * 5.25)


class Flaky:
    """A call that fails with ``errors`` in turn and then returns ``"done"``."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


FAST = RetryConfig(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05, deadline_s=10)


def test_transient_failures_are_retried_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    flaky = Flaky(ConnectionResetError(errno.ECONNRESET, "reset"), boto_error("SlowDown", 503))
    with caplog.at_level(logging.WARNING, logger="ckptmgr.retry"):
        assert Retrier(FAST).call("write x", flaky) == "done"
    assert flaky.calls == 3
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "write x failed (attempt 1 of 4): ConnectionResetError" in messages[0]
    assert "attempt 2 of 4): ClientError: HTTP 503" in messages[1]


def test_permanent_failures_fail_at_once() -> None:
    flaky = Flaky(OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError, match="No space"):
        Retrier(FAST).call("write x", flaky)
    assert flaky.calls == 1


def test_attempts_are_bounded() -> None:
    flaky = Flaky(*[TimeoutError("slow")] * 10)
    with pytest.raises(TimeoutError):
        Retrier(FAST).call("read x", flaky)
    assert flaky.calls == FAST.max_attempts


def test_the_deadline_bounds_the_total_wait() -> None:
    config = RetryConfig(max_attempts=50, initial_backoff_s=0.2, max_backoff_s=0.4, deadline_s=1.0)
    flaky = Flaky(*[ConnectionResetError()] * 50)
    started = time.monotonic()
    with pytest.raises(ConnectionResetError):
        Retrier(config).call("list x", flaky)
    elapsed = time.monotonic() - started
    assert 0.9 <= elapsed < 1.5, elapsed  # the last wait is cut to end at the deadline
    assert 2 < flaky.calls < 10
