"""JSON records between ranks (``zeropp/comm/objects.py``).

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_comm_objects.py``.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from zeropp.comm.objects import all_gather_json


@pytest.mark.parametrize("obj", [0, "", [], {"a": [None, True, 1e-300]}])
def test_world_of_one_returns_the_object_itself(obj: object, tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert all_gather_json(obj) == [obj]
    finally:
        dist.destroy_process_group()
