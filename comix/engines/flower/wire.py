"""Tensors and metrics to Flower records and back (Message API: ArrayRecord, ConfigRecord), and
the legacy FitIns / FitRes records that Flower's SecAgg+ workflow and mod exchange (tensors as a
list of arrays in sorted name order, the names alongside)."""
from __future__ import annotations

import json

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common import Code, FitIns, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

from ...runtime import to_cpu


def to_arrays(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord(torch_state_dict={n: t.detach().contiguous() for n, t in tensors.items()})


def from_arrays(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return dict(record.to_torch_state_dict()) if len(record) else {}


def to_json(obj) -> ConfigRecord:
    """Anything JSON-able (nested lists such as router gates) as one ConfigRecord string."""
    return ConfigRecord({"json": json.dumps(obj)})


def from_json(record: ConfigRecord):
    return json.loads(record["json"])


def to_parameters(tensors: dict[str, torch.Tensor]):
    """Flower's legacy Parameters: the tensors as float32 arrays in sorted name order."""
    return ndarrays_to_parameters([to_cpu(tensors[n].detach().float()).numpy() for n in sorted(tensors)])


def from_parameters(parameters, names: list[str]) -> dict[str, torch.Tensor]:
    arrays = parameters_to_ndarrays(parameters)
    if len(arrays) != len(names):
        raise ValueError(f"{len(arrays)} arrays for {len(names)} tensor names")
    return {n: torch.from_numpy(np.array(a, dtype=np.float32)) for n, a in zip(sorted(names), arrays)}


def secure_fitins(run: dict, rnd: int, payload: dict[str, torch.Tensor]) -> FitIns:
    """A train request of the secure path: the payload and the run description as a legacy FitIns."""
    return FitIns(to_parameters(payload), {"run": json.dumps(run), "round": rnd, "payload": json.dumps(sorted(payload))})


def secure_fitres(upload: dict[str, torch.Tensor], metrics: dict) -> FitRes:
    """The device's reply that secaggplus_mod masks: weight 1 (SecAgg+'s weighted mean is then the
    plain mean, CoMiGS eq. 4), the upload's names and the metrics in the clear."""
    listing = [[n, list(upload[n].shape)] for n in sorted(upload)]
    return FitRes(Status(Code.OK, ""), to_parameters(upload), 1,
                  {"json": json.dumps({"metrics": metrics, "listing": listing})})
