"""`larql accuracy --suite longctx` and `--suite ppl-position`: long-context scoring in the
compress-then-ask protocol, and per-position perplexity over a long text."""
