"""Analysis of recorded runs: SQL views and analyzers over the DuckDB store."""
