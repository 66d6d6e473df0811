"""Data pipeline: multilingual corpus → byte-level BPE → litdata token chunks (see ``layout`` for the files)."""
