"""`larql serve`: an OpenAI-compatible HTTP server whose decode goes through the KV engines and
the same generation loop as `larql run`."""
