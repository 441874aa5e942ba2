"""KV-cache storage formats behind one registry (`KV_FORMATS`, `get_kv_format`).

One module per representation; importing this package registers them all.
"""

from kv4rl.engine.kv_formats import fp4, fp8, int4, kv4  # noqa: F401  (registration)
from kv4rl.engine.kv_formats.base import KV_FORMATS, ROTATIONS, KVFormat, get_kv_format, register_kv_format


def kv_format_from_config(kv_config, name: str | None = None) -> KVFormat:
    """Build the format `name` (default `kv_config.format`) with the `engine.kv` keys it takes."""
    name = name or kv_config.format
    if name not in KV_FORMATS:
        return get_kv_format(name)  # raises, naming the key
    options = {key: getattr(kv_config, key) for key in KV_FORMATS[name].options}
    return get_kv_format(name, rotate=kv_config.rotate, **options)


__all__ = [
    "KV_FORMATS", "ROTATIONS", "KVFormat", "get_kv_format", "kv_format_from_config", "register_kv_format",
]
