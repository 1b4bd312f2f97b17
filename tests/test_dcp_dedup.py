"""shoal's SavePlanner: items several ranks hold under one name are balanced by host, or not."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from shoal.dcp import SavePlanner


def _item(fqn: str, numel: int) -> WriteItem:
    size = torch.Size([numel])
    data = TensorWriteData(
        ChunkStorageMetadata(torch.Size([0]), size), TensorProperties(dtype=torch.float32), size
    )
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.TENSOR, tensor_data=data)


def _plans() -> list[SavePlan]:
    """Four ranks on two hosts, each with the same four replicated tensors and a shard of its own."""
    hosts = ["h0", "h0", "h1", "h1"]
    return [
        SavePlan(
            items=[*(_item(f"model.w{i}", 100) for i in range(4)), _item(f"optim.r{r}", 50)], storage_data=h
        )
        for r, h in enumerate(hosts)
    ]


def _bytes_by_host(plans: list[SavePlan]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in plans:
        out[p.storage_data] = out.get(p.storage_data, 0) + sum(
            it.tensor_storage_size() or 0 for it in p.items
        )
    return out


def test_replicated_items_are_written_once_balanced_over_the_hosts() -> None:
    plans = SavePlanner()._dedup_save_plans(_plans())
    names = sorted(it.index.fqn for p in plans for it in p.items)
    assert names == sorted([f"model.w{i}" for i in range(4)] + [f"optim.r{r}" for r in range(4)])
    assert _bytes_by_host(plans) == {"h0": 1200, "h1": 1200}  # 2 of 4 tensors (400 bytes each) + 2 shards


def test_without_balance_the_lowest_rank_writes_every_replicated_item() -> None:
    plans = SavePlanner(balance=False)._dedup_save_plans(_plans())
    assert [it.index.fqn for it in plans[0].items] == [f"model.w{i}" for i in range(4)] + ["optim.r0"]
    assert all([it.index.fqn for it in p.items] == [f"optim.r{r}"] for r, p in enumerate(plans) if r)
    assert _bytes_by_host(plans) == {"h0": 2000, "h1": 400}
