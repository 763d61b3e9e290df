"""The symbolizer daemon (`bistouri symbolizer`): the WSGI application (`server`) and its gunicorn
worker, ingest, the store, uploads, tokens and metrics. Built on the symbolizer library one package up.

Layer: only the command line imports it (tests/unit/test_layers.py).
"""
