"""The source model's fingerprint: what the stage cache keys and the eval cache key hash a checkpoint by."""

from __future__ import annotations

import hashlib
from pathlib import Path

FULL_HASH_BYTES = 1 << 30  # safetensors files up to this size are hashed whole
SAMPLED_BLOCKS = 64  # bigger ones: their header and this many evenly spaced blocks
BLOCK_BYTES = 1 << 16


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json and the content of every safetensors file.

    Files up to ``FULL_HASH_BYTES`` are hashed whole (a retrained model keeps its shapes, so names, sizes
    and headers alone would reuse stale cached stages); bigger ones by size, header and evenly spaced
    blocks, so that fingerprinting a 90 GB checkpoint stays cheap while any retraining still shows.
    """
    digest = hashlib.sha256()
    digest.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(path.name.encode() + str(size).encode())
        with open(path, "rb") as f:
            if size <= FULL_HASH_BYTES:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    digest.update(chunk)
                continue
            head = f.read(8)
            digest.update(f.read(int.from_bytes(head, "little")) if len(head) == 8 else b"")
            for i in range(SAMPLED_BLOCKS):
                f.seek(i * (size - BLOCK_BYTES) // (SAMPLED_BLOCKS - 1))
                digest.update(f.read(BLOCK_BYTES))
    return digest.hexdigest()
