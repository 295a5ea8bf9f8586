"""`larql accuracy`: what an engine changes — task accuracy on three prompt corpora (parametric
facts, in-context needles, conflicts) and teacher-forced fidelity against the full cache."""
