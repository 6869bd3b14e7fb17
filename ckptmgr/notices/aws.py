"""AWS EC2 spot interruption notices through IMDSv2 (``spot/instance-action``)."""

from __future__ import annotations

import json
import os
import time

from ckptmgr.notices._http import UnexpectedStatus, endpoint
from ckptmgr.notices.base import NoticeBoard, Watcher
from ckptmgr.notices.detect import on_aws

ENV_VAR = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
DEFAULT_ENDPOINT = "http://169.254.169.254"
TOKEN_TTL_S = 21600
_TOKEN_MARGIN_S = 60.0  # renew the token this long before it expires


class AwsWatcher(Watcher):
    """Polls ``/latest/meta-data/spot/instance-action`` every ``poll_interval_s`` with an IMDSv2
    token; 404 means no interruption. Posts ``"aws spot instance-action"`` for each new action."""

    name = "aws"

    def __init__(
        self, board: NoticeBoard, *, auto: bool, poll_interval_s: float, request_timeout_s: float
    ) -> None:
        super().__init__(
            board, auto=auto, poll_interval_s=poll_interval_s, request_timeout_s=request_timeout_s
        )
        base = endpoint(ENV_VAR, DEFAULT_ENDPOINT)
        self._token_url = f"{base}/latest/api/token"
        self._action_url = f"{base}/latest/meta-data/spot/instance-action"
        self._token: str | None = None
        self._token_expires = 0.0
        self._last_action: str | None = None

    def present(self) -> bool:
        return bool(os.environ.get(ENV_VAR, "").strip()) or on_aws()

    def probe(self, timeout: float) -> None:
        self._renew_token(timeout)

    def _renew_token(self, timeout: float) -> None:
        headers = {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)}
        response = self.http.request("PUT", self._token_url, headers, timeout)
        if response.status != 200 or not response.text:
            raise UnexpectedStatus(self._token_url, response.status)
        self._token = response.text
        self._token_expires = time.monotonic() + TOKEN_TTL_S - _TOKEN_MARGIN_S

    def poll(self) -> None:
        if self._token is None or time.monotonic() >= self._token_expires:
            self._renew_token(self.request_timeout_s)
        assert self._token is not None
        headers = {"X-aws-ec2-metadata-token": self._token}
        response = self.http.request("GET", self._action_url, headers, self.request_timeout_s)
        if response.status == 404:
            self._last_action = None
            return
        if response.status == 401:  # expired or revoked: the next poll gets a new token
            self._token = None
        if response.status != 200:
            raise UnexpectedStatus(self._action_url, response.status)
        body = response.text
        if body == self._last_action:
            return
        self._last_action = body
        try:
            parsed = json.loads(body)
            detail = f"action={parsed.get('action')} time={parsed.get('time')}"
        except (ValueError, AttributeError):
            detail = body[:200]
        self.post("aws spot instance-action", detail)
