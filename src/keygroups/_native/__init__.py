"""The compiled core (built from the repository's ``_native/`` Cython and C sources)."""
