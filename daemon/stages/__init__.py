"""The pipeline's stages, one module each (daemon/pipeline.py lists them in their order), and
beside a stage the mechanics only it uses, named after it (extract_spool.py)."""
