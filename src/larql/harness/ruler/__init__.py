"""`larql accuracy --suite ruler`: RULER's synthetic task families, generated offline from a seed
and the shipped text, scored compress-then-ask with greedy decoding."""
