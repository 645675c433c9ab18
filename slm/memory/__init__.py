"""Memory: the whole-run estimate and pre-flight decision (pure Python) and the live RSS monitor."""
