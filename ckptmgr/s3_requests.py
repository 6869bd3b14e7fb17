"""S3 uploads of small bodies without waiting for ``100 Continue``.

botocore marks every upload whose body is a stream with ``Expect: 100-continue``, and aiohttp
(under s3fs) then sends the headers alone and waits for the server's interim answer before the
body: a round trip more for every PUT, which on a small save's objects file, ``.metadata`` and
commit record is most of its time (tens of milliseconds each against a real bucket). The wait
lets a server refuse a large body before it is sent; for a body of a few MiB the round trip
costs more than sending it to a refusal would. :func:`send_small_bodies_at_once` takes the header
off requests whose body is at most :data:`PROMPT_BODY_BYTES`, just before they are sent (the
header is not signed: SigV4 leaves ``Expect`` out).
"""

from __future__ import annotations

from typing import Any

PROMPT_BODY_BYTES = 8 * 2**20
"""Bodies up to this many bytes are sent with their headers, without ``Expect: 100-continue``."""

_MARK = "_ckptmgr_sends_small_bodies_at_once"
_HANDLER_ID = "ckptmgr-small-bodies-at-once"


def send_small_bodies_at_once(client: Any) -> Any:
    """Make the botocore/aiobotocore S3 ``client`` send bodies of up to
    :data:`PROMPT_BODY_BYTES` without waiting for ``100 Continue``; returns ``client``."""
    if not getattr(client, _MARK, False):
        client.meta.events.register("before-send.s3", _drop_expect_continue, unique_id=_HANDLER_ID)
        setattr(client, _MARK, True)
    return client


def _drop_expect_continue(request: Any, **kwargs: Any) -> None:
    """botocore's ``before-send`` hook: no ``Expect: 100-continue`` on a small body."""
    headers = request.headers
    if "Expect" not in headers:
        return
    try:
        length = int(headers.get("Content-Length", ""))
    except ValueError:  # (no length: a streamed body of unknown size keeps the header)
        return
    if length <= PROMPT_BODY_BYTES:
        del headers["Expect"]
