"""Analysis of traces and results: per-language routing statistics, tables and plots."""
