"""Declarative studies: sweep specs (``spec``), the resumable runner (``runner``), reports (``report``)."""
