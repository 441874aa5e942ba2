"""The weights fingerprint: sha256 over `*.safetensors` (sorted by name; name, then bytes), checked against
hashlib over hand-written files; a build's stored value is used as is, and large folders are not hashed."""

from __future__ import annotations

import hashlib
import json

from kv4rl.models import fingerprint


def _folder(path, files: dict[str, bytes]):
    path.mkdir()
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def test_fingerprint_is_sha256_over_sorted_names_and_bytes(tmp_path) -> None:
    a, b = bytes(range(256)) * 9, b"second shard"
    model = _folder(tmp_path / "m", {"model-2.safetensors": b, "model-1.safetensors": a, "config.json": b"{}"})
    expected = hashlib.sha256(b"model-1.safetensors" + a + b"model-2.safetensors" + b).hexdigest()
    assert fingerprint.weights_sha256(model) == expected
    assert fingerprint.model_fingerprint(model) == expected
    assert fingerprint.row_fingerprint(model) == expected[:16]

    (model / "config.json").write_bytes(b'{"changed": 1}')  # not a weight file
    assert fingerprint.weights_sha256(model) == expected
    flipped = bytearray(a)
    flipped[1000] ^= 1
    (model / "model-1.safetensors").write_bytes(bytes(flipped))
    assert fingerprint.weights_sha256(model) != expected
    (model / "model-1.safetensors").write_bytes(a)
    (model / "model-2.safetensors").rename(model / "model-3.safetensors")  # the name counts too
    assert fingerprint.weights_sha256(model) != expected


def test_a_sharded_folder_is_fingerprinted_over_the_shards_its_index_names(tmp_path) -> None:
    """The loader reads only the shards the index names; a stray `consolidated.safetensors` beside them changed
    the fingerprint though not one loaded weight."""
    a, b = b"first shard", b"second shard"
    index = {"weight_map": {"x": "model-00002-of-00002.safetensors", "y": "model-00001-of-00002.safetensors",
                            "z": "model-00001-of-00002.safetensors"}}
    model = _folder(tmp_path / "m", {"model-00001-of-00002.safetensors": a, "model-00002-of-00002.safetensors": b,
                                     "model.safetensors.index.json": json.dumps(index).encode()})
    expected = hashlib.sha256(b"model-00001-of-00002.safetensors" + a + b"model-00002-of-00002.safetensors" + b)
    assert fingerprint.weights_sha256(model) == expected.hexdigest()
    (model / "consolidated.safetensors").write_bytes(b"the same weights in one file")
    assert fingerprint.weights_sha256(model) == expected.hexdigest()


def test_a_build_record_is_trusted_and_large_or_empty_folders_get_none(tmp_path, monkeypatch) -> None:
    model = _folder(tmp_path / "m", {"model.safetensors": b"x" * 100})
    (model / "kv4rl_testbed.json").write_text(json.dumps({"weights_sha256": "ab" * 32}))
    assert fingerprint.model_fingerprint(model) == "ab" * 32
    older = _folder(tmp_path / "older", {"model.safetensors": b"x" * 100, "kv4rl_tiny.json": b'{"version": 1}'})
    monkeypatch.setattr(fingerprint, "MAX_HASHED_BYTES", 99)
    assert fingerprint.model_fingerprint(older) is None  # over the limit: not hashed
    monkeypatch.setattr(fingerprint, "MAX_HASHED_BYTES", 100)
    assert fingerprint.model_fingerprint(older) == hashlib.sha256(b"model.safetensors" + b"x" * 100).hexdigest()
    assert fingerprint.row_fingerprint(_folder(tmp_path / "empty", {"config.json": b"{}"})) is None


def test_build_record_names_match_the_builders() -> None:
    from kv4rl.models import testbed, tiny

    assert set(fingerprint.BUILD_RECORDS) == {testbed.METADATA_FILE, tiny.METADATA_FILE}
