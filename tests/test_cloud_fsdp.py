"""The FSDP2 example's 2-rank round trip (train, save_async, resume bit for bit) on the GCS
emulator: every rank writes its own shards to gs://, and a new 2-rank job resumes from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cloud_servers import (  # noqa: F401  (the *_fixture functions are fixtures)
    Server,
    require_cloud_modules,
    server_fixture,
)

require_cloud_modules()

from test_fsdp import EXAMPLE, losses_of, torchrun  # noqa: E402

from ckptmgr.storage import CheckpointStorage  # noqa: E402

pytestmark = [pytest.mark.cloud, pytest.mark.timeout(300)]


@pytest.mark.parametrize("server", ["gcs"], indirect=True)
def test_fsdp_example_saves_and_resumes_exactly_on_gcs(server: Server, tmp_path: Path) -> None:
    url = server.root("fsdp-example")
    options = json.dumps(server.storage_options())
    common = ["--dir", url, "--storage-options", options]
    first = torchrun("gcs-example", 2, EXAMPLE, tmp_path, *common, "--steps", "7")
    assert first.returncode == 0, first.describe()
    assert "committed steps: [3, 6]" in first.stdout, first.describe()
    before = losses_of(first.stdout)

    second = torchrun("gcs-example", 2, EXAMPLE, tmp_path, *common, "--steps", "8")
    assert second.returncode == 0, second.describe()
    assert "resumed from step 6, world size 2" in second.stdout, second.describe()
    after = losses_of(second.stdout)
    assert after[7] == before[7]  # bit for bit (repr of the float)

    storage = CheckpointStorage(url, server.storage_options())
    assert storage.committed_steps() == [3, 6]
    record = storage.read_record(6)
    assert record.world_size == 2
    assert sorted(record.object_files) == ["objects-rank00000.json", "objects-rank00001.json"]
