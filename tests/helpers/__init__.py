"""Shared builders of the tests: tests import them from here, never from a conftest or another test file.

* :mod:`tests.helpers.models`: tiny model configs, seeded parameters, a reference MoE forward;
* :mod:`tests.helpers.corpus`: the tiny three-script corpus and the parallel help-text paragraphs;
* :mod:`tests.helpers.fixtures`: session fixtures on them (a prepared dir, a tiny exported MoE),
  registered for every test by ``tests/conftest.py``;
* :mod:`tests.helpers.checkpoints`: checkpoint files as MoELitModule writes them, and broken ones;
* :mod:`tests.helpers.hf`: tiny random transformers models of every supported family, a tiny imported Llama;
* :mod:`tests.helpers.studies`: a small study spec;
* :mod:`tests.helpers.paths`: the checkout's config files.
"""
