"""Tensors and metrics to Flower records and back (Message API: ArrayRecord, ConfigRecord)."""
from __future__ import annotations

import json

import torch
from flwr.app import ArrayRecord, ConfigRecord


def to_arrays(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord(torch_state_dict={n: t.detach().contiguous() for n, t in tensors.items()})


def from_arrays(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return dict(record.to_torch_state_dict()) if len(record) else {}


def to_json(obj) -> ConfigRecord:
    """Anything JSON-able (nested lists such as router gates) as one ConfigRecord string."""
    return ConfigRecord({"json": json.dumps(obj)})


def from_json(record: ConfigRecord):
    return json.loads(record["json"])
