"""larql: decode with language models through pluggable KV engines."""

__version__ = "0.1.0"
