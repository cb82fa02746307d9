"""Read the metrics an offline wandb run wrote (its .wandb file), independently of wandb's own reader.

The file is wandb's datastore: a 7-byte header (":W&B", magic, version) followed by LevelDB-log records
(4-byte checksum, 2-byte little-endian length, 1-byte type: 1 full, 2 first, 3 middle, 4 last) in
32 KiB blocks; each assembled payload is a protobuf ``wandb_internal_pb2.Record``.
"""

import glob
import json
import os
from typing import Dict, List

BLOCK = 32768
HEADER = 7


def _payloads(data: bytes):
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # block trailer padding
            pos += BLOCK - pos % BLOCK
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        payload = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            yield payload
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            yield pending + payload
            pending = b""


def history(run_dir: str) -> Dict[str, List[float]]:
    """{metric key: [values in logging order]} of every offline run under ``run_dir``/wandb."""
    from wandb.proto import wandb_internal_pb2

    out: Dict[str, List[float]] = {}
    for path in glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "*.wandb")):
        with open(path, "rb") as f:
            data = f.read()
        for payload in _payloads(data):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            if record.WhichOneof("record_type") != "history":
                continue
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                value = json.loads(item.value_json)
                if isinstance(value, (int, float)):
                    out.setdefault(key, []).append(float(value))
    return out
